"""Triton's autotuning with each kernel's configs compiled together (titan_ext.kernels.autotune,
kernels.host_patches.CUDA), on a driver that compiles for an H100 and launches nothing (bench/compile_only_h100.py):
Triton's compiler and ptxas run on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from titan_ext import patching
from titan_ext.kernels import host_patches as kernel_patches
from titan_ext.kernels.autotune import COMPILE_THREADS, compile_workers, configs_compiled_together

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from compile_only_h100 import compile_only_h100, compiles_recorded  # noqa: E402

sys.path.pop(0)


def _scale(x, y, n, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = None if EVEN else offsets < n
    tl.store(y + offsets, tl.load(x + offsets, mask=mask) * factor, mask=mask)


CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps) for block in (32, 64) for warps in (1, 2)]


def autotuned_kernel(heuristics_inside: bool):
    """A fresh autotuned kernel (its own empty kernel cache) with a heuristic inside or outside the
    autotuner, as fla writes both."""
    jit = triton.jit(_scale)
    even = triton.heuristics({"EVEN": lambda args: args["n"] % 64 == 0})
    tune = triton.autotune(CONFIGS, key=["n"])
    return tune(even(jit)) if heuristics_inside else even(tune(jit))


def timed_by_config(fastest: tuple[int, int]):
    """An ``Autotuner._bench`` standing in for Triton's: compiles as Triton does (the kernel runs through
    the launch-nothing driver) and times the config (BLOCK, num_warps) ``fastest`` fastest."""

    def _bench(self, *args, config, **meta):
        self.fn.run(*args, **meta, **config.all_kwargs())
        return [1.0 if (config.kwargs["BLOCK"], config.num_warps) == fastest else 2.0] * 3

    return _bench


@pytest.fixture
def compile_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with compile_only_h100():
        yield


def launch(kernel, n: int) -> None:
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](torch.ones(n), torch.empty(n), n, 2.0)


@pytest.mark.parametrize("heuristics_inside", [True, False])
def test_a_tuning_pass_compiles_its_configs_in_threads_and_then_times_them_from_the_cache(compile_only, monkeypatch,
                                                                                      heuristics_inside):
    kernel = autotuned_kernel(heuristics_inside)
    monkeypatch.setattr(Autotuner, "_bench", configs_compiled_together(timed_by_config((64, 2)),
                                                                       workers=2))
    with compiles_recorded() as compiled_on:
        launch(kernel, 100)
        assert len(compiled_on) == len(CONFIGS)  # once each: the timing loop found every config compiled
        assert all(name.startswith(COMPILE_THREADS) for name in compiled_on), compiled_on
        autotuner = kernel if heuristics_inside else kernel.fn
        assert autotuner.best_config == triton.Config({"BLOCK": 64}, num_warps=2)

        launch(kernel, 100)  # the same key: tuned already, nothing compiled
        assert len(compiled_on) == len(CONFIGS)
        launch(kernel, 128)  # a new key (and n now divisible by 16 and 64: new kernels): a new pass, in threads again
        assert len(compiled_on) == 2 * len(CONFIGS)
        assert all(name.startswith(COMPILE_THREADS) for name in compiled_on), compiled_on


def test_a_config_chosen_is_the_one_triton_alone_chooses(compile_only, monkeypatch):
    chosen = []
    for bench in (timed_by_config((64, 1)), configs_compiled_together(timed_by_config((64, 1)), workers=2)):
        kernel = autotuned_kernel(heuristics_inside=True)
        monkeypatch.setattr(Autotuner, "_bench", bench)
        launch(kernel, 100)
        chosen.append(kernel.best_config)
    assert chosen[0] == chosen[1] == triton.Config({"BLOCK": 64}, num_warps=1)


def test_a_failure_compiling_in_threads_leaves_triton_to_compile_as_shipped(compile_only, monkeypatch, caplog):
    class Changed:  # a Triton whose AsyncCompileMode no longer takes an executor
        def __init__(self):
            pass

    kernel = autotuned_kernel(heuristics_inside=True)
    monkeypatch.setattr(triton, "AsyncCompileMode", Changed)
    monkeypatch.setattr(Autotuner, "_bench", configs_compiled_together(timed_by_config((32, 2)), workers=2))
    launch(kernel, 100)
    launch(kernel, 128)  # a second pass does not try again
    assert kernel.best_config == triton.Config({"BLOCK": 32}, num_warps=2)
    assert caplog.text.count("compiling Triton's autotuning configs in threads failed") == 1, caplog.text


def test_the_cuda_row_replaces_the_autotuners_timing_loop_and_is_undone():
    patching.undo()  # what the session applied (conftest, on a GPU machine)
    original = vars(Autotuner)["_bench"]
    patching.apply_once(kernel_patches.CUDA)
    assert vars(Autotuner)["_bench"] is not original
    patching.undo()
    assert vars(Autotuner)["_bench"] is original


def test_ranks_on_one_node_share_its_cores(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    alone = compile_workers()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert compile_workers() == 1 <= alone


GPU_CHECK = """
import json, sys, torch
from fla.modules.norm.layernorm import rms_norm
from titan_ext import patching
from titan_ext.kernels import host_patches as kernel_patches
from titan_ext.kernels.autotune import COMPILE_THREADS
device, bench = sys.argv[1:]
sys.path.insert(0, bench)
from compile_only_h100 import compiles_recorded
if device == "cuda":
    patching.apply_once(kernel_patches.CUDA)
