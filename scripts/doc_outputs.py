"""The planner outputs shown in docs/*.md, printed again by the planner: checked, or written into the page.

    python scripts/doc_outputs.py docs/planning.md            # which blocks differ from what the planner prints
    python scripts/doc_outputs.py --write docs/planning.md    # write what it prints into them

A page shows a planner command in a ``bash`` block and, right after it, the output in a plain fenced block:
all of it; after ``<!-- output: first section -->`` its lines up to the first blank one; after
``<!-- output: rows -->`` the lines of the shapes the block shows (digits and spacing aside: the table rows
without the notes between them). The planning time (``planned in ... s``) depends on the machine's load: the
page states its date, and it is not compared. ``tests/test_docs.py`` checks every such block but those of commands nothing here runs (``gpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKS = re.compile(r"^```bash\n(?P<command>python -m titan_ext\.plan (?:[^\n`\\]|\\\n|\\(?!\n))*)\n```\n\n"
                    r"(?:<!-- output: (?P<part>rows|first section) -->\n)?```\n(?P<shown>.*?)^```$", re.S | re.M)
TIME = re.compile(r"^planned in [\d.]+ s$")


@dataclass(frozen=True)
class Shown:
    command: str
    """One line, continuations joined."""
    text: str
    """The block's lines as the page shows them."""
    span: tuple[int, int]
    """Where ``text`` is in the page."""
    part: str
    """"all", "first section" or "rows"."""


def shown_outputs(page: str) -> list[Shown]:
    return [Shown(" ".join(m["command"].replace("\\\n", " ").split()), m["shown"], m.span("shown"), m["part"] or "all")
            for m in BLOCKS.finditer(page)]


def printed(command: str) -> str:
    """What the planner prints for ``command`` (run here, from the repository's root)."""
    from titan_ext.plan import main

    out, here = io.StringIO(), os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(shlex.split(command)[3:])
    finally:
        os.chdir(here)
    if code != 0:
        raise RuntimeError(f"{command}: exit {code}")
    return out.getvalue()


def shape(line: str) -> str:
    """A line with its figures as ``#`` and its spaces as one (a wider figure moves the columns)."""
    return " ".join(re.sub(r"\d[\d.,]*", "#", line).split())


def as_shown(block: Shown, output: str) -> str:
    """What the block would show of ``output``."""
    lines = output.splitlines()
    if block.part == "first section":
        lines = lines[:lines.index("")] if "" in lines else lines
    elif block.part == "rows":
        shapes = {shape(line) for line in block.text.splitlines()}
        lines = [line for line in lines if shape(line) in shapes]
    return "".join(line + "\n" for line in lines)


def difference(block: Shown, output: str) -> str:
    """'' if the page shows what the planner prints (the planning time aside), else the first differing lines."""
    want = [line for line in as_shown(block, output).splitlines() if not TIME.match(line)]
    have = [line.rstrip() for line in block.text.splitlines() if not TIME.match(line)]
    for page_line, printed_line in zip(have, want):
        if page_line != printed_line:
            return f"the page shows\n  {page_line}\nthe planner prints\n  {printed_line}"
    return "" if len(have) == len(want) else f"the page shows {len(have)} lines, the planner prints {len(want)} of them"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="+", type=Path)
    parser.add_argument("--write", action="store_true", help="write the planner's output into the pages")
    parser.add_argument("--skip", nargs="*", default=[], metavar="TEXT",
                        help="leave the blocks of commands holding TEXT as they are (e.g. a plan of minutes)")
    args = parser.parse_args(argv)
    differ = 0
    for path in args.pages:
        page = path.read_text()
        blocks = [b for b in shown_outputs(page) if not any(text in b.command for text in args.skip)]
        for block in reversed(blocks):  # from the end: earlier spans stay where they are
            output = printed(block.command)
            if args.write:
                start, end = block.span
                page = page[:start] + as_shown(block, output) + page[end:]
            elif problem := difference(block, output):
                differ += 1
                print(f"{path}: {block.command}\n{problem}\n")
        if args.write:
            path.write_text(page)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
