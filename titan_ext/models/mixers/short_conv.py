"""A gated short convolution (LFM2's ``conv`` layers): ``out_proj(C * conv(B * x))``, the three gates from one
``in_proj``, the convolution depthwise and causal over a few tokens. No state: under context parallelism each
piece reads only the previous piece's last inputs (its halo)."""

from __future__ import annotations

import torch.nn as nn
from model_plans.styles import PlaceParameters

from titan_ext.models.mixers.base import Mixer, forward_globals, kernel_name


class TransformersShortConv(Mixer):
    """transformers' gated short convolution (LFM2, LFM2-MoE; whatever the family, a module whose forward calls
    ``causal_conv1d_fn`` and that holds only ``in_proj`` (three gates), a depthwise ``conv`` and ``out_proj``). In
    titan_ext's training models it runs ``kernels.transformers_short_conv``'s forward: the convolution by fla's
    contract, restarted at each packed document (``cu_seq_lens_q``), reading the previous piece's last inputs
    under CP; under TP on its rank's channels."""

    name = "transformers' short convolution"
    cp_halos = ("causal_conv1d",)
    recurrent_documents = True

    def __init__(self, path: str = "", module: nn.Module | None = None):
        super().__init__(path, module)
        self.channels = module.conv.in_channels if module is not None else 0

    @classmethod
    def recognizes(cls, module):
        children = dict(module.named_children())
        conv, in_proj, out_proj = children.get("conv"), children.get("in_proj"), children.get("out_proj")
        calls = {kernel_name(value) for value in forward_globals(module).values()}
        return ("causal_conv1d_fn" in calls and set(children) == {"conv", "in_proj", "out_proj"}
                and next(module.parameters(recurse=False), None) is None
                and isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels == conv.out_channels
                and isinstance(in_proj, nn.Linear) and in_proj.out_features == 3 * conv.in_channels
                and isinstance(out_proj, nn.Linear) and out_proj.in_features == conv.in_channels)

    def training_forward(self):
        from titan_ext.kernels import transformers_short_conv

        return transformers_short_conv.lfm2_forward

    def tp_entries(self, plan):
        """Channels split across ranks. ``in_proj`` holds all of ``B``, then all of ``C``, then all of ``x``: a
        rank's channels are a slice of each, which no DTensor placement expresses, so its weight stays replicated
        (FSDP still shards it) and the forward multiplies this rank's rows of each gate, their gradient summed
        over the ranks; the depthwise ``conv`` likewise (its channels are this rank's of ``B * x``). ``out_proj``
        rowwise. The input is gathered in high precision: ``in_proj`` is no Float8 colwise linear."""
        from torch.distributed.tensor import Replicate

        at = self.path
        return {
            at: plan.gather_high_precision(),
            f"{at}.in_proj": PlaceParameters(Replicate()),
            f"{at}.conv": PlaceParameters(Replicate()),
            f"{at}.out_proj": plan.out_proj(),
        }

    def flops_per_token(self, config, layer, seq_len):
        """Per channel and token, forward x 3 (training): ``W`` multiply-adds of the convolution and the two
        gate products, 2 * (W + 2) FLOPs."""
        return 3 * 2 * (self.halo + 1 + 2) * self.channels
