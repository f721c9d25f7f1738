"""Each token mixer's tensor-parallel entries (the ``attn`` part of a block's plan), one function per mixer.

A function takes the model's ``TPPlan`` (its options and residual layout) and the mixer module's path in the
block (``at``: where the layer holds it, found from the layer's modules), and returns the entries of that
module. A model's plan class names its own mixer's function in ``attn_plan``; a hybrid model's plan gives
other layers other functions (``TPPlan.layer_mixers``), so a block's plan is assembled from what mixes
tokens in that block.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from model_plans.base import IfPresent, Plan, TPPlan, short_conv_plan
from model_plans.styles import (Composed, GatheredHiddenStates, LocalWidth, NormParallel, PlaceEach, PlaceParameters,
                                SharedKeyLatent)


def _gather_hidden_states(plan: TPPlan) -> PrepareModuleInput:
    """The mixer's input all-gathered in high precision, even with Float8 (see ``gla``)."""
    return PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": plan.activation},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
    )


def gla(plan: TPPlan, at: str = "attn") -> Plan:
    """fla's ``GatedLinearAttention``: heads split across ranks, q/k/v/g and the gate's up-projection
    colwise, o_proj rowwise.

    The low-rank gate's down-projection ``gk_proj.0`` (hidden -> 16) is too
    small to shard: its weight is replicated. The optional short convolutions
    are sharded with the projections feeding them (``short_conv_plan``). The
    per-head output norm runs on the local heads (``Shard(-2)``) with its
    gate. The input is gathered in high precision even with Float8:
    ``gk_proj.0`` is not a Float8 colwise linear and would receive a float8
    tensor.
    """
    from fla.modules.parallel import PrepareModuleWeight

    head_norm = NormParallel(Shard(-2), use_local_output=True)
    return {
        at: _gather_hidden_states(plan),
        f"{at}.q_proj": plan.colwise(),
        f"{at}.k_proj": plan.colwise(),
        f"{at}.v_proj": plan.colwise(),
        f"{at}.g_proj": plan.colwise(),
        f"{at}.gk_proj.0": PrepareModuleWeight(layouts=Replicate()),
        f"{at}.gk_proj.1": plan.colwise(),
        **short_conv_plan(at),
        # fla builds one of the two: the fused norm-and-gate when fuse_norm is on, else a plain norm.
        f"{at}.g_norm_swish_gate": IfPresent(head_norm),
        f"{at}.g_norm": IfPresent(head_norm),
        f"{at}.o_proj": plan.out_proj(),
    }


def gated_deltanet(plan: TPPlan, at: str = "attn") -> Plan:
    """fla's ``GatedDeltaNet``: heads split across ranks, q/k/v, the per-value-head gate and beta (a/b) and
    the output gate colwise, o_proj rowwise; the short convolutions and ``A_log``/``dt_bias`` (one per
    value head) are sharded with them. Splitting query/key heads and value heads contiguously keeps each
    value head's query/key head (``i // (num_v_heads // num_heads)``) on its rank.

    The kernels read the sharded conv weights and ``A_log``/``dt_bias`` directly: the model must
    run titan_ext's kernel binding (``titan_ext.kernels``, either path), which hands them local
    shards and keeps fla's fused q/k/v conv (global widths) off under TP. The per-head output norm
    runs on the local heads. The input is gathered in high precision even with Float8: ``a_proj``
    and ``b_proj`` (``num_v_heads`` outputs) are usually too narrow for Float8Linear.
    """
    return {
        at: Composed(_gather_hidden_states(plan), PlaceParameters(Shard(0))),  # its own A_log, dt_bias
        f"{at}.q_proj": plan.colwise(),
        f"{at}.k_proj": plan.colwise(),
        f"{at}.v_proj": plan.colwise(),
        f"{at}.a_proj": plan.colwise(),
        f"{at}.b_proj": plan.colwise(),
        **short_conv_plan(at),
        f"{at}.g_proj": IfPresent(plan.colwise()),  # present with use_gate
        f"{at}.o_norm": NormParallel(Shard(-2), use_local_output=True),
        f"{at}.o_proj": plan.out_proj(),
    }


