"""The command: ``python -m titan_ext.census`` (the package's docstring says what it does and how it runs)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from titan_ext import census
from titan_ext.census.table import render, stale_lines
from titan_ext.census.workers import run_census


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_ext.census", description=census.__doc__.split("\n")[0])
    parser.add_argument("--types", default="", help="comma-separated model types (transformers' and fla's)")
    parser.add_argument("--out", default="", help="write the Markdown here (default: stdout)")
    parser.add_argument("--check", default="", help="exit 1 if this file differs from what the run produces")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="CPU seconds one step of a type may take before it is a TIMEOUT (default 30)")
    parser.add_argument("--logs", default="", help="keep each type's config, job log and results.json here")
    parser.add_argument("--library", choices=["all", "transformers", "fla"], default="all")
    options = parser.parse_args(argv)
    begin = time.monotonic()

    os.environ.setdefault("TITAN_EXT_CPU", "1")  # the same table on a GPU machine
    os.environ.setdefault("OMP_NUM_THREADS", "1" if options.jobs > 1 else "2")
    import torch  # noqa: F401  (before the fork: each worker costs its work, not its imports)
    import torchtitan.train  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import titan_ext  # noqa: F401

    assert "fla" not in sys.modules, "the census's own process must not import fla (see the package's docstring)"
    wanted = {t for t in options.types.split(",") if t} or None
    libraries = ["transformers", "fla"] if options.library == "all" else [options.library]
    tasks = [("transformers", t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
             if "transformers" in libraries and (wanted is None or t in wanted)]
    root = Path(options.logs).resolve() if options.logs else Path(tempfile.mkdtemp(prefix="titan_ext_census_"))
    root.mkdir(parents=True, exist_ok=True)
    imported = time.monotonic() - begin
    try:
        run = run_census(tasks, max(1, options.jobs), options.timeout, root, "fla" in libraries, wanted,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
        text = render(run["cells"], root, libraries)
        if options.logs:
            (root / "results.json").write_text(json.dumps(
                {f"{lib}/{t}": {**c, "seconds": round(run["seconds"].get((lib, t), 0.0), 2),
                                "step_seconds": run["steps"].get((lib, t), {})}
                 for (lib, t), c in sorted(run["cells"].items())}, indent=1))
    finally:
        if not options.logs:
            shutil.rmtree(root, ignore_errors=True)
    jobs = sorted(((s, f"{lib}/{t}") for (lib, t), s in run["seconds"].items()), reverse=True)
    total = time.monotonic() - begin
    print(f"census: {len(jobs)} types in {total:.1f} s wall ({imported:.1f} s imports) on {options.jobs} workers; "
          f"per type {sum(s for s, _ in jobs) / max(1, len(jobs)):.2f} s mean; slowest: "
          + ", ".join(f"{name} {s:.1f} s" for s, name in jobs[:5]), file=sys.stderr)
    if options.out:
        Path(options.out).write_text(text)
    elif not options.check:
        sys.stdout.write(text)
    if options.check:
        diff = stale_lines(options.check, text)
        if diff:
            print("\n".join(diff))
            print(f"{options.check} is stale: regenerate it with python -m titan_ext.census --out {options.check}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
