"""Activation checkpointing for HF-layout decoders, built from torchtitan's own wrappers.

Modes (``--activation_checkpoint.mode``):

* ``full``: every block is recomputed in backward.
* ``selective`` with ``selective_ac_option`` = N (a positive int): every Nth
  block (blocks N, 2N, ...) is fully checkpointed, the others keep their
  activations. Counted per model, not with torchtitan's process-wide counter
  (``_layer_sac_count``), which shifts the choice when a process builds a
  second model.
* ``selective`` with ``op``: torchtitan's per-op policy (``_apply_op_sac``)
  and its save list (Llama's: matmuls, SDPA, ``max``, reduce-scatter).
* ``memory_budget``: the compiler's partitioner trades memory for compute;
  it needs ``--compile.enable`` with the ``model`` component.

What op-level SAC does with fla's GLA (measured on CPU by counting what
backward's recompute replays and what it runs again; torch 2.13 calls the
policy only in forward, ``ctx.is_recompute`` is never True; see
``tests/test_ac_compile.py``): the SAC
policy only sees aten ops. fla's ``chunk_gla`` is a
``torch.autograd.Function`` whose forward launches Triton kernels; on CUDA
the only aten ops the policy sees inside it are allocations, so the whole
GLA forward (gate cumsum, intra-chunk ``A``, state pass, output) reruns in
backward whatever the save list says, and so do the logsigmoid gate and
fused norms (also Triton). Saving is effective only for aten outputs: the
projections (``aten.mm``), whose every other output the policy keeps. So
for GLA ``op`` saves half of the projection GEMMs (on the debug model the
recompute runs 4 of a block's 9 bias-free mms; ``gk_proj.1`` is an addmm) and recomputes the
token mixer; making the mixer itself savable needs it to be a
``torch.library.custom_op`` (one op the policy can ``MUST_SAVE``), which
also removes the graph break that fla's ``torch.compiler.disable`` puts in
every compiled block.
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.distributed import activation_checkpoint as titan_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
from torchtitan.tools.logging import logger

from titan_ext.compile import model_compile_enabled

MODES = ("none", "full", "selective", "memory_budget")

# Ops whose outputs op-level SAC keeps (every other mm); fla's Triton ops are invisible to it.
OP_SAC_SAVE_LIST = _op_sac_save_list


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
