"""Activation checkpointing for HF-layout decoders, built from torchtitan's own wrappers.

Modes (``--activation_checkpoint.mode``):

* ``full``: every block is recomputed in backward.
* ``selective`` with ``selective_ac_option`` = N (a positive int): every Nth
  block (blocks N, 2N, ...) is fully checkpointed, the others keep their
  activations. Counted per model, not with torchtitan's process-wide counter
  (``_layer_sac_count``), which shifts the choice when a process builds a
  second model.
* ``selective`` with ``op``: torchtitan's per-op policy (``_apply_op_sac``)
  with Llama's save list (matmuls, SDPA, ``max``, reduce-scatter) plus fla's
  GLA core (below).
* ``memory_budget``: the compiler's partitioner trades memory for compute;
  it needs ``--compile.enable`` with the ``model`` component.

What op-level SAC does with fla's GLA (counted on CPU in
``tests/test_ac_compile.py``, by what backward's recompute replays from the
cache and what it runs again): the policy sees only dispatcher ops. fla's
``chunk_gla`` launches Triton kernels from an autograd Function, invisible to
it, so as shipped by fla the whole GLA forward would rerun in backward whatever
the save list says. ``titan_ext.kernels.gla_op`` makes the GLA core one op,
``titan_ext::chunk_gla_fwd``, and the save list below keeps its outputs: the
recompute replays the mixer from the cache (no second run of its kernels) and
reruns only the cheap elementwise work around it (gate logsigmoid, norms,
SwiGLU) and every other projection GEMM. Memory per GLA block: the mixer's
output plus fla's fp32 intra-chunk matrix ``A`` (``[B, T, H, chunk]``).
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.distributed import activation_checkpoint as titan_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
from torchtitan.tools.logging import logger

from titan_ext.compile import model_compile_enabled
from titan_ext.kernels import gla_op

MODES = ("none", "full", "selective", "memory_budget")

# Ops whose outputs op-level SAC keeps: torchtitan's (matmuls, every other one; attention) + the GLA core.
OP_SAC_SAVE_LIST = _op_sac_save_list | gla_op.SAVE_LIST


def layer_frequency(option: str) -> int | None:
    """The N of ``selective_ac_option=N``, or None for ``op``; anything else is an error."""
    if option == "op":
        return None
    if option.isdigit() and int(option) > 0:
        return int(option)
    raise ValueError(
        f"--activation_checkpoint.selective_ac_option={option!r} is invalid; "
        "use 'op' or a positive integer N (checkpoint every Nth block)"
    )


def validate_ac_config(ac_config, compile_enabled: bool) -> None:
    """Reject a bad mode or option before any model is touched."""
    if ac_config.mode not in MODES:
        raise ValueError(f"--activation_checkpoint.mode={ac_config.mode!r} is invalid; use one of {', '.join(MODES)}")
    if ac_config.mode == "selective":
        layer_frequency(ac_config.selective_ac_option)
    if ac_config.mode == "memory_budget" and not compile_enabled:
        raise ValueError(
            "--activation_checkpoint.mode=memory_budget works only with a compiled model; "
            "set --compile.enable (components include 'model') or pick another mode"
        )


def wrap_block(block: nn.Module, index: int, ac_config, base_fqn: str) -> nn.Module:
    """The block, checkpointed as the mode says (index counts blocks from 0)."""
    if ac_config.mode == "full":
        return titan_ac._apply_full_ac(block, ac_config)
    frequency = layer_frequency(ac_config.selective_ac_option)
    if frequency is None:
        return titan_ac._apply_op_sac(block, ac_config, base_fqn=base_fqn, op_sac_save_list=OP_SAC_SAVE_LIST)
    return titan_ac._apply_full_ac(block, ac_config) if (index + 1) % frequency == 0 else block


def apply_ac(model: nn.Module, job_config) -> None:
    """Checkpoint the blocks of ``model.get_decoder().layers`` per ``--activation_checkpoint.*``."""
    ac_config = job_config.activation_checkpoint
    compile_enabled = model_compile_enabled(job_config)
    validate_ac_config(ac_config, compile_enabled)
    if ac_config.mode == "none":
        return
    decoder = model.get_decoder()
    if ac_config.mode == "memory_budget":
        # torchtitan's apply_ac only sets the partitioner's budget in this mode.
        titan_ac.apply_ac(decoder, ac_config, model_compile_enabled=True, base_folder=job_config.job.dump_folder)
        return
    layers = decoder.layers
    for index, (name, block) in enumerate(list(layers.named_children())):
        layers.register_module(name, wrap_block(block, index, ac_config, base_fqn=f"model.layers.{name}"))
    option = f" ({ac_config.selective_ac_option})" if ac_config.mode == "selective" else ""
    logger.info(f"Applied {ac_config.mode}{option} activation checkpointing to {len(layers)} blocks")