else:  # the script itself, under Triton's interpreter
    patching.apply_once(kernel_patches.INTERPRETER)
x = torch.randn(4, 256, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
residual = torch.randn_like(x).requires_grad_()
weight = torch.randn(1024, device=device, requires_grad=True)
with compiles_recorded() as names:
    out, new_residual = rms_norm(x, weight, None, residual=residual, prenorm=True, eps=1e-5)
    (out.float().square().sum() + new_residual.float().sum()).backward()
summed = x.float() + residual.float()
expected = summed * torch.rsqrt(summed.square().mean(-1, keepdim=True) + 1e-5) * weight
print(json.dumps({"compiled": len(names), "in_threads": sum(n.startswith(COMPILE_THREADS) for n in names),
                  "error": ((out.float() - expected).abs().max() / expected.abs().max()).item(),
                  "grad_finite": bool(x.grad.isfinite().all() and weight.grad.isfinite().all())}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_fla_kernels_tuned_with_configs_compiled_together_compute_as_fla_does(tmp_path):
    import json
    import os
    import subprocess

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", GPU_CHECK, "cuda", str(BENCH)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["in_threads"] > 1 and result["compiled"] >= result["in_threads"], result
    assert result["error"] < 1e-2 and result["grad_finite"], result  # bf16 output against an fp32 reference


@pytest.mark.parametrize(("path", "interpreting", "applied"), [
    ("fla", False, ["job", "cuda"]), ("fla", True, ["job", "interpreter"]), ("portable", False, ["job"]),
])
def test_a_job_on_fla_kernels_on_cuda_gets_the_cuda_row(monkeypatch, path, interpreting, applied):
    from titan_ext.host import job

    calls = []
    monkeypatch.setattr(job, "_checked_job", job._checked_job)  # restored after the test, as the next ones are
    monkeypatch.setattr(job, "_cpu_mode", job._cpu_mode)
    from types import SimpleNamespace

    config = SimpleNamespace(checkpoint=SimpleNamespace(enable=False))
    monkeypatch.setattr(job.compat, "importing_trainer_job_config", lambda: config)
    monkeypatch.setattr(job.interrupt, "install", lambda trainer, job_config: None)
    from torchtitan.train import Trainer

    trainer = Trainer.__new__(Trainer)  # no job: only its close is wrapped
    monkeypatch.setattr(job.compat, "importing_trainer", lambda: trainer)
    monkeypatch.setattr(job.preflight, "check_job_config", lambda config, world: None)
    monkeypatch.setattr(job.cpu_mode, "wanted", lambda: False)
    monkeypatch.setattr(job, "kernel_path", lambda config: path)
    monkeypatch.setattr(job, "interpreting", lambda: interpreting)
    monkeypatch.setattr(job.documents, "enabled", lambda config: False)
    monkeypatch.setattr(job.job_patches, "apply_job", lambda: calls.append("job"))
    monkeypatch.setattr(job.cpu_patches, "apply_cpu_mode", lambda: calls.append("cpu_mode"))
    tables = {id(kernel_patches.CUDA): "cuda", id(kernel_patches.INTERPRETER): "interpreter"}
    monkeypatch.setattr(patching, "apply_once", lambda table: calls.append(tables.get(id(table), "other")))
    job.on_trainer_import()
    assert [call for call in calls if call != "other"] == applied
