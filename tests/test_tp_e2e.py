"""Tensor parallel training through stock ``torchrun -m torchtitan.train`` (CPU, gloo).

TP2 (SP and loss parallel on), FSDP2 x TP2 (both off) and a user's own plan
from ``custom_import`` (``readme_ext``) against one process from one seed
checkpoint are rows of the integration matrix (``tests/integration_matrix.py``).
Here: Float8 TP, which needs NCCL.
"""

import pytest
import torch
from launch import torchrun

STEPS = ("--training.steps", "5")
TP2 = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Float8 TP all-gathers float8 tensors, which gloo cannot carry (RuntimeError: Invalid scalar type); "
    "needs NCCL",
)
def test_float8_tp_trains(tmp_path):
    run = torchrun(
        "debug_gla.toml", tmp_path, *STEPS, *TP2,
        "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", nproc=2,
    ).check()
    assert "float8=True" in run.output
    assert len(run.losses) == 5 and run.losses[-1] < run.losses[0]
