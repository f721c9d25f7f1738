"""The GPU code path on the CPU: fla's own Triton kernels under Triton's interpreter (``tests/interpret_checks.py``,
one process with ``TRITON_INTERPRET=1``), against titan_ext's portable kernels; and the job-level option."""

import json
import os
import subprocess
import sys

import pytest
import torch
from launch import REPO

from titan_ext import compat, patching
from titan_ext.errors import ConfigError
from titan_ext.host.job import INTERPRETER_TRITON
from titan_ext.kernels import host_patches as kernel_patches

CHECKS = REPO / "tests" / "interpret_checks.py"
EXPECTED = [
    "chunk_gla", "chunk_gla_packed", "fused_recurrent_gla", "fused_recurrent_gla_packed", "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_packed", "fused_recurrent_gated_delta_rule", "causal_conv1d", "causal_conv1d_packed",
    "rms_norms", "cp2_gla", "cp2_gated_deltanet", "tp2_gated_deltanet", "chunk_kda_packed", "fused_recurrent_kda", "gla_hybrid",
    "kda_op_sac", "kda_op_rows", "kda_op_gva", "compiled_blocks_gla", "compiled_blocks_gla_hybrid",
    "compiled_blocks_gated_deltanet", "compiled_blocks_kda", "op_rms_norm", "op_rms_norm_gated", "op_swiglu_linear",
    "op_causal_conv1d", "op_rotary_embedding", "op_fused_recurrent_gla", "op_chunk_gated_delta_rule",
    "op_chunk_gated_delta_rule_strided",
]


NEEDS_INTERPRETER = pytest.mark.skipif(
    compat.triton_version() < INTERPRETER_TRITON,
    reason=f"Triton {compat.triton_version_string()}'s interpreter cannot run fla's kernels (titan_ext refuses it in one line)",
)


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(CHECKS)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


@NEEDS_INTERPRETER
@pytest.mark.parametrize("case", EXPECTED)
def test_interpret_fla_kernels_agree_with_portable_ones(interpreted, case):
    row = interpreted.get(case)
    assert row is not None, sorted(interpreted)
    assert "error" not in row, row["error"][-3000:]
    print(f"\n{case}: worst relative difference {row['worst']:.1e} ({row['seconds']} s)")
    assert row["worst"] <= row["tol"], row


def test_interpret_bridges_are_host_patch_rows_undone_by_undo():
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    patching.undo()
    before = (autotuner.Autotuner._bench, interpreter.FunctionRewriter.ast_transformer)
    patching.apply_once(kernel_patches.INTERPRETER)
    try:
        assert interpreter.FunctionRewriter.ast_transformer is not before[1]
        assert autotuner.Autotuner._bench is not before[0]
        for patch in kernel_patches.INTERPRETER:
            assert patch.why and patch.checked
    finally:
        patching.undo()
    assert (autotuner.Autotuner._bench, interpreter.FunctionRewriter.ast_transformer) == before


@pytest.mark.parametrize("choice,interpret,expected", [
    ("auto", "1", "fla" if torch.cuda.is_available() else "portable"), ("portable", "0", "portable"), ("fla", "1", "fla"), ("fla", "0", "TRITON_INTERPRET=1"),
    ("triton", "1", "is not one of"),
])
def test_interpret_kernels_option(monkeypatch, choice, interpret, expected):
    """``--titan_ext.kernels``: fla's kernels on the CPU need the interpreter, said in one line."""
    from helpers import job_config

    from titan_ext.host import job

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(compat, "triton_version", lambda: INTERPRETER_TRITON)
    config = job_config("--titan_ext.kernels", choice)
    if expected in ("fla", "portable"):
        assert job.kernel_path(config) == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            job.kernel_path(config)


def test_interpret_kernels_option_names_a_triton_too_old(monkeypatch):
    from helpers import job_config

    from titan_ext.host import job

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(compat, "triton_version", lambda: (3, 6))
    if torch.cuda.is_available():
        pytest.skip("fla's kernels run on the GPU here")
    with pytest.raises(ConfigError, match="interpreter cannot run fla's kernels .*install triton>=3.9"):
        job.kernel_path(job_config("--titan_ext.kernels", "fla"))
