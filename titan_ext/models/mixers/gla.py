"""fla's ``GatedLinearAttention`` (``fla.layers.gla``)."""

from __future__ import annotations

from model_plans.base import IfPresent, short_conv_plan
from model_plans.styles import NormParallel

from titan_ext.kernels.gla import fla_chunk_size
from titan_ext.kernels.state_passing import DiagonalDecay
from titan_ext.models.mixers.base import Mixer


class GLA(Mixer):
    name = "gla"
    classes = ("fla.layers.gla:GatedLinearAttention",)
    cp_kernels = {"chunk_gla": DiagonalDecay("g"), "fused_recurrent_gla": DiagonalDecay("gk")}

    def tp_entries(self, plan):
        """Heads split across ranks: q/k/v/g and the gate's up-projection colwise, o_proj rowwise.

        The low-rank gate's down-projection ``gk_proj.0`` (hidden -> 16) is too small to shard: its weight is
        replicated, and the input gathered in high precision for it. The optional short convolutions are
        sharded with the projections feeding them (``short_conv_plan``). The per-head output norm runs on
        the local heads (``Shard(-2)``) with its gate.
        """
        from fla.modules.parallel import PrepareModuleWeight
        from torch.distributed.tensor import Replicate, Shard

        at, head_norm = self.path, NormParallel(Shard(-2), use_local_output=True)
        return {
            at: plan.gather_high_precision(),
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

    def document_mask_blocker(self, config, layer):
        if config.attn_mode == "fused_chunk":
            return (
                "GLA's attn_mode 'fused_chunk' takes no cu_seqlens, so its state would cross documents; "
                "use attn_mode 'chunk' (fla's default) or turn document_mask off"
            )
        return None

    def context_parallel_blocker(self, config, layer):
        if config.attn_mode == "fused_chunk":
            return "GLA's attn_mode 'fused_chunk' has no context-parallel path; use attn_mode 'chunk' (fla's default)"
        return None

    def flops_per_token(self, config, layer, seq_len):
        """Chunked GLA, per token, forward (training is 3x):

        with K = key dim, V = value dim (summed over H heads) and chunk C,
        the intra-chunk scores and their product with values cost
        2*C*(K + V), and reading plus updating the K/H x V/H state per head
        costs 2 * 2*K*V/H. No softmax-attention term: cost is linear in
        sequence length.
        """
        key_dim = int(config.hidden_size * config.expand_k)
        value_dim = int(config.hidden_size * config.expand_v)
        chunk = fla_chunk_size(seq_len)
        return 3 * (2 * chunk * (key_dim + value_dim) + 4 * key_dim * value_dim // config.num_heads)
