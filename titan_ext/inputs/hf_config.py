"""Checks of an HF config.json's fields against the architecture's config class."""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import inspect
import logging
import re
import sys
import types
import typing

import typing_extensions

from titan_ext.errors import ConfigError

logger = logging.getLogger()


# Integer sizes and float ratios/epsilons that only make sense when positive.
_POSITIVE = (
    "hidden_size", "num_hidden_layers", "num_heads", "num_attention_heads", "num_kv_heads",
    "num_key_value_heads", "vocab_size", "intermediate_size", "head_dim", "max_position_embeddings",
    "conv_size", "expand_k", "expand_v", "hidden_ratio", "norm_eps", "rms_norm_eps",
)  # fmt: skip

# (part, whole, waived_by): ``part`` must divide ``whole`` unless ``waived_by`` is given.
_DIVIDES = (
    ("num_heads", "hidden_size", "head_dim"),
    ("num_attention_heads", "hidden_size", "head_dim"),
    ("num_kv_heads", "num_heads", None),
    ("num_key_value_heads", "num_attention_heads", None),
)

# Hub metadata that transformers keeps verbatim but that describes no architecture.
_HF_METADATA = {"auto_map"}

# Keys earlier transformers releases wrote into the config.json of the model types titan_ext trains, which
# today's classes neither declare nor read (Qwen3-Next's and Qwen3's sliding-window fields, Llama's
# pretraining_tp): a real checkpoint carries them, and transformers ignores them.
WRITTEN_BY_TRANSFORMERS = {"use_sliding_window", "sliding_window", "max_window_layers", "pretraining_tp"}

# ``config.name`` and ``getattr(config, "name"`` / ``hasattr(self.config, "name"`` in a modeling file.
_READ = re.compile(r"""\bconfig\.([A-Za-z]\w*)|(?:get|has)attr\(\s*(?:self\.)?config\s*,\s*["']([A-Za-z]\w*)["']""")


@functools.cache
def modeling_reads(config_class) -> frozenset[str]:
    """The config keys the class's modeling file reads: some only through ``getattr`` with a default
    (Qwen3-MoE's ``head_dim``), so the class never declares them."""
    module = sys.modules[config_class.__module__]
    name = module.__name__.rpartition(".")[2]
    if not name.startswith("configuration_"):
        return frozenset()
    try:
        modeling = importlib.import_module(module.__name__.rpartition(".")[0] + ".modeling_" + name[len("configuration_"):])
        source = inspect.getsource(modeling)
    except (ImportError, OSError, TypeError):  # no modeling file beside the config (a user's class): none known
        return frozenset()
    return frozenset(a or b for a, b in _READ.findall(source))


def _consumes(config_class, key: str, value) -> bool:
    """Whether the class reads ``key``: an older spelling (Llama's ``rope_theta``, ``torch_dtype``)
    is mapped onto another field and dropped, while an unknown key is kept verbatim in ``to_dict()``."""
    try:  # a copy: transformers writes into nested dicts it is given (Llama's rope_scaling gains rope_theta)
        return key not in config_class(**{key: copy.deepcopy(value)}).to_dict()
    except Exception:  # the class validated the key itself (and rejected this value): it knows it
        return True


def _check_keys(config: dict, config_class, source: str) -> None:
    """A misspelled key would be ignored silently (HF configs keep unknown keys as attributes): a key
    close to a known one stops the job; any other key nothing reads is one warning line."""
    declared = {*config_class().to_dict(), *config_class.attribute_map, *_HF_METADATA}
    known = declared | modeling_reads(config_class) | WRITTEN_BY_TRANSFORMERS
    for key, value in config.items():
        if key in known or _consumes(config_class, key, value):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        if close:
            raise ConfigError(
                f"{source} has unknown key {key!r} ({config_class.__name__} does not read it); "
                f"rename it to {close[0]!r}"
            )
        logger.warning(f"titan_ext: {source}: key {key!r} is read neither by {config_class.__name__} nor by its "
                       "modeling code; ignored")


def _options(annotation) -> tuple:
    """The alternatives of ``X | Y`` / ``Optional[X]``, else just the annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_instance(value, kind) -> bool:
    """JSON's view of a type: bool is not an int, an int is a valid float, None only for ``None``.

    A TypedDict is a dict, from ``typing`` or ``typing_extensions`` (fla's ``AttentionSpec``; only
    ``typing_extensions.is_typeddict`` knows both); a ``Literal`` holds its values.
    """
    if typing.get_origin(kind) is typing.Literal:
        return value in typing.get_args(kind)
    kind = dict if typing_extensions.is_typeddict(kind) else typing.get_origin(kind) or kind
    if kind is typing.Any or value is None:
        return kind is typing.Any or kind is type(None)
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(kind, type) and isinstance(value, kind)


def field_types(config_class) -> dict[str, object]:
    """The annotated types of a config class's ``__init__`` arguments, where they resolve.

    Annotations are strings in some modeling files (``from __future__ import
    annotations``) and may name what the module never imports; those are skipped.
    """
    import torch

    namespace = {**vars(typing), "torch": torch, **vars(sys.modules[config_class.__module__])}
    resolved = {}
    for name, annotation in inspect.get_annotations(config_class.__init__).items():
        try:
            resolved[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except Exception:  # an annotation naming what its module does not import: not checked
            continue
    return resolved


def _check_types(config: dict, config_class, source: str) -> None:
    """A wrong JSON type would surface deep in model construction (or silently, e.g. ``true`` as 1)."""
    for name, hint in field_types(config_class).items():
        if name not in config or name == "return":
            continue
        value, options = config[name], _options(hint)
        if not any(_is_instance(value, kind) for kind in options):
            needs = " | ".join("None" if k is type(None) else getattr(k, "__name__", str(k)) for k in options)
            raise ConfigError(
                f"{source}: {name}={value!r} has type {type(value).__name__}, {name} needs {needs}; "
                "fix the value in the file"
            )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_values(config: dict, source: str) -> None:
    """Sizes the model cannot be built with: non-positive, or heads that do not split the width."""
    for key in _POSITIVE:
        if _is_number(config.get(key)) and config[key] <= 0:
            raise ConfigError(f"{source}: {key}={config[key]!r} must be > 0; set a positive value")
    for part, whole, waived_by in _DIVIDES:
        a, b = config.get(part), config.get(whole)
        if waived_by and config.get(waived_by) is not None:
            continue
        if _is_number(a) and _is_number(b) and a > 0 and b % a:
            raise ConfigError(
                f"{source}: {whole}={b} is not divisible by {part}={a}; "
                f"pick a {part} that divides {whole}" + (f" or give {waived_by}" if waived_by else "")
            )


def check_hf_config_fields(config: dict, config_class, source: str) -> None:
    """Check an HF config.json that overrides a flavor: known keys, JSON types, buildable sizes.

    Divisibility is checked among the keys ``config`` holds; pass the flavor's
    architecture merged with the overrides to check the resulting model.
    """
    _check_keys(config, config_class, source)
    _check_types(config, config_class, source)
    _check_values(config, source)
