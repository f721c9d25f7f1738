"""Multi-head latent attention (MLA): transformers' DeepSeek-V3 attention and Kimi Linear's softmax layers.

Queries come from a low-rank latent (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) or one projection
(``q_proj``); keys and values from one shared latent per token (``kv_a_proj_with_mqa``: ``kv_lora_rank``
latent dims and ``qk_rope_head_dim`` rotary dims shared by every head, ``kv_a_layernorm``, ``kv_b_proj``).
A head's query-key dim (``qk_nope_head_dim + qk_rope_head_dim``) differs from its value dim (``v_head_dim``).
"""

from __future__ import annotations

from model_plans.base import IfPresent
from model_plans.styles import NormParallel, SharedKeyLatent

from titan_ext.models.mixers.attention import TransformersAttention


def mla_flops(heads: int, qk_head_dim: int, v_head_dim: int, keys: int) -> int:
    """Softmax attention beyond the projections, per token, training (3x the forward): per head q.k over
    the keys, 2 * qk_head_dim * keys, and the weighted sum of values, 2 * v_head_dim * keys (the full score
    matrix, as ``attention.attention_flops`` counts it: the same count where the two dims are equal)."""
    return 6 * heads * (qk_head_dim + v_head_dim) * keys


class TransformersMLA(TransformersAttention):
    """transformers' MLA module (``self_attn``), through its modeling file's attention registry like any
    transformers attention: heads split after the latent projections under TP (``tp_entries``); under CP torch's ring (values padded to the query-key head
    dim, which the ring's kernels need: ``context_parallel.one_head_dim``) or, where masked, the compressed
    keys and values all-gathered and expanded to this rank's heads on each rank; per-document attention."""

    name = "transformers mla"
    cp_latents = "expand_kv"

    def __init__(self, path: str = "", module=None):
        super().__init__(path, module)
        self.rope_width = getattr(module, "qk_rope_head_dim", 0)
        """The rotary key's width in ``kv_a_proj_with_mqa``'s output, shared by every head."""

    def tp_entries(self, plan):
        """Heads split after the latent projections. The down-projections and their norms (``q_a_proj``/
        ``q_a_layernorm``, ``kv_a_proj_with_mqa``/``kv_a_layernorm``: hidden -> rank, small) are replicated;
        the up-projections (``q_b_proj`` or ``q_proj``, ``kv_b_proj``) colwise, o_proj rowwise. The rotary key
        every head shares leaves ``kv_a_proj_with_mqa`` as this rank's plain tensor, its gradient summed over
        the ranks (``SharedKeyLatent``, what HF's plans call ``mla_kv_a_proj``). The input is gathered in high
        precision for the replicated projections."""
        from fla.modules.parallel import PrepareModuleWeight
        from torch.distributed.tensor import Replicate

        at = self.path
        return {
            at: plan.gather_high_precision(),
            f"{at}.q_proj": IfPresent(plan.colwise()),  # without q_lora_rank
            f"{at}.q_a_proj": IfPresent(PrepareModuleWeight(layouts=Replicate())),
            f"{at}.q_a_layernorm": IfPresent(NormParallel(Replicate())),
            f"{at}.q_b_proj": IfPresent(plan.colwise()),
            f"{at}.kv_a_proj_with_mqa": SharedKeyLatent(self.rope_width),
            f"{at}.kv_a_layernorm": NormParallel(Replicate()),
            f"{at}.kv_b_proj": plan.colwise(),
            f"{at}.o_proj": plan.out_proj(),
        }

    @classmethod
    def recognizes(cls, module):
        """An attention whose keys and values come from one latent, expanded by its ``expand_kv``."""
        return super().recognizes(module) and callable(getattr(type(module), cls.cp_latents, None))

    def flops_per_token(self, config, layer, seq_len):
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return mla_flops(config.num_attention_heads, qk_head_dim, config.v_head_dim, seq_len)
