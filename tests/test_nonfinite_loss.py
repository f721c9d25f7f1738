"""A NaN loss (on one rank) stops the job before its update and checkpoint, or is skipped on request."""

import math

from launch import REPO, torchrun

CONFIG = "debug_gla.toml"
NAN_JOB = (
    "--experimental.custom_import", "nan_injection", "--model.name", "fla_gla_nan", "--training.steps", "5",
    "--parallelism.data_parallel_shard_degree", "2",
)
ENV = {"NAN_AT_STEP": "3", "PYTHONPATH": str(REPO / "tests")}


def test_nan_loss_stops_the_job_before_its_checkpoint(tmp_path):
    run = torchrun(
        CONFIG, tmp_path, *NAN_JOB, "--checkpoint.enable", "--checkpoint.interval", "1", nproc=2, env=ENV
    )
    assert run.returncode != 0, run.output[-3000:]
    assert "non-finite loss (NaN or Inf) at step 3: stopped before its update and checkpoint" in run.output
    saved = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert saved == ["step-1", "step-2"], saved
    assert [m["step"] for m in run.metrics] == [1, 2]


def test_nan_loss_step_is_skipped_on_request(tmp_path):
    run = torchrun(CONFIG, tmp_path, *NAN_JOB, "--titan_ext.nonfinite_loss", "skip", nproc=2, env=ENV).check()
    assert run.output.count("non-finite loss at step 3: skipped its update") == 2  # both ranks agree
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5]
    assert math.isnan(run.losses[2])
    assert all(math.isfinite(x) for i, x in enumerate(run.losses) if i != 2)
    assert run.losses[4] < run.losses[0]
