"""Tensor parallel training through stock ``torchrun -m torchtitan.train`` (CPU, gloo).

TP2 (SP and loss parallel on) and FSDP2 x TP2 (both off) against one process
from one seed checkpoint, losses and grad norms within a relative 1e-5 for
every train spec, are rows of the integration matrix
(``tests/integration_matrix.py``). Here: a user's own plan, and Float8 TP.
"""

import pytest
import torch
from launch import torchrun

STEPS = ("--training.steps", "5")
TP2 = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")


def test_user_plan_from_custom_import_trains(tmp_path):
    """``tests/tp_extension_plan.py`` registers model type ``gla_ext`` and its plan from outside the package."""
    run = torchrun(
        "debug_gla.toml", tmp_path, *STEPS, *TP2,
        "--experimental.custom_import", "tp_extension_plan", "--model.name", "tp_ext_gla",
        nproc=2, env={"PYTHONPATH": "tests"},
    ).check()
    assert "Applied ExtGLATPPlan tensor parallelism" in run.output
    assert run.output.count("tp_extension_plan: ExtGLATPPlan block plan") == 2 * 2  # 2 ranks x 2 blocks
    assert len(run.losses) == 5 and run.losses[-1] < run.losses[0]


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
