"""Checks of an HF config.json's fields against the architecture's config class."""

from __future__ import annotations

import copy
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

# ``config.name`` and ``getattr(config, "name"`` / ``hasattr(self.config, "name"`` in a modeling file.
_READ = re.compile(r"""\bconfig\.([A-Za-z]\w*)|(?:get|has)attr\(\s*(?:self\.)?config\s*,\s*["']([A-Za-z]\w*)["']""")

# ``kwargs.get("name"``, ``kwargs.pop("name"``, ``kwargs["name"]`` and ``"name" in kwargs`` in a configuration file.
_KWARGS_READ = re.compile(r"""kwargs(?:\.get|\.pop)\(\s*["'](\w+)["']|kwargs\[\s*["'](\w+)["']\s*\]|["'](\w+)["']\s+in\s+kwargs\b""")


def _module_source(module_name: str) -> str:
    try:
        return inspect.getsource(importlib.import_module(module_name))
    except (ImportError, OSError, TypeError):  # no source (a user's class defined in a notebook): none known
        return ""


@functools.cache
def modeling_reads(config_class) -> frozenset[str]:
    """The config keys the class's modeling file reads: some only through ``getattr`` with a default
    (Qwen3-MoE's ``head_dim``), so the class never declares them."""
    package, _, name = config_class.__module__.rpartition(".")
    if not name.startswith("configuration_"):
        return frozenset()
    source = _module_source(f"{package}.modeling_{name[len('configuration_'):]}")
    return frozenset(a or b for a, b in _READ.findall(source))


@functools.cache
def config_reads(config_class) -> frozenset[str]:
    """The keys the class (or a base) takes out of its extra keyword arguments: a checkpoint's older or
    nested spelling (Kimi Linear's ``linear_attn_config``, which becomes ``layer_types``, Gemma 3's
    ``sliding_window_pattern``), read in ``__init__`` but kept verbatim in ``to_dict()``."""
    modules = {cls.__module__ for cls in config_class.__mro__ if cls.__module__ not in ("builtins", "typing")}
    return frozenset(
        next(name for name in match if name) for module in modules for match in _KWARGS_READ.findall(_module_source(module))
    )


@functools.cache
def _declared(config_class) -> frozenset[str]:
    """The keys the class names: its fields with their defaults, their aliases, its ``__init__``'s parameters."""
    return frozenset({*config_class().to_dict(), *config_class.attribute_map,
                      *inspect.signature(config_class.__init__).parameters})


def _built(config_class, config: dict) -> dict | None:
    """``to_dict()`` of the class built from ``config`` (a copy: transformers writes into nested dicts it is
    given), or None where the class refuses it."""
    try:
        return config_class(**copy.deepcopy(config)).to_dict()
    except Exception:  # the class validated the keys itself: the caller's build says why
        return None


def _changes_the_config(config_class, config: dict, key: str, built: dict | None) -> bool:
    """Whether the class reads ``key``: dropping it changes what the class builds. An older spelling
    (Llama's ``rope_theta``, ``torch_dtype``) is mapped onto another field and dropped; an unknown key is kept
    verbatim in ``to_dict()`` and changes nothing else."""
    without = _built(config_class, {k: v for k, v in config.items() if k != key})
    if built is None or without is None:
        return True  # the class validates what it is given: it knows the key
    return key not in built or {k: v for k, v in built.items() if k != key} != without


def unread_keys(config: dict, config_class) -> list[str]:
    """The keys of ``config`` that neither the class nor its modeling code reads (as transformers does, they
    are kept and ignored). Hub files carry many: keys of the authors' own code (DeepSeek-V3's ``ep_size``),
    of generation (``cache_implementation``), of releases past (``use_sliding_window``)."""
    known = _declared(config_class) | modeling_reads(config_class) | config_reads(config_class) | _HF_METADATA
    fields = {key: value for key, value in config.items() if key != "model_type"}  # the class's own, not a field
    candidates = [key for key in fields if key not in known]
    if not candidates:
        return []
    built = _built(config_class, fields)
    return [key for key in candidates if not _changes_the_config(config_class, fields, key, built)]


def _warn_unread_keys(config: dict, config_class, source: str) -> None:
    """Every key of a hub config.json is accepted; the ones nothing reads are named once, since a misspelled
    key is among them (the model then takes the default)."""
    unread = unread_keys(config, config_class)
    if unread:
        logger.warning(f"titan_ext: {source}: {config_class.__name__} and its modeling code read none of "
                       f"{', '.join(map(repr, unread))}; ignored")


def _options(annotation) -> tuple:
    """The alternatives of ``X | Y`` / ``Optional[X]``, else just the annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_instance(value, kind) -> bool:
    """JSON's view of a type: bool is not an int, an int is a valid float, a list is a tuple (JSON has no
    tuples: ``save_pretrained`` writes fla's ``A_init_range`` as one), None only for ``None``.

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
    if kind is tuple:
        return isinstance(value, (list, tuple))
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
    """Check an HF config.json that overrides a flavor: JSON types and buildable sizes refuse; keys nothing reads
    are one warning line.

    Divisibility is checked among the keys ``config`` holds; pass the flavor's
    architecture merged with the overrides to check the resulting model.
    """
    _check_types(config, config_class, source)
    _check_values(config, source)
    _warn_unread_keys(config, config_class, source)
