"""Checks of the names a job config picks from torch's and torchtitan's registries."""

from __future__ import annotations

import difflib

from titan_ext.errors import ConfigError


AC_MODES = ("none", "full", "selective", "memory_budget")
COMPILE_COMPONENTS = ("model", "loss")
# Names users try for torchtitan's float8 converter.
_CONVERTER_ALIASES = {"float8": "quantize.linear.float8", "fp8": "quantize.linear.float8"}


def _check_choice(where: str, value: str, choices, noun: str, suggestion: str | None = None) -> None:
    """A name missing from a registry: say so, suggest the closest name, list them all."""
    choices = sorted(choices)
    if value in choices:
        return
    close = difflib.get_close_matches(value, choices, n=1)
    suggestion = suggestion or (close[0] if close else None)
    use = f"use {suggestion!r} (choices: {', '.join(choices)})" if suggestion else f"use one of {', '.join(choices)}"
    raise ConfigError(f"{where} is not a {noun}; {use}")


def did_you_mean(value: str, *groups) -> list[str]:
    """Names close to ``value``, closest first, each group's before the next's (titan_ext's specs before
    torchtitan's); a name that differs only in case is the one answer."""
    for group in groups:
        same = [name for name in group if name.lower() == value.lower()]
        if same:
            return same[:1]
    found = []
    for group in groups:
        by_lower = {name.lower(): name for name in group}
        close = difflib.get_close_matches(value.lower(), list(by_lower), n=3, cutoff=0.6)
        found += [by_lower[name] for name in close if by_lower[name] not in found]
    return found


def unknown_name(where: str, value: str, noun: str, groups: dict[str, set[str]], unlisted: set[str] = frozenset(),
                 unlisted_as: str = "") -> ConfigError:
    """``where`` names no ``noun``: a "did you mean" (from ``groups``, then ``unlisted``), then the names of
    ``groups`` by who registers them, and how many ``unlisted_as`` there are besides."""
    close = did_you_mean(value, *groups.values(), unlisted)[:3]
    listed = [f"{owner}: {', '.join(sorted(names))}" for owner, names in groups.items() if names]
    if unlisted:
        listed.append(f"and {len(unlisted)} {unlisted_as}")
    hint = f"did you mean {' or '.join(repr(name) for name in close)}? " if close else "use one of "
    return ConfigError(f"{where} is not {noun}; {hint}({'; '.join(listed)})")


def _compile_backends() -> set[str]:
    import torch._dynamo

    return {*torch._dynamo.list_backends(exclude_tags=()), "inductor"}


def _converter_names() -> set[str]:
    """torchtitan's converter registry, filled by importing the modules that register them."""
    import torchtitan.components.quantization  # noqa: F401  (registers quantize.*)
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    return set(_registry_model_converter_cls)


def check_names(job_config) -> None:
    """Names torchtitan looks up late (a ``KeyError`` after model build) or never validates from a TOML."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    dataset = job_config.training.dataset
    _check_choice(f"--training.dataset={dataset!r}", dataset, DATASETS, "registered dataset")
    if job_config.validation.enable:
        dataset = job_config.validation.dataset
        _check_choice(f"--validation.dataset={dataset!r}", dataset, DATASETS, "registered dataset")
    mode = job_config.activation_checkpoint.mode
    _check_choice(f"--activation_checkpoint.mode={mode!r}", mode, AC_MODES, "mode")
    backend = job_config.compile.backend
    _check_choice(f"--compile.backend={backend!r}", backend, _compile_backends(), "torch.compile backend")
    for component in job_config.compile.components:
        _check_choice(f"--compile.components: {component!r}", component, COMPILE_COMPONENTS, "component")
    if job_config.model.converters:
        names = _converter_names()
        for name in job_config.model.converters:
            alias = _CONVERTER_ALIASES.get(name)
            _check_choice(f"--model.converters: {name!r}", name, names, "converter name", alias)
