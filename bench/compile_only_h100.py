"""A Triton driver that compiles for an H100 (sm_90) on a machine without one, and launches nothing.

Triton's compiler and ptxas (in Triton's wheel) need no GPU: with this driver active, fla's Python runs
its whole autotuning (every config of every kernel compiled, each "timed" at 1 ms, so the first is kept)
on CPU tensors whose values nothing computes. What it is for: measuring and testing how Triton's
autotuning compiles (``titan_ext.kernels.autotune``), not results.

    import fla.ops.gla                       # first: fla reads the real driver when imported
    with compile_only_h100(), compiles_recorded() as threads: ...
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import triton.compiler
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

H100_SHARED_MEMORY = 232_448


class _Utils:
    @staticmethod
    def load_binary(name, kernel, shared, device):
        return None, None, 0, 0, 1024  # module, function, registers, spills, max threads

    @staticmethod
    def get_device_properties(device):
        return {"max_shared_mem": H100_SHARED_MEMORY, "multiprocessor_count": 132, "max_num_regs": 65_536,
                "warpSize": 32}

    @staticmethod
    def unload_module(module):
        pass


class CompileOnlyH100:
    utils = _Utils()

    @staticmethod
    def launcher_cls(src, metadata):
        return lambda *args: None

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        def time_it(kernel_call, quantiles=None, **_):
            kernel_call()
            return [1.0, 1.0, 1.0] if quantiles else 1.0

        return time_it

    def get_empty_cache_for_benchmark(self):
        return torch.empty(1)

    def clear_cache(self, cache):
        pass

    def map_python_to_cpp_type(self, ty: str) -> str:
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


@contextlib.contextmanager
def compile_only_h100() -> Iterator[CompileOnlyH100]:
    fake, previous = CompileOnlyH100(), driver._active  # None until Triton first looks for the machine's
    driver.set_active(fake)
    try:
        yield fake
    finally:
        driver._active = previous


@contextlib.contextmanager
def compiles_recorded() -> Iterator[list[str]]:
    """Every Triton compile started inside (on any driver), as the name of the thread that ran it. A kernel
    binds Triton's ``compile`` at its first run, so one first run inside goes on recording after the ``with``."""
    threads, compile = [], triton.compiler.compile

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return compile(*args, **kwargs)

    triton.compiler.compile = recorded
    try:
        yield threads
    finally:
        triton.compiler.compile = compile
