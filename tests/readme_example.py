"""The documented extension example, read out of docs/extending.md so the tests run what the docs show.

Its section "Your own model and TP plan" holds fenced blocks whose info string
names a file (```` ```python my_gla.py ````) and one ```` ```bash ```` block
with the command that trains it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
SECTION = "## Your own model and TP plan"
FENCE = re.compile(r"^```(\w+)[ \t]*(\S*)\n(.*?)^```", re.S | re.M)


def section(text: str) -> str:
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:end if end > 0 else len(text)]


def example(readme: Path = README) -> tuple[dict[str, str], list[str]]:
    """(file name -> content, the bash block's arguments after ``-m torchtitan.train``)."""
    files, commands = {}, []
    for language, name, body in FENCE.findall(section(readme.read_text())):
        if name:
            files[name] = body
        elif language == "bash":
            commands.append(shlex.split(body.replace("\\\n", " ")))
    if len(commands) != 1 or "torchtitan.train" not in commands[0]:
        raise ValueError(f"{readme}: {SECTION!r} must hold one bash block running torchtitan.train, found {commands}")
    command = commands[0]
    return files, command[command.index("torchtitan.train") + 1:]


def write_example(folder: Path, readme: Path = README) -> list[str]:
    """Write the example's files into ``folder``; return the command's arguments, the files' names as paths there."""
    files, argv = example(readme)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (folder / name).write_text(content)
    return [str(folder / arg) if arg in files else arg for arg in argv]