def kda(plan: TPPlan, at: str = "attn") -> Plan:
    """fla's ``KimiDeltaAttention``: heads split across ranks, as in ``gated_deltanet``: q/k/v, beta
    (``b_proj``) and the up-projections of the low-rank decay gate (``f_proj.1``, ``num_v_heads *
    head_dim`` outputs) and output gate (``g_proj.1``) colwise, o_proj rowwise; the short convolutions
    and ``A_log`` (one per value head) and ``dt_bias`` (one per value head and key channel) sharded
    with them. The gates' down-projections (``f_proj.0``, ``g_proj.0``: hidden -> head_v_dim) are too
    small to shard: replicated, as GLA's ``gk_proj.0``; the input is gathered in high precision for them.

    The kernels read the sharded conv weights and ``A_log``/``dt_bias`` directly: the model must run
    titan_ext's kernel binding (``titan_ext.kernels``, either path), which hands them local shards. The
    per-head output norm runs on the local heads.
    """
    from fla.modules.parallel import PrepareModuleWeight

    return {
        at: Composed(_gather_hidden_states(plan), PlaceParameters(Shard(0))),  # its own A_log, dt_bias
        f"{at}.q_proj": plan.colwise(),
        f"{at}.k_proj": plan.colwise(),
        f"{at}.v_proj": plan.colwise(),
        f"{at}.b_proj": plan.colwise(),
        f"{at}.f_proj.0": PrepareModuleWeight(layouts=Replicate()),
        f"{at}.f_proj.1": plan.colwise(),
        f"{at}.g_proj.0": PrepareModuleWeight(layouts=Replicate()),
        f"{at}.g_proj.1": plan.colwise(),
        **short_conv_plan(at),
        f"{at}.o_norm": NormParallel(Shard(-2), use_local_output=True),
        f"{at}.o_proj": plan.out_proj(),
    }


def fla_attention(plan: TPPlan, at: str = "attn") -> Plan:
    """fla's softmax ``Attention`` (its transformer's, and a hybrid's ``attn`` layers): heads split across
    ranks; the optional q/k norms run per local head."""
    return {
        **plan.gather(at, kwarg="hidden_states"),
        f"{at}.q_proj": plan.colwise(),
        f"{at}.k_proj": plan.colwise(),
        f"{at}.v_proj": plan.colwise(),
        # present with qk_norm only
        f"{at}.q_norm": IfPresent(NormParallel(Shard(-2), use_local_output=True)),
        f"{at}.k_norm": IfPresent(NormParallel(Shard(-2), use_local_output=True)),
        f"{at}.o_proj": plan.out_proj(),
    }


def transformers_attention(plan: TPPlan, at: str = "self_attn") -> Plan:
    """transformers' Llama-style ``self_attn``: heads split across ranks."""
    return {
        **plan.gather(at, kwarg="hidden_states"),
        f"{at}.q_proj": plan.colwise(),
        f"{at}.k_proj": plan.colwise(),
        f"{at}.v_proj": plan.colwise(),
        f"{at}.o_proj": plan.out_proj(),
    }


def transformers_mla(plan: TPPlan, at: str = "self_attn") -> Plan:
    """transformers' multi-head latent attention (DeepSeek-V3, Kimi Linear): heads split after the latent
    projections. The down-projections and their norms (``q_a_proj``/``q_a_layernorm``,
    ``kv_a_proj_with_mqa``/``kv_a_layernorm``: hidden -> rank, small) are replicated; the up-projections
    (``q_b_proj`` or ``q_proj``, ``kv_b_proj``) colwise, o_proj rowwise. The rotary key every head shares
    leaves ``kv_a_proj_with_mqa`` as this rank's plain tensor, its gradient summed over the ranks
    (``SharedKeyLatent``). The input is gathered in high precision for the replicated projections."""
    from fla.modules.parallel import PrepareModuleWeight

    return {
        at: Composed(_gather_hidden_states(plan), SharedKeyLatent()),
        f"{at}.q_proj": IfPresent(plan.colwise()),  # without q_lora_rank
        f"{at}.q_a_proj": IfPresent(PrepareModuleWeight(layouts=Replicate())),
        f"{at}.q_a_layernorm": IfPresent(NormParallel(Replicate())),
        f"{at}.q_b_proj": IfPresent(plan.colwise()),
        f"{at}.kv_a_proj_with_mqa": PlaceParameters(Replicate()),  # its output: SharedKeyLatent
        f"{at}.kv_a_layernorm": NormParallel(Replicate()),
        f"{at}.kv_b_proj": plan.colwise(),
        f"{at}.o_proj": plan.out_proj(),
    }


