"""End to end through stock ``torchrun -m torchtitan.train`` with the shipped debug TOML (CPU, gloo)."""

import shutil

import pytest
from launch import assert_close, from_seed, seed_checkpoint, torchrun

CONFIG = "debug_gla.toml"


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return seed_checkpoint(CONFIG, tmp_path_factory.mktemp("seed"))


@pytest.mark.parametrize(
    "mode,flags",
    [
        ("fsdp2", ("--parallelism.data_parallel_shard_degree", "2")),
        ("ddp2", ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1")),
    ],
)
def test_trains_and_loss_falls(tmp_path, mode, flags):
    run = torchrun(CONFIG, tmp_path, *flags, nproc=2).check()
    assert len(run.losses) == 10, run.output[-3000:]
    assert run.losses[-1] < run.losses[0] - 0.5, f"{mode}: loss did not fall: {run.losses}"
    assert f"Applied {'FSDP' if mode == 'fsdp2' else 'DDP'}" in run.output


def test_ddp_and_fsdp_gradients_agree(tmp_path, seed):
    """DDP sums gradients like FSDP does (torchtitan 0.2.2's DDP halves them at world size 2)."""
    steps = ("--training.steps", "3", "--training.max_norm", "1e9")
    fsdp = torchrun(CONFIG, tmp_path / "fsdp", *from_seed(seed), *steps, "--parallelism.data_parallel_shard_degree", "2", nproc=2).check()
    ddp = torchrun(
        CONFIG, tmp_path / "ddp", *from_seed(seed), *steps,
        "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1", nproc=2,
    ).check()
    assert_close(ddp.grad_norms[:1], fsdp.grad_norms[:1], 1e-5, "step-1 grad norm, DDP vs FSDP")
    assert_close(ddp.losses, fsdp.losses, 1e-5, "loss, DDP vs FSDP")


def test_resume_reproduces_uninterrupted_run(tmp_path, seed):
    flags = (
        *from_seed(seed), "--checkpoint.interval", "5",
        "--parallelism.data_parallel_shard_degree", "2",
    )
    full = torchrun(CONFIG, tmp_path, *flags, nproc=2).check()
    assert len(full.losses) == 10
    # Stop after step 5: drop everything saved later, then start the same job again.
    shutil.rmtree(tmp_path / "checkpoint" / "step-10")
    resumed = torchrun(CONFIG, tmp_path, *flags, nproc=2).check()
    assert [m["step"] for m in resumed.metrics] == list(range(6, 11)), resumed.output[-3000:]
    assert resumed.losses == full.losses[5:], f"resumed {resumed.losses} vs uninterrupted {full.losses[5:]}"
