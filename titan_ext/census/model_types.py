"""Which causal-LM model types the census trains: the decoder-only text models, and each type's classes.

Every model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is kept (``left_out_reason``) unless its
config is an encoder-decoder (``is_encoder_decoder``), it is a composite config whose ``text_config`` is a causal-LM
type of its own (that type is censused instead), its causal-LM class's ``forward`` takes image/audio inputs or
another model's states, or it is a BERT-style encoder (the config declares ``is_decoder`` and the forward
cross-attends to ``encoder_hidden_states``); ``HAND_LEFT_OUT`` holds the few the classes cannot tell apart, each with
its reason. A kept type's tiny model must also hold a stack of layers (``get_decoder()`` with a ``ModuleList``).

Classes are resolved from transformers' own tables (``getattr(transformers, name)``), never through
``CONFIG_MAPPING``: importing fla registers fla's ``mamba``, ``mamba2`` and ``bitnet`` under transformers' names
(and some transformers modeling files import fla), so the lookup by name would depend on what ran before.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


def causal_lm_types() -> list[str]:
    """Every model type transformers registers a causal LM for, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def transformers_classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) transformers itself maps ``model_type`` to (not what a later
    registration put under that name)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, CONFIG_MAPPING_NAMES[model_type]), \
        getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def fla_classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of one of fla's model types."""
    import fla.models

    configs = {getattr(fla.models, n).model_type: getattr(fla.models, n) for n in fla.models.__all__
               if n.endswith("Config")}
    config_class = configs[model_type]
    model = next(getattr(fla.models, n) for n in fla.models.__all__ if n.endswith("ForCausalLM")
                 and getattr(getattr(fla.models, n), "config_class", None) is config_class)
    return config_class, model


HAND_LEFT_OUT = {
    "blt": "byte-level latent transformer: an entropy patcher and local encoder/decoder around a global "
           "transformer, not one stack of decoder layers over tokens",
    "trocr": "TrOCR's decoder: cross-attends to a vision encoder's `encoder_hidden_states`",
    "xlm": "cross-lingual masked LM (bidirectional unless `causal`), takes `langs`",
    "xlnet": "permutation language model (two-stream attention, `perm_mask`/`target_mapping`), not a causal decoder",
}
"""Types the classes cannot tell from a decoder-only text causal LM, each with its reason."""

_MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "image_patches", "image_pixel_values", "input_features",
                 "audio_input_features", "input_values")
_OTHER_MODEL_STATES = {
    "cross_attention_states": "cross-attends to a vision model's states (`cross_attention_states`)",
    "shared_kv_states": "a speculative-decoding assistant: reads its target model's `shared_kv_states`",
}


def _default_config(config_class: type):
    try:
        return config_class()
    except Exception:  # noqa: BLE001  (a config whose defaults do not validate alone)
        return None


def left_out_reason(model_type: str) -> str | None:
    """Why ``model_type`` is not a decoder-only text causal LM (one line), or None to census it."""
    if model_type in HAND_LEFT_OUT:
        return HAND_LEFT_OUT[model_type]
    config_class, model_class = transformers_classes(model_type)
    defaults = _default_config(config_class)
    if getattr(defaults, "is_encoder_decoder", False):
        return f"encoder-decoder: {model_class.__name__} is the decoder of a sequence-to-sequence model"
    params = inspect.signature(model_class.forward).parameters
    for name, reason in _OTHER_MODEL_STATES.items():
        if name in params:
            return reason
    media = next((f", needs `{p}`" for p in _MEDIA_INPUTS if p in params), "")
    text = _text_model_type(config_class, defaults)
    if text is not None and text != model_type:
        others = sorted(k.removesuffix("_config") for k in (getattr(config_class, "sub_configs", None) or {})
                        if k != "text_config")
        what = f"composite config (text + {', '.join(others)}){media}" if others else f"composite config{media}"
        if text in causal_lm_types():
            return f"{what}: its text model `{text}` is censused"
        if not issubclass(config_class, model_class.config_class):
            return f"{what}: {model_class.__name__} is built from its `text_config` (`{text}`), a type with no " \
                   "causal-LM registration of its own"
    if media:
        return f"needs image/audio inputs (`{media.split('`')[1]}`)"
    if "encoder_hidden_states" in params and "is_decoder" in (defaults.to_dict() if defaults else {}):
        return "BERT-style encoder: a causal LM only as an encoder-decoder's decoder (`is_decoder`, " \
               "cross-attention to `encoder_hidden_states`)"
    return None


def _text_model_type(config_class: type, defaults) -> str | None:
    sub = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    if sub is None:
        return None
    model_type = getattr(sub, "model_type", "")
    if not model_type and defaults is not None:  # AutoConfig: the default instance's
        model_type = getattr(getattr(defaults, "text_config", None), "model_type", "")
    return model_type or None


def layer_stack(model) -> Any:
    """The ``ModuleList`` of the model's layers: the longest in ``get_decoder()`` (else in ``base_model``), or None."""
    import torch.nn as nn

    for part in (model.get_decoder() if hasattr(model, "get_decoder") else None, getattr(model, "base_model", None)):
        stacks = [m for m in part.modules() if isinstance(m, nn.ModuleList) and len(m)] if part is not None else []
        if stacks:
            return max(stacks, key=len)
    return None
