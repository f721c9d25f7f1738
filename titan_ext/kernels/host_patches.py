"""The changes to fla and Triton that titan_ext's kernel paths need: building fla's Attention without flash-attn
(``BUILD``), fla's kernels under Triton's interpreter (``INTERPRETER``) and on CUDA (``CUDA``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from titan_ext.patching import FLA, TRITON, Patch, scoped


def _configs_timed_equal(original):
    """The interpreter has no GPU driver to time configs with: every config times the same, so each kernel
    runs its first (none is run to be timed)."""

    def _bench(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]

    return _bench


def _loop_variables_as_tensors(original):
    from titan_ext.kernels.interpreter import LoopVariablesAsTensors

    return LoopVariablesAsTensors()


INTERPRETER: tuple[Patch, ...] = (
    Patch(
        "triton.runtime.autotuner:Autotuner._bench",
        "fla's autotuned kernels time each config through a GPU driver, which the interpreter lacks ('0 active "
        "drivers'): every config times equal, so the first is taken",
        TRITON, _configs_timed_equal,
    ),
    Patch(
        "triton.runtime.interpreter:FunctionRewriter.ast_transformer",
        "the interpreter leaves for-loop variables Python ints, on which fla's kernels call .to() ('int' object has "
        "no attribute 'to'): each loop variable becomes an interpreter tensor (kernels.interpreter)",
        TRITON, _loop_variables_as_tensors,
    ),
)
"""Triton's interpreter (``TRITON_INTERPRET=1``) running fla's kernels on the CPU (``--titan_ext.kernels fla``)."""


def _configs_compiled_together(original):
    from titan_ext.kernels.autotune import configs_compiled_together

    return configs_compiled_together(original)


CUDA: tuple[Patch, ...] = (
    Patch(
        "triton.runtime.autotuner:Autotuner._bench",
        "Triton compiles an autotuned kernel's configs one by one as it times them: on a cold Triton cache that is "
        "minutes of one CPU core before the first step (docs/gpu.md). A tuning pass's configs are compiled "
        "together in threads (Triton's AsyncCompileMode), then timed one by one as Triton does (kernels.autotune); fla's code and the configs timed are unchanged",
        TRITON, _configs_compiled_together,
    ),
)
"""A job whose fla kernels run on CUDA (the ``fla`` kernel path, not interpreted)."""


def _sdpa_for_flash_attn(original):
    from titan_ext.kernels.sdpa_attention import sdpa_attn_func

    return sdpa_attn_func if original is None else original


BUILD: tuple[Patch, ...] = (
    Patch(
        "fla.layers.attn:flash_attn_func",
        "fla's Attention refuses to build without the flash-attn package; its forward then runs on SDPA "
        "(titan_ext binds sdpa_attention into the built model)",
        FLA, _sdpa_for_flash_attn,
    ),
)
"""While titan_ext builds one of its own models (``building()``)."""

TABLES = (BUILD, INTERPRETER, CUDA)


@contextlib.contextmanager
def building(patches: tuple[Patch, ...] = BUILD) -> Iterator[None]:
    """``BUILD`` rows while titan_ext constructs a model; restored right after."""
    with scoped(patches):
        yield
