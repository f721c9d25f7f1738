"""Token mixers: the unit of titan_ext's knowledge of a model.

What mixes tokens in a layer decides how that layer is split under tensor parallelism (its entries,
``Mixer.tp_entries``), how it sees the whole sequence under context parallelism (state passing for a
recurrence, ring or all-gathered attention), what its packed-document input restarts, and what it costs
(FLOPs per token, for MFU and pipeline stages).

Each layer's mixer is recognised from the modules the layer holds (``recognize``): a module some registered
mixer recognises (``MIXERS``: its class and bases, or the functions its forward calls) is that mixer; norms
and feed-forward modules mix no tokens; any other module holding parameters is an ``Unknown`` mixer, which
trains and refuses what needs its insides in one line. A new mixer is its module here plus one line in
``MIXERS``.
"""

from __future__ import annotations

import types

import torch.nn as nn

from titan_ext.models.mixers.attention import FlaAttention, TransformersAttention
from titan_ext.models.mixers.base import Mixer, NoMixer, Parallel, Unknown, class_names, forward_globals
from titan_ext.models.mixers.gated_deltanet import GatedDeltaNet, TransformersGatedDeltaNet, TransformersGatedDeltaNetGrouped
from titan_ext.models.mixers.gla import GLA
from titan_ext.models.mixers.kda import KDA, TransformersKDA
from titan_ext.models.mixers.lightning import TransformersLightningAttention
from titan_ext.models.mixers.mamba2 import FlaMamba2, TransformersMamba2
from titan_ext.models.mixers.mla import TransformersMLA
from titan_ext.models.mixers.short_conv import TransformersShortConv

MIXERS: tuple[type[Mixer], ...] = (
    GLA,
    GatedDeltaNet,
    KDA,
    FlaAttention,
    TransformersMLA,
    TransformersAttention,
    TransformersGatedDeltaNet,
    TransformersGatedDeltaNetGrouped,
    TransformersKDA,
    TransformersMamba2,
    FlaMamba2,
    TransformersShortConv,
    TransformersLightningAttention,
)
"""Every mixer titan_ext knows; where two recognise a module, the more specific class (a subclass) wins."""

FEED_FORWARD_CLASSES = ("fla.modules.mlp:GatedMLP",)
"""Feed-forward modules whose forward calls fused kernels (so ``_feed_forward`` cannot tell them from a mixer)."""

__all__ = ["FlaAttention", "FlaMamba2", "GLA", "GatedDeltaNet", "KDA", "MIXERS", "Mixer", "NoMixer", "Parallel",
           "TransformersAttention", "TransformersGatedDeltaNet", "TransformersGatedDeltaNetGrouped", "TransformersKDA",
           "TransformersLightningAttention", "TransformersMLA", "TransformersMamba2", "TransformersShortConv", "Unknown",
           "is_norm", "recognize"]


def recognize(block: nn.Module) -> Mixer:
    """The token mixer of one decoder layer, from the modules it holds."""
    known, unknown, feed_forward = [], [], []
    for name, child in block.named_children():
        if next(child.parameters(), None) is None or is_norm(child):
            continue
        mixer = _known(child)
        if mixer is not None:
            known.append(mixer(name, child))
        else:
            (feed_forward if _feed_forward(child) else unknown).append(name)
    if not known and not unknown and len(feed_forward) > 1:  # which one mixes cannot be told: neither is trusted
        unknown = feed_forward
    parts = (*known, *(_unknown(name, block.get_submodule(name)) for name in unknown))
    if not parts:
        return NoMixer()
    return parts[0] if len(parts) == 1 else Parallel(parts)


def _unknown(name: str, module: nn.Module) -> Unknown:
    """An unknown mixer, saying why where a known mixer it resembles is not it."""
    return Unknown(name, module, next((why for mixer in MIXERS if (why := mixer.near_miss(module))), None))


def _known(module: nn.Module) -> type[Mixer] | None:
    found = [mixer for mixer in MIXERS if mixer.recognizes(module)]
    return next((m for m in found if not any(o is not m and issubclass(o, m) for o in found)), None)


def is_norm(module: nn.Module) -> bool:
    """A module whose every parameter is a vector (RMSNorm, LayerNorm): it scales channels, mixing nothing."""
    return all(p.dim() == 1 for p in module.parameters())


def _feed_forward(module: nn.Module) -> bool:
    """A mixture of experts (a module holding ``experts`` and their router), or a module made of linears alone
    whose forward calls no function (transformers' MLPs): position-wise, mixing no tokens."""
    if not class_names(module).isdisjoint(FEED_FORWARD_CLASSES):
        return True
    if next((m for name, m in module.named_children() if name == "experts"), None) is not None:
        return True
    leaves = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    if not all(_linear(m) for m in leaves):
        return False
    calls = [value for value in forward_globals(module).values()
             if callable(value) and not isinstance(value, (type, types.ModuleType))]
    return not calls


def _linear(module: nn.Module) -> bool:
    """A linear map per token: a matrix weight and maybe a bias, nothing else (``nn.Linear``, GPT-2's ``Conv1D``)."""
    shapes = sorted(p.dim() for p in module.parameters(recurse=False))
    return shapes in ([2], [1, 2]) and not list(module.children())
