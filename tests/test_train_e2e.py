"""End to end through stock ``torchrun -m torchtitan.train`` with the shipped debug TOML (CPU, gloo).

Runs are shared between tests through module fixtures: every process start
costs ~15 s of imports on the CI machine.
"""

import shutil

import pytest
from launch import assert_close, from_seed, seed_checkpoint, torchrun

CONFIG = "debug_gla.toml"
# No clipping: it would hide a gradient scale error (as it did for torchtitan 0.2.2's DDP).
NO_CLIP = ("--training.max_norm", "1e9")
FSDP2 = ("--parallelism.data_parallel_shard_degree", "2")
DDP2 = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1")


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return seed_checkpoint(CONFIG, tmp_path_factory.mktemp("seed"))


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, seed):
    folder = tmp_path_factory.mktemp("fsdp")
    return torchrun(CONFIG, folder, *from_seed(seed), "--checkpoint.interval", "5", *NO_CLIP, *FSDP2, nproc=2).check()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, seed):
    return torchrun(CONFIG, tmp_path_factory.mktemp("ddp"), *from_seed(seed), *NO_CLIP, *DDP2, nproc=2).check()


@pytest.mark.parametrize("mode", ["fsdp_run", "ddp_run"])
def test_trains_ten_steps_and_loss_falls(request, mode):
    run = request.getfixturevalue(mode)
    assert [m["step"] for m in run.metrics] == list(range(1, 11)), run.output[-3000:]
    assert run.losses[-1] < run.losses[0] - 0.5, f"{mode}: loss did not fall: {run.losses}"
    assert ("Applied FSDP" if mode == "fsdp_run" else "Applied DDP") in run.output


def test_ddp_gradients_equal_fsdp_gradients(fsdp_run, ddp_run):
    """Same seed checkpoint, same data: DDP must sum gradients as FSDP does."""
    assert_close(ddp_run.grad_norms[:1], fsdp_run.grad_norms[:1], 1e-5, "step-1 grad norm, DDP vs FSDP")
    assert_close(ddp_run.losses, fsdp_run.losses, 1e-5, "loss, DDP vs FSDP")


def test_resume_reproduces_uninterrupted_run(fsdp_run, seed):
    folder = fsdp_run.dump_folder
    assert (folder / "checkpoint" / "step-5").is_dir()
    # Stop after step 5: drop everything saved later, then start the same job again.
    shutil.rmtree(folder / "checkpoint" / "step-10")
    resumed = torchrun(CONFIG, folder, *from_seed(seed), "--checkpoint.interval", "5", *NO_CLIP, *FSDP2, nproc=2).check()
    assert [m["step"] for m in resumed.metrics] == list(range(6, 11)), resumed.output[-3000:]
    assert resumed.losses == fsdp_run.losses[5:], f"resumed {resumed.losses} vs uninterrupted {fsdp_run.losses[5:]}"
