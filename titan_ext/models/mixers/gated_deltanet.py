"""fla's ``GatedDeltaNet`` (``fla.layers.gated_deltanet``), and transformers' (Qwen3.5 / Qwen3-Next's
``linear_attn``)."""

from __future__ import annotations

from typing import ClassVar

from titan_ext.kernels.state_passing import AffineState
from titan_ext.models.mixers.base import Mixer, forward_globals, kernel_name


def delta_rule_flops(heads: int, key_dim: int, value_dim: int, chunk: int | None = None) -> int:
    """The chunked gated delta rule, per token, forward x 3 (training).

    Per value head, with key dim K, value dim V and chunk C (64, fla's):
    the in-chunk key-key and query-key scores cost 2 * 2*C*K; applying the
    chunk's triangular inverse to the beta-scaled keys and values, 2*C*(K + V);
    the scores times the corrections, 2*C*V; reading the state (queries
    and keys) and updating it, 3 * 2*K*V. Linear in sequence length.
    """
    if chunk is None:  # fla's Gated DeltaNet chunk
        from titan_ext.kernels.gated_delta import CHUNK as chunk  # imports fla: only when counted

    per_head = 4 * chunk * key_dim + 2 * chunk * (key_dim + value_dim) + 2 * chunk * value_dim
    per_head += 6 * key_dim * value_dim
    return 3 * heads * per_head


class GatedDeltaNet(Mixer):
    name = "gated deltanet"
    classes = ("fla.layers.gated_deltanet:GatedDeltaNet",)
    tp_plan = "gated_deltanet"
    cp_kernels = {"chunk_gated_delta_rule": AffineState(), "fused_recurrent_gated_delta_rule": AffineState()}

    def flops_per_token(self, config, layer, seq_len):
        heads = config.num_v_heads or config.num_heads
        return delta_rule_flops(heads, config.head_dim, int(config.head_dim * config.expand_v))


class TransformersGatedDeltaNet(Mixer):
    """transformers' Gated DeltaNet layer in Qwen3.5's layout (Qwen3.5, Qwen3.5-MoE, Qwen4, LaRA-mini: whatever
    the family, a module whose forward calls the ``chunk_gated_delta_rule`` kernel and that holds Qwen3.5's
    projections). In titan_ext's training models it runs ``kernels.transformers_gated_deltanet``'s forward,
    which calls the delta rule and its short convolution by fla's contracts, under the names fla's Gated
    DeltaNet uses: the same state passing and halo under CP, and packed documents (``cu_seq_lens_q``) restart
    both; under TP it runs on its rank's heads."""

    name = "transformers' gated deltanet"
    projections: ClassVar[tuple[str, ...]] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d")
    tp_plan = "transformers_gated_deltanet"
    recurrent_documents = True
    cp_kernels = {"chunk_gated_delta_rule": AffineState()}

    @classmethod
    def recognizes(cls, module):
        calls = {kernel_name(value) for value in forward_globals(module).values()}
        held = {name for name, _ in module.named_children()} | {name for name, _ in module.named_parameters(recurse=False)}
        return "chunk_gated_delta_rule" in calls and set(cls.projections) | {"A_log", "dt_bias"} <= held

    def training_forward(self):
        from titan_ext.kernels import transformers_gated_deltanet

        return transformers_gated_deltanet.qwen3_5_forward

    def flops_per_token(self, config, layer, seq_len):
        return delta_rule_flops(config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)


class TransformersGatedDeltaNetGrouped(TransformersGatedDeltaNet):
    """transformers' Gated DeltaNet layer in Qwen3-Next's layout: its projections grouped by key head
    (``in_proj_qkvz``, ``in_proj_ba``)."""

    projections = ("in_proj_qkvz", "in_proj_ba", "conv1d")

    def training_forward(self):
        from titan_ext.kernels import transformers_gated_deltanet

        return transformers_gated_deltanet.qwen3_next_forward
