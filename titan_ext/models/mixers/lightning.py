"""Lightning attention (MiniMax's ``linear_attention`` layers): a linear attention with a fixed decay rate per
head, no softmax; gated, normalised output. Its recurrence is simple GLA's (a scalar decay per head), so under
context parallelism its state passes across ranks as GLA's does (``state_passing.DiagonalDecay``)."""

from __future__ import annotations

from typing import ClassVar

import torch.nn as nn
from model_plans.styles import Composed, HeadShare, NormParallel

from titan_ext.kernels.state_passing import DiagonalDecay
from titan_ext.models.mixers.base import Mixer


def lightning_flops(heads: int, head_dim: int, chunk: int = 64) -> int:
    """Chunked simple GLA per token, forward x 3 (training): per head the in-chunk scores and their weighted
    values, 2 * 2*C*D, and reading and updating the ``D x D`` state, 2 * 2*D*D. Linear in sequence length."""
    return 3 * heads * (4 * chunk * head_dim + 4 * head_dim * head_dim)


class TransformersLightningAttention(Mixer):
    """transformers' lightning attention (MiniMax; whatever the family, a module holding one ``qkv_proj`` (each
    head's q, k and v side by side), ``output_gate``, ``out_proj``, a ``norm`` over all heads and a per-head
    ``slope_rate``). In titan_ext's training models it runs ``kernels.transformers_lightning``'s forward: fla's
    simple GLA (the portable one off CUDA), each packed document from zero state (``cu_seq_lens_q``), the state
    passed across ranks under CP; under TP on its rank's heads."""

    name = "transformers' lightning attention"
    held: ClassVar[frozenset[str]] = frozenset({"qkv_proj", "output_gate", "out_proj", "norm"})
    """The modules it holds (among others: its activation)."""
    cp_kernels = {"chunk_simple_gla": DiagonalDecay(gate="g")}
    recurrent_documents = True

    def __init__(self, path: str = "", module: nn.Module | None = None):
        super().__init__(path, module)
        self.heads = getattr(module, "num_attention_heads", 0)
        self.head_dim = getattr(module, "head_dim", 0)

    @classmethod
    def recognizes(cls, module):
        held = {name for name, _ in module.named_children()}
        buffers = dict(module.named_buffers(recurse=False))
        qkv, rates = getattr(module, "qkv_proj", None), buffers.get("slope_rate")
        return (cls.held <= held and isinstance(qkv, nn.Linear) and rates is not None
                and qkv.out_features == 3 * rates.numel() * getattr(module, "head_dim", 0))

    def training_forward(self):
        from titan_ext.kernels import transformers_lightning

        return transformers_lightning.minimax_forward

    def tp_entries(self, plan):
        """Heads split across ranks: ``qkv_proj`` (each head's q, k and v side by side: a contiguous split keeps
        heads whole) and ``output_gate`` colwise, ``out_proj`` rowwise; the decay rates sliced to this rank's
        heads by the forward (``HeadShare``). The ``norm`` spans every head's outputs: its input is declared
        sharded on them, and DTensor sums the squares over the ranks."""
        from torch.distributed.tensor import Shard

        at = self.path
        return {
            at: Composed(plan.gather(at, kwarg="hidden_states")[at], HeadShare()),
            f"{at}.qkv_proj": plan.colwise(),
            f"{at}.output_gate": plan.colwise(),
            f"{at}.norm": NormParallel(Shard(-1), use_local_output=True),
            f"{at}.out_proj": plan.out_proj(),
        }

    def flops_per_token(self, config, layer, seq_len):
        return lightning_flops(self.heads, self.head_dim)
