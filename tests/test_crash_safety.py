"""A job killed mid-checkpoint restarts from the last complete checkpoint and trains on as if never killed.

Three launches of FSDP2 (CPU, gloo), 10 steps, a checkpoint every 4 steps
(steps 4, 8, 10), the same ``--debug.seed``: an uninterrupted run; a run whose
rank 1 is SIGKILLed right after writing its shard of ``step-8`` (so ``step-8``
exists but has no ``.metadata``); and a restart of that run, into whose folder
a second partial checkpoint, ``step-9``, was planted first (the uninterrupted
run's complete ``step-8`` minus ``.metadata``). torchtitan loads only step
folders with DCP's ``.metadata``, which DCP writes last (atomically, via a
rename) after every rank's data: the restart must load ``step-4``, and its
losses for steps 5-10 must equal the uninterrupted run's exactly, which also
shows that the data order after resuming is the uninterrupted run's.
"""

import shutil

import pytest
from launch import torchrun

CONFIG = "debug_gla.toml"
JOB = (
    "--parallelism.data_parallel_shard_degree", "2", "--training.steps", "10", "--training.seq_len", "64",
    "--training.local_batch_size", "2", "--debug.seed", "7",
    "--checkpoint.enable", "--checkpoint.interval", "4",
    "--experimental.custom_import", "crash_hook",
)
ENV = {"PYTHONPATH": "tests"}


def run(folder, kill=""):
    return torchrun(CONFIG, folder, *JOB, nproc=2, env={**ENV, "CRASH_TEST_KILL": kill})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("uninterrupted")).check()


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    return run(tmp_path_factory.mktemp("crashed"), kill="8:1")


@pytest.fixture(scope="module")
def restarted(crashed, uninterrupted):
    planted = crashed.dump_folder / "checkpoint" / "step-9"
    shutil.copytree(uninterrupted.dump_folder / "checkpoint" / "step-8", planted)
    (planted / ".metadata").unlink()
    return run(crashed.dump_folder).check()


def test_the_kill_leaves_a_partial_checkpoint(crashed):
    checkpoints = crashed.dump_folder / "checkpoint"
    assert crashed.returncode != 0, crashed.output[-3000:]
    assert "Signal 9" in crashed.output or "SIGKILL" in crashed.output, crashed.output[-3000:]
    assert (checkpoints / "step-4" / ".metadata").is_file()
    partial = checkpoints / "step-8"
    assert partial.is_dir() and any(partial.glob("*.distcp")), sorted(p.name for p in checkpoints.rglob("*"))
    assert not (partial / ".metadata").exists()
    assert [m["step"] for m in crashed.metrics] == list(range(1, 9))


def test_restart_loads_the_last_complete_checkpoint(restarted):
    loads = [line.rstrip(".") for line in restarted.output.splitlines() if "Loading the checkpoint from" in line]
    assert len(loads) == 1, restarted.output[-3000:]  # rank 0's: the others print only warnings and errors
    assert all(line.endswith("checkpoint/step-4") for line in loads), loads


def test_restart_trains_on_exactly_as_the_uninterrupted_run(restarted, uninterrupted, crashed):
    assert [m["step"] for m in restarted.metrics] == list(range(5, 11)), restarted.output[-3000:]
    assert crashed.losses[:8] == uninterrupted.losses[:8]
    assert restarted.losses == uninterrupted.losses[4:]
    assert restarted.grad_norms == uninterrupted.grad_norms[4:]
