"""The parallelisms' changes to their hosts: torch settings a feature sets for its own job (``PER_JOB``), and
torchtitan's gradient clipping for a pipeline with a tied weight (``PIPELINE``)."""

from __future__ import annotations

from titan_ext.patching import TORCH, TORCHTITAN, Patch, Setting

OPTIMIZE_DDP = Setting(
    "torch._dynamo.config:optimize_ddp",
    "'ddp_optimizer' for DDP with compile: dynamo splits the graph at DDP's buckets (titan_ext.parallel.parallelize.apply_ddp)",
    TORCH,
)
CP_ROTATE_METHOD = Setting(
    "torch.distributed.tensor.experimental._attention:_cp_options.rotate_method",
    "how the ring passes keys and values: --parallelism.context_parallel_rotate_method, which torchtitan 0.2.2 "
    "applies only in its own validator (titan_ext.parallel.context_parallel)",
    TORCH,
)
PER_JOB: tuple[Setting, ...] = (OPTIMIZE_DDP, CP_ROTATE_METHOD)
"""Set by the feature that needs it, for its own job (each names it)."""

TIED_COPY = "_titan_ext_tied_copy"
"""Marks a pipeline stage's copy of a tied weight that gradient clipping must not count again (every copy but
the first stage's; set by ``titan_ext.parallel.pipeline.TiedWeight``)."""


def _tied_weight_counted_once(original):
    """Under PP torchtitan sums each stage's gradient norm; a tied weight has a copy on the first and the last
    stage (``titan_ext.parallel.pipeline.TiedWeight``, equal gradients): the norm counts the first stage's only, and
    every copy is clipped by the same factor. Without marked copies, torchtitan's function as shipped."""
    import torch

    def is_tied_copy(param) -> bool:
        return getattr(param, TIED_COPY, False)

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        copies = [p for p in parameters if is_tied_copy(p) and p.grad is not None]
        if not copies:
            return original(parameters, max_norm, *args, **kwargs)
        total = original([p for p in parameters if not is_tied_copy(p)], max_norm, *args, **kwargs)
        torch.nn.utils.clip_grads_with_norm_(copies, max_norm, total, kwargs.get("foreach"))
        return total

    return clip_grad_norm_


PIPELINE: tuple[Patch, ...] = (
    Patch(
        "torchtitan.distributed.utils:clip_grad_norm_",
        "under PP it adds up every stage's gradient norm, so a tied embedding/head weight (a copy on the first "
        "and the last stage) would count twice: its copies after the first stage's are left out of the norm "
        "and clipped by the same factor",
        TORCHTITAN, _tied_weight_counted_once,
    ),
)
"""A pipeline-parallel job whose model ties its head to its embedding (``titan_ext.parallel.pipeline``)."""

TABLES = (PER_JOB, PIPELINE)