def transformers_kda(plan: TPPlan, at: str = "self_attn") -> Plan:
    """transformers' KDA layer (Kimi Linear's ``linear_attention`` layers, ``self_attn``): heads split, as
    fla's ``kda``: q/k/v, ``b_proj`` and the gates' up-projections (``forget_gate.f_b_proj``, ``g_b_proj``)
    colwise, o_proj rowwise, the gates' down-projections replicated, the gated output norm on the local heads.

    Its forward splits the three projections' outputs by ``qkv_dim``, made this rank's width
    (``LocalWidth``). Its one ``conv1d`` over q, k and v stays whole: titan_ext's convolution takes this rank's
    channels of each (``kernels.transformers_kda``). The forget gate's own code adds ``dt_bias`` to
    ``f_b_proj``'s output and scales by ``exp(A_log)``: both sharded by heads, the output kept a DTensor
    until the kernel takes its local shard.
    """
    from fla.modules.parallel import PrepareModuleWeight

    return {
        at: Composed(_gather_hidden_states(plan), LocalWidth("qkv_dim")),
        f"{at}.q_proj": plan.colwise(),
        f"{at}.k_proj": plan.colwise(),
        f"{at}.v_proj": plan.colwise(),
        f"{at}.conv1d": PlaceParameters(Replicate()),
        f"{at}.forget_gate": PlaceEach({"dt_bias": Shard(0), "A_log": Shard(2)}),
        f"{at}.forget_gate.f_a_proj": PrepareModuleWeight(layouts=Replicate()),
        f"{at}.forget_gate.f_b_proj": plan.colwise(use_local_output=False),
        f"{at}.b_proj": plan.colwise(),
        f"{at}.g_a_proj": PrepareModuleWeight(layouts=Replicate()),
        f"{at}.g_b_proj": plan.colwise(),
        f"{at}.o_norm": NormParallel(Shard(-2), use_local_output=True),
        f"{at}.o_proj": plan.out_proj(),
    }


def transformers_gated_deltanet(plan: TPPlan, at: str = "linear_attn") -> Plan:
    """transformers' Gated DeltaNet (Qwen3.5's and Qwen3-Next's ``linear_attn``): heads split across ranks, as in
    ``gated_deltanet``, for the layer's titan_ext forward (``titan_ext.kernels.transformers_gated_deltanet``):
    the output gate, beta and the decay's input colwise (Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` too: their
    rows are grouped per key head, so a contiguous split gives whole groups), ``A_log``/``dt_bias`` sharded per
    value head, the gated norm on the local heads, ``out_proj`` rowwise.

    Qwen3.5's fused ``in_proj_qkv`` and both models' ``conv1d`` hold all queries, then all keys, then all values:
    a rank's heads are a slice of each, a layout no DTensor placement expresses. Their weights stay replicated
    over the TP ranks (FSDP still shards them); the forward multiplies this rank's rows only, and their
    gradients are summed over the TP ranks.
    """
    return {
        at: Composed(_gather_hidden_states(plan), PlaceParameters(Shard(0))),  # its own A_log, dt_bias
        f"{at}.in_proj_qkv": IfPresent(PlaceParameters(Replicate())),  # Qwen3.5
        f"{at}.in_proj_z": IfPresent(plan.colwise()),
        f"{at}.in_proj_b": IfPresent(plan.colwise()),
        f"{at}.in_proj_a": IfPresent(plan.colwise()),
        f"{at}.in_proj_qkvz": IfPresent(plan.colwise()),  # Qwen3-Next
        f"{at}.in_proj_ba": IfPresent(plan.colwise()),
        f"{at}.conv1d": PlaceParameters(Replicate()),
        f"{at}.norm": NormParallel(Shard(-2), use_local_output=True),
        f"{at}.out_proj": plan.out_proj(),
    }


def transformers_mamba2(plan: TPPlan, at: str = "mixer") -> Plan:
    """transformers' Mamba2 mixers (``Mamba2Mixer`` and the hybrids' copies): heads split across ranks, for the
    layer's titan_ext forward (``titan_ext.kernels.transformers_mamba2``): ``A_log``, ``D``, ``dt_bias`` and the
    gated norm's weight sharded per head, ``out_proj`` rowwise.

    ``in_proj`` packs z, x, B, C and dt, the ``conv1d`` x, B and C, each part over all heads or groups: a rank's
    rows are a slice of each part, a layout no DTensor placement expresses. Their weights stay replicated over the
    TP ranks (FSDP still shards them); the forward multiplies this rank's rows only, and their gradients are
    summed over the TP ranks. The forward computes the gated norm itself, on this rank's channels. Its layer
    passes the hidden states first or by name (``GatheredHiddenStates``).
    """
    return {
        at: Composed(GatheredHiddenStates(plan.activation), PlaceParameters(Shard(0))),  # its own A_log, D, dt_bias
        f"{at}.in_proj": PlaceParameters(Replicate()),
        f"{at}.conv1d": PlaceParameters(Replicate()),
        f"{at}.norm": PlaceParameters(Shard(0)),
        f"{at}.out_proj": plan.out_proj(),
    }
