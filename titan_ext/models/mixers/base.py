"""``Mixer``: what titan_ext knows about one kind of token mixer, and how a layer's mixer is recognised.

A mixer is recognised from the module a layer holds: its class and bases (``classes``, matched along the
module's MRO by module and qualified name, so nothing is imported to ask), or the functions its ``forward``
calls (``calls``: the global names its code reads, through its decorators). Never from ``model_type``, a
config's ``layer_types`` strings or the attribute the layer keeps it under: the same string names
different mixers in different families. Each layer gets its own instance, holding its module's ``path``
in the block and its class (for messages).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch.nn as nn

from titan_ext.kernels.state_passing import AffineState, DiagonalDecay


def class_names(module: nn.Module) -> set[str]:
    """``module:QualName`` of the module's class and every base."""
    return {f"{klass.__module__}:{klass.__qualname__}" for klass in type(module).__mro__}


def forward_globals(module: nn.Module) -> dict[str, object]:
    """The global names the module's ``forward`` code reads, with their values (read through its
    decorators: transformers wraps each layer's ``forward``)."""
    from titan_ext.kernels import functions_run

    found = {}
    forward = getattr(type(module), "forward", None)
    for fn in functions_run(forward) if forward is not None else ():
        found.update({name: fn.__globals__[name] for name in fn.__code__.co_names if name in fn.__globals__})
    return found


