"""Softmax attention: fla's ``Attention`` (its transformer's layers, and a hybrid's ``attn`` layers) and
transformers' attention modules."""

from __future__ import annotations

from titan_ext.models.mixers.base import Mixer


def attention_flops(heads: int, head_dim: int, keys: int) -> int:
    """Softmax attention beyond the projections, per token: 12 * heads * head_dim * keys.

    Per head and token the forward computes q.k over the keys and the weighted
    sum of values, 2 * 2 * head_dim * keys; training is 3x. The full score matrix
    is counted (no causal halving), as torchtitan's llama3 and flame count it.
    """
    return 12 * heads * head_dim * keys


class FlaAttention(Mixer):
    """fla's ``Attention``: in fla's transformer its settings are the model's, in any other fla model
    (a hybrid) the ``attn`` entry naming the layer (``fla.models.configuration_utils``)."""

    name = "fla attention"
    tp_plan = "fla_attention"
    cp_attention = "fla"

    def settings(self, config, layer: int) -> dict:
        """heads and window of the layer (fla's head_dim is hidden_size / heads)."""
        spec = _attention_spec(config, layer)
        if spec is None:
            return {"num_heads": config.num_heads, "window_size": config.window_size}
        return {"num_heads": spec["num_heads"], "window_size": spec.get("window_size")}

    def ring_attention_blocker(self, config, layer):
        window = self.settings(config, layer)["window_size"]
        return f"window_size={window}" if window else None

    def flops_per_token(self, config, layer, seq_len):
        window = self.settings(config, layer)["window_size"]
        return attention_flops(1, config.hidden_size, min(seq_len, window or seq_len))


def _attention_spec(config, layer: int) -> dict | None:
    attn = getattr(config, "attn", None)
    if attn is None or config.model_type == "transformer":
        return None
    from fla.models.configuration_utils import get_attention_spec

    return get_attention_spec(attn, layer_idx=layer)


def attention_layers(config) -> list[int]:
    """The layers fla's ``attn`` config makes softmax attention (none without one)."""
    return [layer for layer in range(config.num_hidden_layers) if _attention_spec(config, layer) is not None]


class TransformersAttention(Mixer):
    """A transformers attention module (``self_attn``), through torch's SDPA.

    ``context_parallel``: whether titan_ext binds its CP attention for the model types using it (checked
    by ``host_checks.check_transformers_attention`` and the matrix: Llama's, Qwen3.5's and Qwen3-Next's).
    """

    name = "transformers attention"
    attribute = "self_attn"
    tp_plan = "transformers_attention"

    def __init__(self, context_parallel: bool = True):
        self.cp_attention = "transformers" if context_parallel else ""

    def ring_attention_blocker(self, config, layer):
        dropout = getattr(config, "attention_dropout", 0.0)
        return f"attention_dropout={dropout}" if dropout else None

    def context_parallel_blocker(self, config, layer):
        if not self.cp_attention:
            return f"titan_ext has no context-parallel path for {config.model_type!r} models yet; set it to 1"
        return None

    def flops_per_token(self, config, layer, seq_len):
        heads = getattr(config, "num_attention_heads", None)
        if not heads:
            return None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return attention_flops(heads, head_dim, seq_len)
