"""fla's ``KimiDeltaAttention`` (``fla.layers.kda``): the gated delta rule with a per-key-channel decay."""

from __future__ import annotations

from model_plans.base import short_conv_plan
from model_plans.styles import Composed, LocalWidth, NormParallel, PlaceEach, PlaceParameters

from titan_ext.kernels.state_passing import AffineState
from titan_ext.models.mixers.base import Mixer
from titan_ext.models.mixers.gated_deltanet import delta_rule_flops


def kda_flops(heads: int, key_dim: int, value_dim: int) -> int:
    """fla's chunked KDA, per token, forward x 3 (training): the gated delta rule's count
    (``gated_deltanet.delta_rule_flops``, at fla's KDA chunk) plus the decay applied per key channel to the
    keys and queries, one multiply each, 2 * 2*K per value head. Linear in sequence length.
    """
    from titan_ext.kernels.kda import FLA_CHUNK

    return delta_rule_flops(heads, key_dim, value_dim, FLA_CHUNK) + 3 * heads * 4 * key_dim


class KDA(Mixer):
    name = "kda"
    classes = ("fla.layers.kda:KimiDeltaAttention",)
    cp_kernels = {"chunk_kda": AffineState(), "fused_recurrent_kda": AffineState()}

    def tp_entries(self, plan):
        """Heads split across ranks, as Gated DeltaNet's: q/k/v, beta (``b_proj``) and the up-projections of
        the low-rank decay gate (``f_proj.1``, ``num_v_heads * head_dim`` outputs) and output gate
        (``g_proj.1``) colwise, o_proj rowwise; the short convolutions and ``A_log`` (one per value head) and
        ``dt_bias`` (one per value head and key channel) sharded with them. The gates' down-projections
        (``f_proj.0``, ``g_proj.0``: hidden -> head_v_dim) are too small to shard: replicated, as GLA's
        ``gk_proj.0``; the input is gathered in high precision for them. The kernels read the sharded conv
        weights and ``A_log``/``dt_bias`` directly: the model must run titan_ext's kernel binding.
        """
        from fla.modules.parallel import PrepareModuleWeight
        from torch.distributed.tensor import Replicate, Shard

        at = self.path
        return {
            at: Composed(plan.gather_high_precision(), PlaceParameters(Shard(0))),  # its own A_log, dt_bias
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

    def flops_per_token(self, config, layer, seq_len):
        heads = config.num_v_heads or config.num_heads
        return kda_flops(heads, config.head_dim, int(config.head_dim * config.expand_v))


class TransformersKDA(Mixer):
    """transformers' KDA layer (Kimi Linear's ``linear_attention`` layers, ``self_attn``): on titan_ext's
    portable kernel off CUDA, and each packed document from zero state and convolution
    (``kernels.transformers_kda``, bound by its ``KERNELS``); heads split under TP
    (``tp_entries``); under CP state passing and its convolution's halo, documents from the layout."""

    name = "transformers' kda"
    classes = ("transformers.models.kimi_linear.modeling_kimi_linear:KimiLinearDeltaAttention",)
    cp_kernels = {"chunk_kimi_delta_attention": AffineState()}
    cp_contract = "transformers"
    recurrent_documents = True

    def tp_entries(self, plan):
        """Heads split, as fla's KDA: q/k/v, ``b_proj`` and the gates' up-projections
        (``forget_gate.f_b_proj``, ``g_b_proj``) colwise, o_proj rowwise, the gates' down-projections
        replicated, the gated output norm on the local heads.

        Its forward splits the three projections' outputs by ``qkv_dim``, made this rank's width
        (``LocalWidth``). Its one ``conv1d`` over q, k and v stays whole: titan_ext's convolution takes this
        rank's channels of each (``kernels.transformers_kda``). The forget gate's own code adds ``dt_bias`` to
        ``f_b_proj``'s output and scales by ``exp(A_log)``: both sharded by heads, the output kept a DTensor
        until the kernel takes its local shard.
        """
        from fla.modules.parallel import PrepareModuleWeight
        from torch.distributed.tensor import Replicate, Shard

        at = self.path
        return {
            at: Composed(plan.gather_high_precision(), LocalWidth("qkv_dim")),
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

    def flops_per_token(self, config, layer, seq_len):
        return kda_flops(config.linear_num_heads, config.linear_head_dim, config.linear_head_dim)
