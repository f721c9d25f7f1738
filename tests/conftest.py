"""Fixtures shared by the unit tests (plain helper functions are in ``helpers.py``)."""

from __future__ import annotations

import os

import pytest

# The suite proves titan_ext on the CPU: multi-rank jobs on gloo (one GPU cannot hold 2-4 NCCL
# ranks) and titan_ext's models on their portable kernels, also on a GPU machine, where this
# forces CPU mode in every launched job too. The CUDA tests (test_gla_op, test_sdpa_fallback)
# put their tensors on the GPU themselves and skip without one.
os.environ.setdefault("TITAN_EXT_CPU", "1")
# One intra-op thread in the suite's processes (pytest's and the scripts it starts; its torchrun launches set
# their own): the tests' tensors are tiny, and on the 2-core CI machine a second thread mostly spin-waits
# for the first while the matrix needs that core (bench_train.py --cpu-tiny: 26 CPU s on 2 threads, 13 on 1;
# interpret_checks.py: 57 and 47, 2026-11-26).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def gloo_group():
    """A one-rank gloo process group for this test (skipped if the process already has one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def cp_mesh():
    """Rank 1 of a fake 2-rank process group and its 1-D ``cp`` mesh: context-parallel code built for a
    rank without the other."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


MATRIX_TESTS = "test_integration_matrix.py"


@pytest.hookimpl(trylast=True)  # after any plugin's reordering (--ff, ...)
def pytest_collection_modifyitems(items):
    """The integration matrix's tests last, and before them the tests that read jobs run inside its launch
    (``guest_runs``): the launch (``matrix_launch``) runs while the others do."""
    items.sort(key=lambda item: 2 if item.path.name == MATRIX_TESTS else "guest_runs" in item.fixturenames)


@pytest.fixture(scope="session", autouse=True)
def matrix_launch(request, tmp_path_factory):
    """The integration matrix's one launch, started with the session's first test when the session reads it
    (the ``matrix`` fixture), and read by its tests, which run last. On the 2-core CI machine most other tests
    keep one core busy (one process, or one waiting on a child): the matrix's processes use the other one
    instead of running alone after them (``tests/integration_matrix.py``, Budget). Its processes run at a lower
    priority (nice 10, their sessions too: ``matrix_driver.keep_niceness_across_sessions``): the tests keep
    their core, and the matrix, which keeps both busy on its own, is what is left at the end. (Not lower: a test's multi-rank launch must not stall a matrix job past its 60 s
    collective timeout.)

    Test files with multi-rank jobs of their own run them in the same launch (``guest_runs``): a module's
    ``matrix_guest(root)`` gives them (an ``integration_matrix.Guest``), when the session runs a test of it
    that reads them."""
    items = request.session.items
    with_rows = any("matrix" in item.fixturenames for item in items)
    guests = {item.module.__name__: item.module.matrix_guest for item in items if "guest_runs" in item.fixturenames}
    if not with_rows and not guests:
        yield None
        return
    from integration_matrix import ALL_ROWS, SPECS, start_matrix

    root = tmp_path_factory.mktemp("matrix")
    # 3000 s: the launch took about 450 s on CI machines until 2026-11-26; on 2026-11-27's, about 2.5x slower,
    # it took about 1400 s beside the other tests once jobs freed their process groups (past 1500 s before,
    # with hundreds of gloo threads left by earlier jobs); CI's own limit is 5400 s.
    launch = start_matrix(root, list(SPECS), ALL_ROWS if with_rows else [], timeout=3000, niceness=10,
                          guests={name: guest(root / name) for name, guest in guests.items()})
    try:
        yield launch
    finally:
        launch.stop()  # the session ended before its tests read it (-x, an interrupt): no workers left behind


@pytest.fixture(scope="module")
def guest_runs(request, matrix_launch):
    """The launch's root, once the jobs of this module's ``matrix_guest`` have finished in it."""
    return matrix_launch.guest_finished(request.module.__name__)


@pytest.fixture(scope="session", autouse=True)
def fla_kernels_tuned_as_in_cuda_jobs():
    """On a GPU machine the CUDA tests' fla kernels autotune as titan_ext's jobs on CUDA do, their configs
    compiled together (``kernels.host_patches.CUDA``): on a fresh H200 they took 403 s, compiling and tuning one config
    at a time."""
    import torch

    if torch.cuda.is_available():
        from titan_ext import patching
        from titan_ext.kernels import host_patches as kernel_patches

        patching.apply_once(kernel_patches.CUDA)
    yield