def kernel_name(value) -> str:
    """The kernel a global stands for: transformers' hub-kernel wrappers name theirs in their closure
    (``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")``), else the function's name."""
    closure = getattr(value, "__closure__", None) or ()
    names = getattr(getattr(value, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, closure):
        if name == "func_name":
            try:
                return cell.cell_contents
            except ValueError:
                break
    return getattr(value, "__name__", "")


class Mixer:
    """One kind of token mixer. Methods read the model's HF config and the layer's index (a hybrid's
    attention layers take their settings from the config's per-layer entries)."""

    name: ClassVar[str] = ""
    """How messages name it (``gla``, ``fla attention``, ...)."""
    mixes_tokens: ClassVar[bool] = True
    classes: ClassVar[tuple[str, ...]] = ()
    """``module:QualName`` of the classes it is (a module of one, or of a subclass, is this mixer)."""
    cp_kernels: ClassVar[Mapping[str, DiagonalDecay | AffineState]] = {}
    """Context parallelism for a recurrence (``titan_ext.parallel.context_parallel``): the kernels it calls by global
    name, each with its kind of recurrence (``kernels.state_passing``)."""
    cp_halos: ClassVar[tuple[str, ...]] = ()
    """Context parallelism for short convolutions with no recurrence around them (LFM2's): the convolution
    kernels it calls by global name (fla's ``causal_conv1d`` contract), each made to read the previous piece's
    last inputs (``state_passing.conv_across_ranks``)."""
    cp_contract: ClassVar[str] = "fla"
    """The call contract of its ``cp_kernels``: ``fla`` (documents as ``cu_seqlens`` from the model's forward,
    short convolutions in fla's ``ShortConvolution``) or ``transformers`` (``[B, T]`` rows: under CP the
    documents come from the step's ``PieceLayout``, and its ``causal_conv1d_fn`` reads the previous
    piece's last inputs)."""
    recurrent_documents: ClassVar[bool] = False
    """Whether a transformers model's layer of this mixer is a recurrence that takes packed documents from
    the ``cu_seq_lens_q`` its layer receives (``titan_ext.data.documents``: its module gets no per-document
    attention)."""
    cp_attention: ClassVar[str] = ""
    """Context parallelism for softmax attention (torch's ring, or all-gathered keys and values where
    masked): ``"fla"`` (fla's ``Attention``) or ``"transformers"`` (through the attention registry its
    modeling file reads)."""
    cp_latents: ClassVar[str] = ""
    """Where a ``transformers`` attention expands compressed keys and values into its heads' (MLA's
    ``expand_kv(latent, rotary_key)``): where the attention is masked under CP, each rank all-gathers
    that method's inputs and expands them itself, rather than all-gathering the keys and values."""

    def __init__(self, path: str = "", module: nn.Module | None = None):
        self.path = path
        """Where the layer holds it (``attn``, ``self_attn``, ``linear_attn``, ``mixer``, ...)."""
        self.module_class = type(module) if module is not None else None
        convolutions = [m for m in module.modules() if isinstance(m, nn.Conv1d)] if module is not None else []
        self.halo = max((conv.kernel_size[0] - 1 for conv in convolutions), default=0)
        """Earlier inputs its short convolutions read: under CP each piece reads the previous piece's last ones."""

    @classmethod
    def recognizes(cls, module: nn.Module) -> bool:
        return bool(cls.classes) and not class_names(module).isdisjoint(cls.classes)

    @classmethod
    def near_miss(cls, module: nn.Module) -> str | None:
        """Why a module that looks like this mixer (it calls its kernels) is not it, for the unknown mixer's
        refusals (Falcon-H1's Mamba2); None where it does not look like it."""
        return None

    def training_forward(self) -> Callable | None:
        """A forward titan_ext's training models run instead of the module's own (None: its own)."""
        return None

    def tp_entries(self, plan) -> dict | None:
        """Its entries in a block's TP plan (``{module path in the block: style}``, the paths under
        ``self.path``; ``plan``: the model's ``model_plans.TPPlan``, its options and residual layout), or None
        where it has none."""
        return None

    def tensor_parallel_blocker(self, degree: int) -> str | None:
        """Why its TP entries cannot split it over ``degree`` ranks (sizes its own linears' do not show), or None."""
        return None

    def flops_per_token(self, config, layer: int, seq_len: int) -> int | None:
        """Training FLOPs per token of this layer's mixing beyond its projections; None if unknown."""
        return None

    def document_mask_blocker(self, config, layer: int) -> str | None:
        """Why this layer cannot keep packed documents apart (a one-line reason and fix), or None."""
        return None

    def ring_attention_blocker(self, config, layer: int) -> str | None:
        """Why this layer's attention under CP is not plain causal SDPA, which torch's ring runs (it then
        attends over all-gathered keys and values, masked), or None."""
        return None

    def context_parallel_blocker(self, config, layer: int) -> str | None:
        """Why this layer cannot split sequences across ranks (a one-line reason and fix), or None."""
        if not (self.cp_kernels or self.cp_halos or self.cp_attention):
            return f"titan_ext has no context-parallel path for {self.name} yet; set it to 1"
        return None

    @property
    def parts(self) -> tuple[Mixer, ...]:
        """The token mixers of the layer: this one (``Parallel`` holds several)."""
        return (self,)

    @property
    def module_name(self) -> str:
        """The module's class, as messages name it."""
        klass = self.module_class
        return f"{klass.__module__}.{klass.__qualname__}" if klass is not None else "?"

    def _key(self) -> tuple:
        return type(self), self.path, self.module_class

    def __eq__(self, other) -> bool:
        return isinstance(other, Mixer) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"<mixer {self.name} at {self.path!r}>"


class Unknown(Mixer):
    """A layer's token mixer titan_ext does not know: it trains (kept whole on every TP rank, sharded by
    FSDP, cut by PP, its FLOPs those of its parameters), and what needs its insides is refused in one line
    naming the layer, the module's class and the fix."""

    name = "unknown mixer"

    def __init__(self, path: str = "", module: nn.Module | None = None, near_miss: str | None = None):
        super().__init__(path, module)
        self.near_miss_reason = near_miss
        """Why a known mixer it resembles is not it (``Mixer.near_miss``), or None."""

    def _refusal(self, layer: int, what: str, fix: str) -> str:
        why = f" ({self.near_miss_reason})" if self.near_miss_reason else ""
        return (f"layer {layer}'s token mixer {self.path!r} ({self.module_name}) is not one titan_ext knows{why}, so "
                f"it has no {what}; {fix}, or register a mixer for it (docs/extending.md)")

    def context_parallel_blocker(self, config, layer):
        return self._refusal(layer, "context-parallel path", "set the degree to 1")

    def document_mask_blocker(self, config, layer):
        return self._refusal(layer, "packed-document path", "turn document_mask off")

    def tp_entries(self, plan):
        return {self.path: plan.replicated()}

    def __repr__(self) -> str:
        return f"<unknown mixer {self.module_name} at {self.path!r}>"


class NoMixer(Mixer):
    """A layer that mixes no tokens (an FFN-only layer of a hybrid, e.g. Nemotron-H's MLP layers): nothing
    to split under CP, nothing for documents to restart, no FLOPs beyond its weights'."""

    name = "no mixer (FFN only)"
    mixes_tokens = False

    def context_parallel_blocker(self, config, layer):
        return None

    def flops_per_token(self, config, layer, seq_len):
        return 0

    def tp_entries(self, plan):
        return {}


class Parallel(Mixer):
    """Several token mixers side by side in one layer (Falcon-H1's Mamba2 and attention, on one input):
    each part keeps its own paths, and the layer has what every part has."""

    def __init__(self, parts: tuple[Mixer, ...]):
        super().__init__("+".join(part.path for part in parts))
        self._parts = parts
        self.name = " + ".join(part.name for part in parts)

    @property
    def parts(self) -> tuple[Mixer, ...]:
        return self._parts

    def _key(self) -> tuple:
        return type(self), self._parts

    def _first(self, reason_of) -> str | None:
        return next((reason for part in self.parts if (reason := reason_of(part))), None)

    def context_parallel_blocker(self, config, layer):
        return self._first(lambda part: part.context_parallel_blocker(config, layer))

    def document_mask_blocker(self, config, layer):
        return self._first(lambda part: part.document_mask_blocker(config, layer))

    def ring_attention_blocker(self, config, layer):
        return self._first(lambda part: part.cp_attention and part.ring_attention_blocker(config, layer))

    def flops_per_token(self, config, layer, seq_len):
        counts = [part.flops_per_token(config, layer, seq_len) for part in self.parts]
        return None if None in counts else sum(counts)

    def tp_entries(self, plan):
        entries = [part.tp_entries(plan) for part in self.parts]
        return None if None in entries else {path: style for each in entries for path, style in each.items()}

    def __repr__(self) -> str:
        return f"<mixers {list(self.parts)}>"
