"""fla's ``KimiDeltaAttention`` (``fla.layers.kda``): the gated delta rule with a per-key-channel decay."""

from __future__ import annotations

from titan_ext.kernels.state_passing import AffineState
from titan_ext.models.mixers.base import Mixer


def kda_flops(heads: int, key_dim: int, value_dim: int) -> int:
    """fla's chunked KDA, per token, forward x 3 (training).

    As the gated delta rule (``gated_deltanet.delta_rule_flops``) with the decay
    applied per key channel: per value head, key dim K, value dim V and fla's
    chunk C (64), the in-chunk key-key and query-key scores 2 * 2*C*K, the
    triangular inverse applied to the keys and values 2*C*(K + V), the scores
    times the corrections 2*C*V, reading the state and updating it 3 * 2*K*V,
    and the decayed keys and queries (per channel, one multiply each) 2 * 2*K.
    Linear in sequence length.
    """
    from titan_ext.kernels.kda import FLA_CHUNK as chunk

    per_head = 4 * chunk * key_dim + 2 * chunk * (key_dim + value_dim) + 2 * chunk * value_dim
    per_head += 6 * key_dim * value_dim + 4 * key_dim
    return 3 * heads * per_head


class KDA(Mixer):
    name = "kda"
    tp_plan = "kda"
    cp_kernels = {"chunk_kda": AffineState(), "fused_recurrent_kda": AffineState()}

    def flops_per_token(self, config, layer, seq_len):
        heads = config.num_v_heads or config.num_heads
        return kda_flops(heads, config.head_dim, int(config.head_dim * config.expand_v))
