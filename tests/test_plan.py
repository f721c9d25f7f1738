"""``python -m titan_ext.plan``: what it plans for a rank equals what that rank of a real run holds and issues."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "train_configs" / "debug_gla.toml")

# (name, world, parallelism flags): each is planned for every rank and run for real (gloo, 2 steps)
LAYOUTS = [
    ("fsdp2", 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    ("tp2", 2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    ("fsdp2_tp2", 4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
]


def argv(flags: list[str], dump: Path | None = None) -> list[str]:
    out = ["--job.config_file", CONFIG, "--training.steps", "2", *flags]
    return out + (["--job.dump_folder", str(dump)] if dump else [])


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> Path:
    """Every layout's real run in one 4-process launch (``tests/matrix_driver.py``): the 2-rank layouts side by
    side, then the 4-rank one. Each rank records its step 2 (``tests/record_step.py``)."""
    root = tmp_path_factory.mktemp("plan_real")
    for sub in ("logs", "results"):
        (root / sub).mkdir()
    lanes = [{"ranks": [0, 1], "jobs": []}, {"ranks": [2, 3], "jobs": []}]
    phases = [lanes, [{"ranks": [0, 1, 2, 3], "jobs": []}]]
    for i, (name, world, flags) in enumerate(LAYOUTS):
        job = {"id": name, "argv": argv(flags, root / name), "env": {"RECORD_STEP_DIR": str(root / "recorded" / name)}}
        (phases[0][i % 2] if world == 2 else phases[1][0])["jobs"].append(job)
    plan = {"root": str(root), "name": "plan", "preload": ["titan_ext", "record_step"], "phases": phases}
    (root / "plan.json").write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(REPO / "tests" / "matrix_driver.py"), str(root / "plan.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for name, world, _ in LAYOUTS:
        for rank in range(world):
            result = json.loads((root / "results" / f"{name}.rank{rank}.json").read_text())
            assert result["status"] == "ok", (root / "logs" / f"{name}.rank{rank}.log").read_text()[-4000:]
    return root / "recorded"


@pytest.mark.parametrize("name,world,flags", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_planned_ranks_equal_the_real_ranks(real_runs, name, world, flags):
    """Per rank: parameter, gradient and optimizer bytes, and the collectives of step 2's forward and backward
    (kind, group, group size, count, bytes)."""
    from titan_ext.planner.collectives import summary
    from titan_ext.planner.rank import plan_rank
    from titan_ext.plan import job_config_of, prepare

    prepare()
    for rank in range(world):
        real = json.loads((real_runs / name / f"rank{rank}.json").read_text())
        planned = plan_rank(job_config_of(argv(flags)), world, rank)
        assert (planned.param_bytes, planned.grad_bytes, planned.optimizer_bytes) == (
            real["param_bytes"], real["grad_bytes"], real["optimizer_bytes"]), f"rank {rank}"
        assert [list(row) for row in summary(list(planned.collectives))] == real["collectives"], f"rank {rank}"
        assert real["collectives"], "a sharded layout issues collectives"
