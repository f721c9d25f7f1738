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

The portable Gated DeltaNet and KDA cores are one op each the same way
(``titan_ext::delta_rule_fwd``, ``titan_ext.kernels.delta_rule_op``; counted in
``tests/test_delta_rule_sac.py``), and so is fla's ``chunk_kda`` on CUDA
(``titan_ext::chunk_kda_fwd``, ``titan_ext.kernels.kda_op``: fla's drivers inside;
counted under Triton's interpreter, ``tests/interpret_checks.py`` ``kda_op``), and
fla's ``chunk_gated_delta_rule`` (``titan_ext::chunk_gated_delta_rule_fwd``,
``titan_ext.kernels.gated_delta_op``).
"""

from __future__ import annotations

import copy
import logging

import torch.nn as nn

from titan_ext import compat
from titan_ext.errors import ConfigError
from titan_ext.job_plan import ACChoice

logger = logging.getLogger()

MODES = ("none", "full", "selective", "memory_budget")


def op_sac_save_list() -> set:
    """Ops whose outputs op-level SAC keeps: torchtitan's (matmuls, every other one; attention) + the kernels'
    own (``kernels.sac_save_list``: the GLA and delta-rule cores, fla's KDA and Gated DeltaNet on CUDA)."""
    from titan_ext import kernels

    return compat.torchtitan_ac().op_sac_save_list | kernels.sac_save_list()


def layer_frequency(option: str) -> int | None:
    """The N of ``selective_ac_option=N``, or None for ``op``; anything else is an error."""
    if option == "op":
        return None
    if option.isdigit() and int(option) > 0:
        return int(option)
    raise ConfigError(
        f"--activation_checkpoint.selective_ac_option={option!r} is invalid; "
        "use 'op' or a positive integer N (checkpoint every Nth block)"
    )


def check_ac(ac_config, compile_enabled: bool) -> None:
    """Reject a bad mode or option before any model is touched."""
    if ac_config.mode not in MODES:
        raise ConfigError(f"--activation_checkpoint.mode={ac_config.mode!r} is invalid; use one of {', '.join(MODES)}")
    if ac_config.mode == "selective":
        layer_frequency(ac_config.selective_ac_option)
    if ac_config.mode == "memory_budget" and not compile_enabled:
        raise ConfigError(
            "--activation_checkpoint.mode=memory_budget works only with a compiled model; "
            "set --compile.enable (components include 'model') or pick another mode"
        )


def ac_choice(job_config) -> ACChoice:
    ac_config = job_config.activation_checkpoint
    every = layer_frequency(ac_config.selective_ac_option) if ac_config.mode == "selective" else None
    return ACChoice(mode=ac_config.mode, every=every, config=copy.deepcopy(ac_config))


def wrap_block(block: nn.Module, index: int, choice: ACChoice, base_fqn: str) -> nn.Module:
    """The block, checkpointed as the choice says (index counts blocks from 0)."""
    ac = compat.torchtitan_ac()
    if choice.mode == "full":
        return ac.apply_full_ac(block, choice.config)
    if choice.every is None:
        return ac.apply_op_sac(block, choice.config, base_fqn=base_fqn, op_sac_save_list=op_sac_save_list())
    return ac.apply_full_ac(block, choice.config) if (index + 1) % choice.every == 0 else block


def apply_ac(model: nn.Module, choice: ACChoice, dump_folder: str = "") -> None:
    """Checkpoint the model's blocks as the job plan chose."""
    if choice.mode == "none":
        return
    decoder = model.get_decoder()
    if choice.mode == "memory_budget":
        # torchtitan's apply_ac only sets the partitioner's budget in this mode.
        compat.torchtitan_ac().apply_ac(decoder, choice.config, model_compile_enabled=True, base_folder=dump_folder)
        return
    layers = model.blocks()
    prefix = model.structure.layers
    for index, (name, block) in enumerate(list(layers.named_children())):
        layers.register_module(name, wrap_block(block, index, choice, base_fqn=f"{prefix}.{name}"))
    option = f" ({choice.config.selective_ac_option})" if choice.mode == "selective" else ""
    logger.info(f"Applied {choice.mode}{option} activation checkpointing to {len(layers)} blocks")

