"""CPU mode: stock ``torchtitan.train`` on a machine without an accelerator.

torchtitan 0.2.2 picks its device once, at import, and falls back to
``"cuda"`` when nothing is available. In CPU mode the patches in
``titan_ext.host.cpu_patches.CPU_MODE`` point it at the CPU and gloo, for
torchtitan's own models as well as titan_ext's. CPU mode is decided once per
process, when torchtitan's Trainer imports titan_ext:

* on when no accelerator exists, with one WARNING line saying so;
* an error, not a silent CPU run, when NVIDIA devices or
  ``CUDA_VISIBLE_DEVICES`` are there but torch cannot use CUDA;
* forced with ``TITAN_EXT_CPU=1`` (debugging on a GPU machine).
"""

from __future__ import annotations

import glob
import os
import resource
import types

import torch

from titan_ext.errors import ConfigError

FORCE_ENV = "TITAN_EXT_CPU"


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


def nvidia_hint() -> str | None:
    """Why this machine looks like it should have CUDA, or None."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible not in (None, "", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible!r} is set"
    devices = sorted(glob.glob("/dev/nvidia[0-9]*"))
    if devices:
        return f"NVIDIA devices are present ({devices[0]})"
    return None


def forced() -> bool:
    """``TITAN_EXT_CPU=1``: CPU mode (and portable kernels) even where CUDA works."""
    return os.environ.get(FORCE_ENV) == "1"


def wanted() -> bool:
    """Whether this process should run torchtitan on the CPU; a machine with unusable CUDA is an error."""
    if forced():
        return True
    if torch.accelerator.is_available():
        return False
    hint = nvidia_hint()
    if hint is not None:
        build = torch.__version__ if torch.version.cuda else f"{torch.__version__}, a CPU-only build"
        raise ConfigError(
            f"{hint} but torch ({build}) cannot use CUDA; install a CUDA build of torch or fix the driver, "
            f"or set {FORCE_ENV}=1 to train on the CPU"
        )
    return True


def on_gloo(mesh) -> bool:
    """Whether a mesh's collectives run on gloo, which lacks ``PREMUL_SUM``."""
    return mesh.device_type == "cpu"
