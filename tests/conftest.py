"""Fixtures shared by the unit tests (plain helper functions are in ``helpers.py``)."""

from __future__ import annotations

import pytest


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
