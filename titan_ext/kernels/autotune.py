"""Triton's autotuning with each kernel's configs compiled together (``host_patches.CUDA``).

Triton compiles an autotuned kernel's configs one at a time, each just before it times it, while the GPU
idles. On a machine whose Triton cache is cold that is minutes before the first step (docs/gpu.md). Triton's own ``AsyncCompileMode`` compiles
in threads (its compiler passes and ptxas release the GIL); compiling a tuning pass's configs that way
first, then timing them one by one as Triton does, leaves what is timed, and so the config chosen, as it
was. ``bench/bench_autotune_compile.py`` measures the gain (docs/gpu.md).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import triton

logger = logging.getLogger(__name__)
_MAX_WORKERS = 32
COMPILE_THREADS = "titan_ext-triton-compile"
"""The name the compiling threads' names start with."""


def compile_workers() -> int:
    """This process's share of the machine's cores: torchrun's ranks on one node compile at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(_MAX_WORKERS, cores // max(1, ranks_here)))


def compile_configs(autotuner, configs, args: tuple, meta: dict, workers: int) -> None:
    """Compile ``configs`` of ``autotuner`` for this call's arguments in ``workers`` threads, into the
    kernel cache its timing reads. A config that fails to compile here is left for Triton's own
    timing loop, which compiles it again and handles the failure as it always has."""
    meta = {name: value for name, value in meta.items() if name != "warmup"}
    with ThreadPoolExecutor(workers, thread_name_prefix=COMPILE_THREADS) as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        for config in configs:
            try:
                autotuner.fn.run(*args, warmup=True, **meta, **config.all_kwargs())
            except Exception:  # noqa: BLE001 - Triton's timing loop meets it again and decides
                continue


def configs_compiled_together(original, workers: int | None = None):
    """``Autotuner._bench`` -> the same, compiling every config of the tuning pass together when the pass
    times its first. Anything unexpected here only costs the speed-up: Triton then compiles as shipped."""
    workers = compile_workers() if workers is None else workers
    failed = []

    def _bench(self, *args, **kwargs):
        if workers > 1 and not failed:
            meta = {name: value for name, value in kwargs.items() if name != "config"}
            try:
                configs = self.prune_configs(meta)
                if len(configs) > 1 and kwargs.get("config") == configs[0]:
                    compile_configs(self, configs, args, meta, workers)
            except Exception as error:  # noqa: BLE001 - see the docstring
                failed.append(error)
                logger.warning(f"titan_ext: compiling Triton's autotuning configs in threads failed ({error!r}); "
                               "Triton compiles them one by one from here on")
        return original(self, *args, **kwargs)

    return _bench
