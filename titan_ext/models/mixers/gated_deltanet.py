"""fla's ``GatedDeltaNet`` (``fla.layers.gated_deltanet``), and transformers' (Qwen3.5 / Qwen3-Next's
``linear_attn``)."""

from __future__ import annotations

from typing import ClassVar

from model_plans.base import IfPresent, short_conv_plan
from model_plans.styles import Composed, NormParallel, PlaceParameters

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
    cp_kernels = {"chunk_gated_delta_rule": AffineState(), "fused_recurrent_gated_delta_rule": AffineState()}

    def tp_entries(self, plan):
        """Heads split across ranks: q/k/v, the per-value-head gate and beta (a/b) and the output gate
        colwise, o_proj rowwise; the short convolutions and ``A_log``/``dt_bias`` (one per value head) sharded
        with them. Splitting query/key heads and value heads contiguously keeps each value head's query/key
        head (``i // (num_v_heads // num_heads)``) on its rank.

        The kernels read the sharded conv weights and ``A_log``/``dt_bias`` directly: the model must run
        titan_ext's kernel binding (``titan_ext.kernels``, either path), which hands them local shards and
        keeps fla's fused q/k/v conv (global widths) off under TP. The input is gathered in high precision
        even with Float8: ``a_proj`` and ``b_proj`` (``num_v_heads`` outputs) are usually too narrow for
        Float8Linear.
        """
        from torch.distributed.tensor import Shard

        at = self.path
        return {
            at: Composed(plan.gather_high_precision(), PlaceParameters(Shard(0))),  # its own A_log, dt_bias
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

    def tp_entries(self, plan):
        """Heads split across ranks, as fla's, for the layer's titan_ext forward: the output gate, beta and the
        decay's input colwise (Qwen3-Next's ``in_proj_qkvz``/``in_proj_ba`` too: their rows are grouped per key
        head, so a contiguous split gives whole groups), ``A_log``/``dt_bias`` sharded per value head, the
        gated norm on the local heads, ``out_proj`` rowwise.

        Qwen3.5's fused ``in_proj_qkv`` and both layouts' ``conv1d`` hold all queries, then all keys, then all
        values: a rank's heads are a slice of each, a layout no DTensor placement expresses. Their weights stay
        replicated over the TP ranks (FSDP still shards them); the forward multiplies this rank's rows only,
        and their gradients are summed over the TP ranks.
        """
        from torch.distributed.tensor import Replicate, Shard

        at = self.path
        return {
            at: Composed(plan.gather_high_precision(), PlaceParameters(Shard(0))),  # its own A_log, dt_bias
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

    def flops_per_token(self, config, layer, seq_len):
        return delta_rule_flops(config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)


class TransformersGatedDeltaNetGrouped(TransformersGatedDeltaNet):
    """transformers' Gated DeltaNet layer in Qwen3-Next's layout: its projections grouped by key head
    (``in_proj_qkvz``, ``in_proj_ba``)."""

    projections = ("in_proj_qkvz", "in_proj_ba", "conv1d")

    def training_forward(self):
        from titan_ext.kernels import transformers_gated_deltanet

        return transformers_gated_deltanet.qwen3_next_forward
