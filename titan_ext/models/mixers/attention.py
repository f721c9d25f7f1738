"""Softmax attention: fla's ``Attention`` (its transformer's layers, and a hybrid's ``attn`` layers) and
transformers' attention modules."""

from __future__ import annotations

from model_plans.base import IfPresent
from model_plans.styles import NormParallel

from titan_ext.models.mixers.base import Mixer, forward_globals


def attention_flops(heads: int, head_dim: int, keys: int) -> int:
    """Softmax attention beyond the projections, per token: 12 * heads * head_dim * keys.

    Per head and token the forward computes q.k over the keys and the weighted
    sum of values, 2 * 2 * head_dim * keys; training is 3x. The full score matrix
    is counted (no causal halving), as torchtitan's llama3 and flame count it.
    """
    return 12 * heads * head_dim * keys


class FlaAttention(Mixer):
    """fla's ``Attention`` (its transformer's layers, and a hybrid's ``attn`` layers): its window and width are
    the module's own."""

    name = "fla attention"
    classes = ("fla.layers.attn:Attention",)
    cp_attention = "fla"

    def __init__(self, path: str = "", module=None):
        super().__init__(path, module)
        self.window = getattr(module, "window_size", None)
        self.width = getattr(module, "hidden_size", None)  # its heads x head_dim

    def ring_attention_blocker(self, config, layer):
        return f"window_size={self.window}" if self.window else None

    def tp_entries(self, plan):
        """Heads split across ranks; the optional q/k norms run per local head."""
        from torch.distributed.tensor import Shard

        at = self.path
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

    def flops_per_token(self, config, layer, seq_len):
        return attention_flops(1, self.width or config.hidden_size, min(seq_len, self.window or seq_len))


class TransformersAttention(Mixer):
    """A transformers attention module: one whose forward calls the attention its modeling file looks up in
    ``ALL_ATTENTION_FUNCTIONS`` (where context parallelism and document masking put theirs; that it does, and
    rotates at the positions given, is probed at every job's start: ``host.checks``). A sliding window,
    attention sinks (gpt-oss) and logit softcapping (Gemma 2) are honoured under CP by attention over
    all-gathered keys and values (torch's ring applies none of them), and with documents by the per-document
    attention (``kernels.attention_block``)."""

    name = "transformers attention"
    cp_attention = "transformers"

    def __init__(self, path: str = "", module=None):
        super().__init__(path, module)
        config = getattr(module, "config", None)  # a window per layer on the module, else the model's (Mistral)
        self.window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
        self.rescored = [what for what, present in (
            ("attention sinks", module is not None and getattr(module, "sinks", None) is not None),
            ("logit softcapping", getattr(config, "attn_logit_softcapping", None) is not None),
        ) if present]

    @classmethod
    def recognizes(cls, module):
        return "ALL_ATTENTION_FUNCTIONS" in forward_globals(module)

    def tp_entries(self, plan):
        """Llama-style ``q/k/v_proj`` and ``o_proj``: heads split across ranks (a model's HF plan, where it has
        one, lays out the rest of its attention: ``model_plans.hf_plan``)."""
        at = self.path
        return {
            **plan.gather(at, kwarg="hidden_states"),
            f"{at}.q_proj": plan.colwise(),
            f"{at}.k_proj": plan.colwise(),
            f"{at}.v_proj": plan.colwise(),
            f"{at}.o_proj": plan.out_proj(),
        }

    def ring_attention_blocker(self, config, layer):
        dropout = getattr(config, "attention_dropout", 0.0)
        if dropout:
            return f"attention_dropout={dropout}"
        if self.rescored:
            return ", ".join(self.rescored)
        return f"sliding_window={self.window}" if self.window else None

    def flops_per_token(self, config, layer, seq_len):
        heads = getattr(config, "num_attention_heads", None)
        if not heads:
            return None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return attention_flops(heads, head_dim, min(seq_len, self.window or seq_len))
