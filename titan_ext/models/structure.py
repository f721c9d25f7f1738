"""Where a causal LM keeps its parts, found from what it holds rather than what they are called.

transformers and fla name the parts of a decoder differently (``embed_tokens`` / ``embeddings`` / ``wte``,
``layers`` / ``h`` / ``blocks``, ``norm`` / ``final_layernorm`` / ``norm_f``). Every feature that needs one
(FSDP's groups, pipeline stages, TP's model-level plan, activation checkpointing, compile) reads it from the
model's ``Structure``, found once when the model is built: the embedding and the head from transformers'
``get_input_embeddings`` / ``get_output_embeddings``, the layer stack as the base model's list of the classes
the model declares unsplittable (``_no_split_modules``), the final norm as the last module of vector
parameters beside it, and each layer's token mixer from the modules the layer holds (``mixers.recognize``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from titan_ext.models import mixers
from titan_ext.models.mixers import Mixer


@dataclass(frozen=True)
class Structure:
    embeddings: str | None
    """FQN of the input embedding the model runs (None in a pipeline stage after the first, ``pipeline.stage_model``;
    a tied head's stage holds the embedding only as the owner of the head's weight)."""
    layers: str
    """FQN of the layer stack (a ``ModuleList``, or a pipeline stage's ``StageLayers``)."""
    final_norm: str | None
    head: str | None
    mixers: tuple[Mixer, ...]
    """Each layer's token mixer, by index."""
    tied: bool
    """The head's weight is the embedding's (``ties_embeddings``)."""

    @property
    def takes_hidden_states(self) -> bool:
        """A pipeline stage after the first: its forward takes the previous stage's hidden states, not tokens."""
        return self.embeddings is None

    @property
    def hybrid(self) -> bool:
        return len({mixer.name for mixer in self.mixers}) > 1

    def _first_blocker(self, reason_of) -> str | None:
        """The first layer's reason (``reason_of(mixer, layer)``); in a hybrid it names the layer and its mixer."""
        for layer, mixer in enumerate(self.mixers):
            reason = reason_of(mixer, layer)
            if reason:
                named = reason.startswith(f"layer {layer}'s") or not self.hybrid
                return reason if named else f"layer {layer} ({mixer.name}): {reason}"
        return None

    def document_mask_blocker(self, config) -> str | None:
        """Why this model cannot keep packed documents apart (a one-line reason and fix), or None."""
        return self._first_blocker(lambda mixer, layer: mixer.document_mask_blocker(config, layer))

    def context_parallel_blocker(self, config) -> str | None:
        """Why this model cannot split sequences across ranks (a one-line reason and fix), or None."""
        return self._first_blocker(lambda mixer, layer: mixer.context_parallel_blocker(config, layer))

    def ring_attention_blocker(self, config) -> str | None:
        """Why this model's attention under CP is not plain causal SDPA, which torch's ring runs (it then
        attends over all-gathered keys and values, masked), or None."""
        for layer, mixer in enumerate(self.mixers):
            for part in mixer.parts:
                if part.cp_attention and (reason := part.ring_attention_blocker(config, layer)):
                    return reason
        return None

    def halo(self) -> int:
        """The most earlier inputs any layer's short convolutions read."""
        return max((part.halo for mixer in self.mixers for part in mixer.parts), default=0)

    def mixer_flops_per_token(self, config, seq_len: int) -> tuple[int, list[int]]:
        """(training FLOPs per token of every layer's token mixer beyond its projections, the layers whose
        mixer has no count beyond its weights)."""
        counts = [mixer.flops_per_token(config, layer, seq_len) for layer, mixer in enumerate(self.mixers)]
        return sum(c for c in counts if c is not None), [layer for layer, c in enumerate(counts) if c is None]


def structure_of(model: nn.Module) -> Structure:
    names = {id(module): name for name, module in model.named_modules()}
    stack = layer_stack(model)
    return Structure(
        embeddings=names.get(id(model.get_input_embeddings())),
        layers=names[id(stack)],
        final_norm=names.get(id(final_norm(model, names[id(stack)]))),
        head=names.get(id(model.get_output_embeddings())),
        mixers=tuple(mixers.recognize(block) for block in stack),
        tied=ties_embeddings(model.config),
    )


def ties_embeddings(config) -> bool:
    """Whether the head's weight is the embedding's (a config without ``tie_word_embeddings`` ties none)."""
    return bool(getattr(config, "tie_word_embeddings", False))


def layer_stack(model: nn.Module) -> nn.Module:
    """The base model's list of layers: of the classes the model declares unsplittable, else its longest list
    (a model titan_ext built: where its structure says, a pipeline stage's own blocks)."""
    found = getattr(model, "structure", None)
    if isinstance(found, Structure):
        return model.get_submodule(found.layers)
    base = model.base_model
    lists = [module for module in base.modules() if isinstance(module, nn.ModuleList) and len(module)]
    declared = set(getattr(model, "_no_split_modules", None) or ())
    layered = [stack for stack in lists if any(type(block).__name__ in declared for block in stack)]
    found = max(layered or lists, key=len, default=None)  # (the first of equals: the outermost)
    if found is None:
        raise ValueError(f"{type(base).__name__} holds no list of layers")
    return found


def final_norm(model: nn.Module, layers: str) -> nn.Module | None:
    """The last module of vector parameters beside the embedding and the layers (in the module holding the
    layers), else one of no parameters and no buffers (Olmo's norm; not a dropout), which PP must still keep
    off the earlier stages (None: there is neither)."""
    owner = model.get_submodule(layers.rpartition(".")[0])  # the module holding the layers
    skip = {id(model.get_submodule(layers)), id(model.get_input_embeddings())}
    others = [child for child in owner.children() if id(child) not in skip]
    norms = [child for child in others
             if next(child.parameters(), None) is not None and all(p.dim() == 1 for p in child.parameters())]
    stateless = [child for child in others if not isinstance(child, (nn.Dropout, nn.Identity, nn.ModuleList))
                 and next(child.parameters(), None) is None and next(child.buffers(), None) is None]
    return norms[-1] if norms else stateless[-1] if stateless else None
