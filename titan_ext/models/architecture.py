"""What titan_ext knows about a model type beyond its HF config, and where its classes come from.

A model is its HF config: transformers' Auto classes give the config and
causal-LM classes of any ``model_type`` (fla registers its models there when
imported). What the config cannot say lives in an ``Architecture``: the
training FLOPs of its token mixer, how packed documents reach it, its
context-parallel path. Each shipped architecture module (``gla``,
``gated_deltanet``, ``transformer``, ``llama``) registers one together with its
flavor table; any other model type gets its library's generic architecture.
A subclass of a known config class (a user's variant under a new
``model_type``) inherits its parent's architecture.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from titan_ext.errors import ConfigError
from titan_ext.kernels.state_passing import AffineState, DiagonalDecay

LIBRARIES = {"fla": "fla", "hf": "transformers"}
"""Generic train spec name -> the library whose causal LMs it trains."""


class Architecture:
    """Per-model-type knowledge; methods read the built HF config (defaults filled in)."""

    model_type: ClassVar[str] = ""
    library: ClassVar[str] = "transformers"

    packed_layout: ClassVar[str] = "position_ids"
    """How the model takes packed documents (``titan_ext.documents``): fla's ``cu_seqlens`` over one
    flattened row, or transformers' ``position_ids`` with a block-causal mask."""
    cp_kernels: ClassVar[Mapping[str, DiagonalDecay | AffineState]] = {}
    """Context parallelism (``titan_ext.context_parallel``) for a recurrent mixer: the kernels it
    calls by global name, each with its kind of recurrence (``kernels.state_passing``)."""
    cp_attention: ClassVar[str] = ""
    """Context parallelism for softmax attention (torch's ring, or all-gathered keys and values where masked):
    ``"transformers"`` (through the attention registry its modeling file reads) or ``"fla"`` (fla's ``Attention``)."""
    float8_high_precision: ClassVar[tuple[str, ...]] = ("lm_head",)
    """Linears (FQN parts) Float8 training keeps in high precision unless the job names its own
    filters: the output head, for the precision of the logits."""

    def config_overrides(self) -> dict[str, Any]:
        """Config fields forced by training under torchtitan (e.g. no fused loss inside the model)."""
        return {}

    def mixer_flops_per_token(self, config, seq_len: int) -> int | None:
        """Training FLOPs per token of the token mixer beyond its projections; None if unknown."""
        return None

    def document_mask_blocker(self, config) -> str | None:
        """Why this model cannot keep packed documents apart (a one-line reason and fix), or None."""
        return None

    def ring_attention_blocker(self, config) -> str | None:
        """Why this model's attention under CP is not plain causal SDPA, which torch's ring runs (it then
        attends over all-gathered keys and values, masked), or None."""
        return None

    def context_parallel_blocker(self, config) -> str | None:
        """Why this model cannot split sequences across ranks (a one-line reason and fix), or None."""
        if not (self.cp_kernels or self.cp_attention):
            return f"titan_ext has no context-parallel path for {config.model_type!r} models yet; set it to 1"
        return None


class FlaArchitecture(Architecture):
    """Any fla causal LM: packed documents as ``cu_seqlens``; the loss stays out of the model."""

    library = "fla"
    packed_layout = "cu_seqlens"

    def config_overrides(self):
        # torchtitan computes the loss from the logits; the model must not.
        return {"fuse_cross_entropy": False, "fuse_linear_cross_entropy": False}


class TransformersArchitecture(Architecture):
    """Any transformers causal LM: softmax attention through torch's SDPA."""

    def config_overrides(self):
        # torch's fused SDPA kernels on every device; no flash-attn package needed.
        return {"attn_implementation": "sdpa"}

    def mixer_flops_per_token(self, config, seq_len):
        """Softmax attention beyond the projections: 12 * layers * heads * head_dim * seq_len.

        Per layer, head and token the forward computes q.k over seq_len keys
        and the weighted sum of seq_len values, 2 * 2 * head_dim * seq_len;
        training is 3x. The full seq_len x seq_len score matrix is counted (no
        causal halving), as torchtitan's llama3 and flame count it.
        """
        heads = getattr(config, "num_attention_heads", None)
        if not heads:
            return None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return 12 * config.num_hidden_layers * heads * head_dim * seq_len


_ARCHITECTURES: dict[str, Architecture] = {}
_GENERIC = {"fla": FlaArchitecture(), "transformers": TransformersArchitecture()}


def register_architecture(cls: type[Architecture]) -> type[Architecture]:
    _ARCHITECTURES[cls.model_type] = cls()
    return cls


def library_of(config_class: type) -> str:
    """fla for fla's config classes and their subclasses, else transformers."""
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
