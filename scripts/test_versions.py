"""Build a venv with chosen releases of titan_ext's hosts and run the test suite in it.

    python scripts/test_versions.py newest   # the newest releases pyproject.toml allows
    python scripts/test_versions.py lowest   # every declared lower bound
    python scripts/test_versions.py latest   # the newest releases, upper bounds ignored (a host released)

``latest`` is for the day a dependency releases: if the suite passes, raise that upper bound in
pyproject.toml (and docs/tested-versions.md) to what it printed. Extra arguments after ``--`` go to
pytest (``-- -x tests/test_context_parallel.py``). The venv is ``.venv-<mode>`` unless ``--venv`` names one.
``--python`` builds it with another interpreter: pyproject.toml's ``requires-python`` is a bound too, and the
lent GPU machine runs Python 3.12 (``lowest --python python3.12`` is its image less CUDA).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the interpreter running this script may be the lowest one declared
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
HOSTS = ("torch", "torchtitan", "flash-linear-attention", "transformers", "torchao", "datasets", "triton")
"""The packages whose bounds are tested; pyproject.toml gives each a lower and an upper bound."""
LATEST_LIMITS = {"torchtitan": "<0.3"}
"""Kept even by ``latest``: torchtitan 0.3 replaced the TOML configs titan_ext plugs into."""


def declared() -> dict[str, str]:
    """Each dependency's name -> its specifier in pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = {}
    for requirement in project["dependencies"]:
        name, spec = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", requirement).groups()
        specs[name] = spec
    return specs


def lower_bound(spec: str) -> str:
    found = re.search(r"(?:>=|==)\s*([^,\s]+)", spec)
    if not found:
        raise SystemExit(f"pyproject.toml: {spec!r} has no lower bound (>= or ==)")
    return found.group(1)


def upper_bound(spec: str) -> str | None:
    found = re.search(r"(?:<=|==)\s*([^,\s]+)", spec)
    return found.group(1) if found else None


def short_of_bounds(installed: dict[str, str]) -> list[str]:
    """The hosts ``newest`` installed below their declared upper bound: a pip constraint or index (``pip config
    list``), or a Python the newer release does not support, kept it out, and that bound is then not what the
    suite tested."""
    specs = declared()
    return [f"{name} {version} (pyproject.toml allows {upper_bound(specs[name])})"
            for name, version in installed.items()
            if upper_bound(specs[name]) not in (None, version)]


def requirements(mode: str) -> list[str]:
    specs = declared()
    missing = [name for name in HOSTS if name not in specs]
    if missing:
        raise SystemExit(f"pyproject.toml declares no {missing}")
    chosen = []
    for name, spec in specs.items():
        if name in HOSTS and mode == "lowest":
            chosen.append(f"{name}=={lower_bound(spec)}")
        elif name in HOSTS and mode == "latest":
            chosen.append(name + LATEST_LIMITS.get(name, ""))
        else:
            chosen.append(name + spec)
    return chosen + ["pytest"]


def run(*command: str) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def python_release(interpreter: str) -> str | None:
    """``interpreter``'s major.minor, or None where it does not run."""
    try:
        found = subprocess.run([interpreter, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return found.stdout.strip() if found.returncode == 0 else None


def interpreter_problem(python: str | None, venv: Path) -> str | None:
    """Why ``--python`` cannot give ``venv`` its interpreter (one line), or None: a reused venv keeps the Python
    it was built with, so another one asked for would otherwise be silently ignored."""
    if python is None:
        return None
    wanted = python_release(python)
    if wanted is None:
        return f"--python {python!r}: no Python runs by that name or path (e.g. --python python3.12)"
    built = python_release(str(venv / "bin" / "python")) if (venv / "bin" / "python").exists() else None
    if built not in (None, wanted):
        return (f"--python {python!r} is Python {wanted}, but {venv} was built with Python {built}: "
                f"name a new --venv, or remove {venv}")
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("newest", "lowest", "latest"))
    parser.add_argument("--venv", type=Path, help="the venv to (re)use (default .venv-<mode>)")
    parser.add_argument("--python", help="the interpreter a new venv is built with (default: this one)")
    parser.add_argument("--no-tests", action="store_true", help="build the venv and print its versions only")
    args, pytest_args = parser.parse_known_args()
    pytest_args = [a for a in pytest_args if a != "--"] or ["-q", "tests"]
    venv = args.venv or REPO / f".venv-{args.mode}"
    problem = interpreter_problem(args.python, venv)
    if problem:
        parser.error(problem)
    if not (venv / "bin" / "python").exists():
        run(args.python or sys.executable, "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    run(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
    wanted = requirements(args.mode)
    torch = next(r for r in wanted if r.startswith("torch") and not r.startswith(("torchtitan", "torchao")))
    # --upgrade: a reused venv keeps any release that satisfies a range (a venv built last week keeps last
    # week's torch), so ``newest`` and ``latest`` would test the releases they found then, not today's.
    install = (python, "-m", "pip", "install", "-q", "--upgrade")
    run(*install, torch)  # first: its build decides what the rest resolves against
    run(*install, *wanted)
    run(python, "-m", "pip", "install", "-q", "--no-deps", "-e", str(REPO))
    versions = subprocess.run(
        [python, "-c", "import importlib.metadata as m, platform; "
                       f"print(' | '.join([platform.python_version(), *(m.version(p) for p in {HOSTS!r})]))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    print(f"\n| python | {' | '.join(HOSTS)} |\n|{' --- |' * (1 + len(HOSTS))}\n| {versions} |\n", flush=True)
    short = short_of_bounds(dict(zip(HOSTS, versions.split(" | ")[1:]))) if args.mode == "newest" else []
    if short:
        print(f"newest: installed below the upper bound: {', '.join(short)}; a pip constraint or index (see "
              "`pip config list`; `PIP_CONFIG_FILE=/dev/null` ignores pip's config files), or this venv's Python "
              "(no release of the newer one for it), kept the newer release out: these bounds are not what this "
              "run tests\n", flush=True)
    if args.no_tests:
        return 0
    return subprocess.run([python, "-m", "pytest", *pytest_args], cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
