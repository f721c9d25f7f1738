"""What titan_ext knows about a model type beyond its HF config, and where its classes come from.

A model is its HF config: transformers' Auto classes give the config and
causal-LM classes of any ``model_type`` (fla registers its models there when
imported). Each layer's token mixer is recognised from the modules it holds
(``models.structure``, ``models.mixers``), never from the model type. What the
model has as a whole lives in an ``Architecture``: how packed documents reach it,
what training forces, Float8's exceptions, the mixer its registered TP plan covers.
Each shipped architecture module (``gla``, ``gated_deltanet``, ``kda``,
``transformer``, ``llama``) registers one together with its flavor table; any other
model type gets its library's generic architecture. A subclass of a known config
class (a user's variant under a new ``model_type``) inherits its parent's.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from titan_ext import compat
from titan_ext.errors import ConfigError
from titan_ext.models import mixers
from titan_ext.models.mixers import Mixer

LIBRARIES = {"fla": "fla", "hf": "transformers"}
"""Generic train spec name -> the library whose causal LMs it trains."""


class Architecture:
    """Per-model-type knowledge beyond each layer's mixer (which is recognised from the layer's modules:
    ``models.structure``); methods read the built HF config (defaults filled in)."""

    model_type: ClassVar[str] = ""
    mixer: ClassVar[type[Mixer] | None] = None
    """The token mixer the model type's registered TP plan covers in its ``attn_plan`` (its other layers' mixers
    bring their own entries, ``tensor_parallel.tp_plan_class``)."""

    packed_layout: ClassVar[str] = "position_ids"
    """How the model takes packed documents (``titan_ext.data.documents``): fla's ``cu_seqlens`` over one
    flattened row, or transformers' ``position_ids`` with a block-causal mask."""
    float8_high_precision: ClassVar[tuple[str, ...]] = ("lm_head",)
    """Linears (FQN parts) Float8 training keeps in high precision unless the job names its own
    filters: the output head, for the precision of the logits."""

    def config_overrides(self, model_class: type) -> dict[str, Any]:
        """Config fields forced by training under torchtitan (e.g. no fused loss inside the model)."""
        return {}


class FlaArchitecture(Architecture):
    """Any fla causal LM: packed documents as ``cu_seqlens``; the loss stays out of the model."""

    packed_layout = "cu_seqlens"

    def config_overrides(self, model_class):
        # torchtitan computes the loss from the logits; the model must not.
        return {"fuse_cross_entropy": False, "fuse_linear_cross_entropy": False}


class TransformersArchitecture(Architecture):
    """Any transformers causal LM: softmax attention through torch's SDPA where the model supports it, else
    the attention implementation the model needs (attention sinks: eager)."""

    mixer = mixers.TransformersAttention

    def config_overrides(self, model_class):
        # torch's fused SDPA kernels on every device; no flash-attn package needed.
        overrides = {"attn_implementation": "sdpa"} if getattr(model_class, "_supports_sdpa", False) else {}
        if hasattr(model_class.config_class, "output_router_logits"):
            # titan_ext's loss counts the routers' balancing loss (titan_ext.models.moe.balance_loss); asked for router
            # logits, the causal LM's own forward would add it again, from a mask it cannot read (a packed 4D one)
            overrides["output_router_logits"] = False
        return overrides


_ARCHITECTURES: dict[str, Architecture] = {}
"""``model_type`` -> what titan_ext knows of that type as a whole (``architecture_of`` finds a subclass's too),
whichever train spec trains it. Not the flavor tables (``train_specs.NAMED``: per train-spec name, what
torchtitan's ``--model.name`` picks) nor the TP plans (``model_plans.registry``: a user registers one there
without importing titan_ext, and a model type without one takes its HF plan)."""
_GENERIC = {"fla": FlaArchitecture(), "transformers": TransformersArchitecture()}


def register_architecture(cls: type[Architecture]) -> type[Architecture]:
    _ARCHITECTURES[cls.model_type] = cls()
    return cls


def library_of(config_class: type) -> str:
    """Whether a model is fla's: fla for fla's config classes and their subclasses (a model built from one holds
    fla's modules), else transformers. The one place this is decided."""
    return "fla" if any(k.__module__.startswith("fla.") for k in config_class.__mro__) else "transformers"


def architecture_of(config_class: type) -> Architecture:
    """The registered architecture of the class or its nearest registered parent, else the library's generic one."""
    for klass in config_class.__mro__:
        found = _ARCHITECTURES.get(getattr(klass, "model_type", None))
        if found is not None:
            return found
    return _GENERIC[library_of(config_class)]


def fla_model_types() -> list[str]:
    import fla.models

    return sorted(getattr(fla.models, name).model_type for name in fla.models.__all__ if name.endswith("Config"))


def causal_lm_classes(model_type: str, library: str, source: str) -> tuple[type, type]:
    """(config class, causal-LM class) that transformers' Auto classes map ``model_type`` to.

    ``library`` is the one the train spec trains; a model type of the other
    library, or one with no causal LM, is a one-line error naming ``source``.
    """
    if library == "fla":
        import fla  # noqa: F401  (registers fla's model types with transformers' Auto classes)
    elif (own := compat.transformers_own_classes(model_type)) is not None:  # fla takes over mamba, mamba2, bitnet
        _check_config_subclass(own[0], source)
        return own
    from transformers import CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        known = f"fla's: {fla_model_types()}" if library == "fla" else "check config.json's model_type"
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not a model type {library} registers ({known}); "
            "a model of your own must be registered with transformers' AutoConfig and AutoModelForCausalLM "
            "in your custom_import module"
        ) from None
    if library_of(config_class) != library:
        other = next(name for name, lib in LIBRARIES.items() if lib == library_of(config_class))
        raise ConfigError(
            f"{source}: model_type {model_type!r} is a {library_of(config_class)} model; train it with "
            f"--model.name={other!r}"
        )
    _check_config_subclass(config_class, source)
    try:
        return config_class, MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    except KeyError:
        raise ConfigError(
            f"{source}: model_type {model_type!r} has no causal-LM class registered with "
            "AutoModelForCausalLM; titan_ext trains causal language models"
        ) from None


def _check_config_subclass(config_class: type, source: str) -> None:
    """A subclass of a config class that is no dataclass (fla's) needs an ``__init__`` of its own.

    transformers 5 makes every config subclass a dataclass; one without its
    own ``__init__`` gets a generated one that never calls its parent's, so the
    parent's defaults (every architecture field) are missing from the config.
    """
    parent, lost = _defaults_lost(config_class)
    if lost:
        raise ConfigError(
            f"{source}: {config_class.__name__} drops {parent.__name__}'s defaults ({', '.join(lost[:3])}, ...): "
            "transformers 5 generates an __init__ for a config subclass without one; give it "
            "`def __init__(self, **kwargs): super().__init__(**kwargs)`"
        )


@functools.cache
def _defaults_lost(config_class: type) -> tuple[type | None, list[str]]:
    """(nearest parent with a model type, the fields of its defaults ``config_class()`` lacks); once per
    class, since every model-args lookup of the job resolves the classes again."""
    parent = next((k for k in config_class.__mro__[1:] if getattr(k, "model_type", "")), None)
    if parent is None:
        return None, []
    return parent, sorted(set(parent().to_dict()) - set(config_class().to_dict()))
