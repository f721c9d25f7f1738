"""fla's ``KimiDeltaAttention`` (``fla.layers.kda``): the gated delta rule with a per-key-channel decay."""

from __future__ import annotations

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
    tp_plan = "kda"
    cp_kernels = {"chunk_kda": AffineState(), "fused_recurrent_kda": AffineState()}

    def flops_per_token(self, config, layer, seq_len):
        heads = config.num_v_heads or config.num_heads
        return kda_flops(heads, config.head_dim, int(config.head_dim * config.expand_v))


class TransformersKDA(Mixer):
    """transformers' KDA layer (Kimi Linear's ``linear_attention`` layers, ``self_attn``): on titan_ext's
    portable kernel off CUDA, and each packed document from zero state and convolution
    (``kernels.transformers_kda``, bound by ``host_patches.MODEL_KERNELS``); heads split under TP
    (``model_plans.mixers.transformers_kda``); under CP state passing and its convolution's halo, documents
    from the layout."""

    name = "transformers' kda"
    classes = ("transformers.models.kimi_linear.modeling_kimi_linear:KimiLinearDeltaAttention",)
    tp_plan = "transformers_kda"
    cp_kernels = {"chunk_kimi_delta_attention": AffineState()}
    cp_contract = "transformers"
    recurrent_documents = True

    def flops_per_token(self, config, layer, seq_len):
        return kda_flops(config.linear_num_heads, config.linear_head_dim, config.linear_head_dim)
