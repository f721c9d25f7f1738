"""scripts/test_versions.py: what each mode installs, and its word when ``newest`` falls short of a bound."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("test_versions", REPO / "scripts" / "test_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_mode_pins_the_hosts_as_it_says():
    script = load_script()
    declared = script.declared()
    lowest = dict(r.split("==") for r in script.requirements("lowest") if "==" in r)
    assert set(script.HOSTS) <= lowest.keys()
    assert lowest["torch"] == script.lower_bound(declared["torch"])
    assert f"torch{declared['torch']}" in script.requirements("newest")
    latest = script.requirements("latest")
    assert "torch" in latest and "torchtitan<0.3" in latest


def test_newest_names_each_host_installed_below_its_upper_bound():
    script = load_script()
    declared = script.declared()
    at_bounds = {name: script.upper_bound(declared[name]) for name in script.HOSTS}
    assert all(at_bounds.values()), at_bounds  # every host declares an upper bound
    assert script.short_of_bounds(at_bounds) == []
    below = {**at_bounds, "torch": "2.14.1"}
    assert script.short_of_bounds(below) == [f"torch 2.14.1 (pyproject.toml allows {at_bounds['torch']})"]


def test_a_python_that_does_not_run_or_differs_from_the_reused_venvs_is_one_line(tmp_path):
    import sys

    script = load_script()
    this = "%d.%d" % sys.version_info[:2]
    assert script.interpreter_problem(None, tmp_path) is None  # no --python: the venv's own, or this one
    assert script.interpreter_problem(sys.executable, tmp_path / "new") is None
    assert "no Python runs by that name" in script.interpreter_problem("python9.9", tmp_path)
    other = tmp_path / "venv" / "bin" / "python"  # a "venv" whose interpreter reports another Python
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\necho 3.99\n")
    other.chmod(0o755)
    problem = script.interpreter_problem(sys.executable, tmp_path / "venv")
    assert problem == (f"--python {sys.executable!r} is Python {this}, but {tmp_path / 'venv'} was built with "
                       f"Python 3.99: name a new --venv, or remove {tmp_path / 'venv'}"), problem
