"""Token mixers: the unit of titan_ext's knowledge of a model.

What mixes tokens in a layer decides how that layer is split under tensor parallelism (its
``model_plans.mixers`` entries), how it sees the whole sequence under context parallelism (state
passing for a recurrence, ring or all-gathered attention), what its packed-document input restarts,
and what it costs (FLOPs per token, for MFU and pipeline stages). An architecture
(``titan_ext.models.architecture``) is the map from layer index to mixer, read from the config; a
pure model maps every layer to one mixer, a hybrid some to another (fla's ``attn`` config,
transformers' ``config.layer_types``).
"""

from titan_ext.models.mixers.attention import FlaAttention, TransformersAttention, attention_layers
from titan_ext.models.mixers.base import Mixer, Unknown
from titan_ext.models.mixers.gated_deltanet import GatedDeltaNet, TransformersGatedDeltaNet
from titan_ext.models.mixers.gla import GLA
from titan_ext.models.mixers.kda import KDA, TransformersKDA
from titan_ext.models.mixers.mla import TransformersMLA

__all__ = ["FlaAttention", "GLA", "GatedDeltaNet", "KDA", "Mixer", "TransformersAttention", "TransformersGatedDeltaNet",
           "TransformersKDA", "TransformersMLA", "Unknown", "attention_layers"]
