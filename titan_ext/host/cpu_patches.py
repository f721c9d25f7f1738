"""CPU mode's changes to torchtitan and torch, and the host warnings and log lines a CPU run cannot act on.

Applied when torchtitan's ``Trainer`` imports titan_ext (its ``custom_import``) on a machine without an
accelerator (or with ``TITAN_EXT_CPU=1``; ``titan_ext.cpu_mode``): stock torchtitan is pointed at the CPU and
gloo. These stay for the rest of that process, which is that job's; ``patching.undo()`` restores every original.
"""

from __future__ import annotations

import math

from titan_ext import patching
from titan_ext.patching import TORCH, TORCHTITAN, Patch


def _cpu_device_module(_original):
    from titan_ext.cpu_mode import CPU_DEVICE_MODULE

    return CPU_DEVICE_MODULE


def _always_sum_on_gloo(original):
    """FSDP reduces with PREMUL_SUM when a divide factor is set; gloo has no PREMUL_SUM, so force SUM."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    return set_gradient_divide_factor


def _ring_attention_on_cpu(original):
    from titan_ext.kernels.ring_attention import HANDLERS

    return {**original, **HANDLERS}


def _no_peak_flops(_original):
    """A CPU has no peak in torchtitan's table: report MFU as 0 without its lspci/A100 warnings."""
    return lambda device_name: math.inf


_CPU = "torchtitan picks its device once at import and falls back to 'cuda' without an accelerator"
CPU_MODE: tuple[Patch, ...] = (
    Patch("torchtitan.tools.utils:device_type", _CPU, TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.tools.utils:device_module", _CPU + "; the trainer calls set_device/memory stats", TORCHTITAN, _cpu_device_module),
    Patch("torchtitan.distributed.utils:device_type", _CPU + "; gloo instead of nccl", TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.distributed.utils:device_module", _CPU + "; barrier needs an int device", TORCHTITAN, _cpu_device_module),
    Patch("torchtitan.distributed.parallel_dims:device_type", _CPU + "; meshes on cpu", TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.components.metrics:device_type", _CPU + "; memory monitor", TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.components.metrics:device_module", _CPU + "; memory monitor", TORCHTITAN, _cpu_device_module),
    Patch("torchtitan.tools.utils:get_peak_flops", "no CPU entry; warns twice per rank and assumes an A100", TORCHTITAN, _no_peak_flops),
    Patch(
        "torch.distributed.fsdp:FSDPModule.set_gradient_divide_factor",
        "torchtitan's own apply_fsdp sets factor 1.0, which reduces with PREMUL_SUM: gloo lacks it",
        TORCH, _always_sum_on_gloo,
    ),
    Patch(
        "torch.distributed.tensor.experimental._context_parallel._attention:custom_ops",
        "torch's CP dispatcher (which torchtitan's apply_cp_to_attention_module enables from this table) rings only "
        "CUDA's SDPA kernels: the CPU kernel and its backward run the same ring template (kernels.ring_attention)",
        "torch 2.13", _ring_attention_on_cpu,
    ),
)

# Python warnings a CPU run cannot act on: (message regex, why).
CPU_MODE_WARNINGS: tuple[tuple[str, str], ...] = (
    ("Triton is not supported on current platform", "fla, on import: titan_ext's portable kernels run instead"),
    ("DTensor (random operators|manual_seed)", "torch: gloo meshes; titan_ext does not draw random numbers on DTensors"),
    ("Set timeout is now only supported", "torch, for gloo groups after step 1; the timeout is still applied"),
    ("'set_vital' is deprecated", "torchdata's dataloader, on every job"),
    ("In CPU autocast, but the target dtype is not supported",
     "torchtitan autocasts 1-process and DDP jobs to --training.mixed_precision_param; for float32 (the debug "
     "TOMLs') the CPU's autocast declines, and the job runs in float32 as asked"),
)

# Log records a CPU run cannot act on: (logger, message part, why).
CPU_MODE_LOGS: tuple[tuple[str, str, str], ...] = (
    ("torchao", "Failed to load", "torchao's CUDA extensions (mxfp8, cutlass), on import"),
    ("", "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]", "torchtitan sets an NCCL variable; gloo never reads it"),
    ("", "Peak FLOPS used for computing MFU: inf",
     "the CPU has no peak FLOPS (get_peak_flops above): no MFU to compute, and the step line prints none"),
)

TABLES = (CPU_MODE,)


def apply_cpu_mode() -> None:
    """``CPU_MODE`` and its warning/log filters, once per process."""
    if patching.first_time(CPU_MODE):
        patching.apply(CPU_MODE)
        patching.quiet([message for message, _ in CPU_MODE_WARNINGS], [(name, part) for name, part, _ in CPU_MODE_LOGS])
