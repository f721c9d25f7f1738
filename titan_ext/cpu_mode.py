"""Run stock ``torchtitan.train`` on a machine without an accelerator.

torchtitan 0.2.2 picks its device once, at import, and falls back to
``"cuda"`` when nothing is available; several modules copied that choice
into their own globals. This module rebinds every copy to the CPU and a
small device-module shim, so the trainer uses gloo and CPU tensors. On a
machine with an accelerator it does nothing.
"""

from __future__ import annotations

import os
import resource
import types

import torch

from torchtitan.tools.logging import logger


class _CPUDeviceModule:
    """The parts of ``torch.cuda``'s interface that torchtitan calls, for the CPU.

    ``current_device`` must be an int (torchtitan passes it to a barrier), and
    memory statistics report the process's peak resident set size so the
    trainer's memory log stays meaningful.
    """

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    def __getattr__(self, name):
        return getattr(torch.cpu, name)


CPU_DEVICE_MODULE = _CPUDeviceModule()


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def enable_cpu_mode() -> bool:
    """Point torchtitan at the CPU when no accelerator exists; return whether it did."""
    if has_accelerator():
        return False
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, dist_utils, metrics):
        module.device_type = "cpu"
        module.device_module = CPU_DEVICE_MODULE
    parallel_dims.device_type = "cpu"
    if not getattr(enable_cpu_mode, "_logged", False):
        logger.info("titan_ext: no accelerator found; torchtitan runs on CPU with gloo")
        enable_cpu_mode._logged = True
    return True


def on_gloo(mesh) -> bool:
    """Whether a mesh's collectives run on gloo, which lacks ``PREMUL_SUM``."""
    return mesh.device_type == "cpu"
