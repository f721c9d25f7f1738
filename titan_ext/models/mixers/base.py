"""``Mixer``: what titan_ext knows about one kind of token mixer, whichever model it sits in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from titan_ext.kernels.state_passing import AffineState, DiagonalDecay


class Mixer:
    """One kind of token mixer; methods read the model's HF config and the layer's index (a hybrid's
    attention layers take their settings from the config's per-layer entries)."""

    name: ClassVar[str] = ""
    """How messages name it (``gla``, ``fla attention``, ...)."""
    attribute: ClassVar[str] = "attn"
    """The block's attribute holding it (fla: ``attn``; transformers: ``self_attn`` or ``linear_attn``)."""
    tp_plan: ClassVar[str | None] = None
    """Its tensor-parallel entries: a function of ``model_plans.mixers`` by name (None: none)."""
    cp_kernels: ClassVar[Mapping[str, DiagonalDecay | AffineState]] = {}
    """Context parallelism for a recurrence (``titan_ext.context_parallel``): the kernels it calls by global
    name, each with its kind of recurrence (``kernels.state_passing``)."""
    cp_contract: ClassVar[str] = "fla"
    """The call contract of its ``cp_kernels``: ``fla`` (documents as ``cu_seqlens`` from the model's forward,
    short convolutions in fla's ``ShortConvolution``) or ``transformers`` (``[B, T]`` rows: under CP the
    documents come from the step's ``PieceLayout``, and its ``causal_conv1d_fn`` reads the previous
    piece's last inputs)."""
    recurrent_documents: ClassVar[bool] = False
    """Whether a transformers model's layer of this mixer is a recurrence that takes packed documents from
    the ``cu_seq_lens_q`` its layer receives (``titan_ext.documents``: its module gets no per-document
    attention)."""
    portable_kernels: ClassVar[bool] = False
    """Whether its module calls kernels ``titan_ext.kernels`` replaces off CUDA (``host_patches.MODEL_KERNELS``):
    a transformers model holding one is bound too (fla's models always are)."""
    cp_attention: ClassVar[str] = ""
    """Context parallelism for softmax attention (torch's ring, or all-gathered keys and values where
    masked): ``"fla"`` (fla's ``Attention``) or ``"transformers"`` (through the attention registry its
    modeling file reads)."""
    cp_latents: ClassVar[str] = ""
    """Where a ``transformers`` attention expands compressed keys and values into its heads' (MLA's
    ``expand_kv(latent, rotary_key)``): where the attention is masked under CP, each rank all-gathers
    that method's inputs and expands them itself, rather than all-gathering the keys and values."""

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
        if not (self.cp_kernels or self.cp_attention):
            return f"titan_ext has no context-parallel path for {self.name} yet; set it to 1"
        return None

    def __repr__(self) -> str:
        return f"<mixer {self.name}>"


class Unknown(Mixer):
    """The native mixer of a model type titan_ext has no architecture for: trained, but with no CP path
    and no FLOP count."""

    def __init__(self, model_type: str):
        self.model_type = model_type

    @property
    def name(self) -> str:
        return f"{self.model_type!r} models' mixer"

    def context_parallel_blocker(self, config, layer):
        return f"titan_ext has no context-parallel path for {config.model_type!r} models yet; set it to 1"
