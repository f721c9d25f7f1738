"""``TPPlan``: a model's tensor-parallel plan as data (the registry by model type: ``model_plans.registry``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from model_plans.styles import (
    Composed, LocalShare, MoEBlockParallel, NormParallel, PlacedElsewhere, PlaceParameters, Replicated, ScalesShares,
    float8_styles,
)

Plan = dict[str, "ParallelStyle | IfPresent"]


@dataclass(frozen=True)
class IfPresent:
    """A plan entry for a module some configurations of the architecture lack (e.g. fla's fused
    ``swiglu_linear`` when ``fuse_swiglu`` is off). Any other entry naming a missing module is an error."""

    style: ParallelStyle


@dataclass(frozen=True)
class TPOptions:
    """The job's choices that change a plan."""

    sequence_parallel: bool = True
    loss_parallel: bool = True
    float8: bool = False
    """torchao's Float8 TP styles (all-gathers in float8); valid only for tensorwise scaling."""
    head_in_loss: bool = False
    """The loss runs the head on its weight's vocabulary shard (titan_ext's chunked loss): the plan places the
    head's weight (``Shard(0)``) and lays out neither its input nor its output."""
    expert_parallel: bool = False
    """MoE blocks' experts are placed by expert parallelism (titan_ext.parallel.expert_parallel; over the TP ranks'
    shares of the tokens with torchtitan's ETP=1, their intermediate dims split over TP with ETP=TP); without it, each
    expert's intermediate dim is split over the TP ranks (titan_ext.parallel.expert_parallel.apply_expert_tp). Either
    way a plan lays out the block around them and names the experts ``experts_placed``."""


class TPPlan:
    """Megatron-style TP for an HF causal LM: a model-level plan plus one plan per block.

    The residual stream is laid out as ``self.activation``. With SP it stays
    a sequence-sharded DTensor between modules, because HF models derive
    positions and masks from ``inputs_embeds.shape``, which must be global.
    Without SP it is a plain replicated tensor, as in torchtitan (a replicated
    DTensor would carry partial gradients into the embedding's masked
    partial, which DTensor cannot convert). Each block costs the Megatron
    minimum: one gather before and one reduction after attention, and the same
    around the MLP.

    Subclasses name their modules (class attributes below) and may give ``attn_plan``, the entries of the
    architecture's own token mixer; the layers of any other mixer take theirs from ``layer_mixers`` (each
    mixer's own entries: ``titan_ext.models.mixers``). ``mlp_plan`` covers gated MLPs (fla's ``GatedMLP``, HF's
    ``LlamaMLP``). An entry for a module the model lacks is an error in
    ``apply_tp`` unless it is wrapped in ``IfPresent`` (e.g. fla's
    ``swiglu_linear``, absent when ``fuse_swiglu`` is off).
    """

    embeddings = "model.embeddings"
    final_norm = "model.norm"
    lm_head = "lm_head"
    layers = "model.layers"
    attn_norm = "attn_norm"
    mlp_norm = "mlp_norm"
    layer_mixers: tuple[tuple[int, Callable[["TPPlan"], Plan]], ...] = ()
    """(layer index, its mixer's entries) for the layers whose token mixer the plan's ``attn_plan`` does not
    cover; set by ``with_layer_mixers``."""

    def __init__(self, options: TPOptions = TPOptions()):
        self.options = options
        if options.float8:
            self.colwise, self.rowwise, self.prepare_input = float8_styles()
        else:
            self.colwise, self.rowwise, self.prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput

    @property
    def activation(self) -> Placement:
        return Shard(1) if self.options.sequence_parallel else Replicate()

    @property
    def local_residual(self) -> bool:
        return not self.options.sequence_parallel

    def norm(self) -> NormParallel:
        """A norm on the residual stream."""
        return NormParallel(self.activation, use_local_output=self.local_residual)

    def out_proj(self) -> ParallelStyle:
        """A rowwise linear writing back to the residual stream (reduce-scatter with SP, else all-reduce)."""
        return self.rowwise(output_layouts=self.activation, use_local_output=self.local_residual)

    def model_plan(self) -> Plan:
        act, loss_parallel = self.activation, self.options.loss_parallel
        # A pipeline stage holds each of these only where it runs it (a misspelled name still fails:
        # the module's parameters are then covered by no entry).
        return {
            self.embeddings: IfPresent(RowwiseParallel(
                input_layouts=Replicate(), output_layouts=act, use_local_output=self.local_residual
            )),
            self.final_norm: IfPresent(self.norm()),
            # Vocab-sharded logits go to torchtitan's loss_parallel context; else gather them.
            self.lm_head: IfPresent(PlaceParameters(Shard(0)) if self.options.head_in_loss else ColwiseParallel(
                input_layouts=act,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )),
        }

    def block_plan(self, index: int | None = None) -> Plan:
        """The plan of block ``index`` (None: a block of the architecture's own mixer)."""
        return {
            self.attn_norm: self.norm(),
            **self.mixer_plan(index),
            self.mlp_norm: self.norm(),
            **self.mlp_plan(),
        }

    def mixer_plan(self, index: int | None) -> Plan:
        """The entries of block ``index``'s token mixer: ``layer_mixers``' where it names the layer, else
        the architecture's own (``attn_plan``)."""
        other = dict(self.layer_mixers).get(index)
        return self.attn_plan() if other is None else other(self)

    def attn_plan(self) -> Plan:
        raise NotImplementedError(f"{type(self).__name__} must define attn_plan() for the layers without their "
                                  "mixer's own entries")

    def gather(self, module: str, kwarg: str | None = None) -> Plan:
        """All-gather a module's input from the residual layout (a no-op without SP)."""
        if kwarg is None:
            style = self.prepare_input(input_layouts=(self.activation,), desired_input_layouts=(Replicate(),))
        else:
            style = self.prepare_input(
                input_kwarg_layouts={kwarg: self.activation}, desired_input_kwarg_layouts={kwarg: Replicate()}
            )
        return {module: style}

    def gather_high_precision(self) -> PrepareModuleInput:
        """A token mixer's ``hidden_states`` all-gathered in high precision, even with Float8: its replicated
        projections (too small to shard, e.g. GLA's ``gk_proj.0``) are no Float8 colwise linears and would
        receive a float8 tensor."""
        return PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": self.activation},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )

    def replicated(self) -> Replicated:
        """A module kept whole on every rank (a token mixer titan_ext does not know): its input gathered from the
        residual layout, its output handed back in it."""
        return Replicated(self.activation, use_local_output=self.local_residual)

    def moe_block(self) -> "MoEBlockParallel":
        """A MoE block: its input all-gathered (every TP rank routes every token), its output a sum of the TP
        ranks' token shares (reduce-scattered with SP, else all-reduced)."""
        return MoEBlockParallel(self.activation, use_local_output=self.local_residual)

    def router(self) -> NormParallel:
        """A MoE router: its weight replicated, computed on every token on every rank (its logits feed the
        balancing loss identically on each)."""
        return NormParallel(Replicate(), use_local_output=True)

    def shared_out_proj(self) -> ParallelStyle:
        """A shared expert's rowwise output inside a MoE block (``moe_block``): not reduced, this rank's partial
        share joins the routed experts' share, which the block sums."""
        return Composed(self.rowwise(output_layouts=Partial(), use_local_output=False), LocalShare())

    def shared_gate(self) -> ScalesShares:
        """A shared expert's gate (hidden -> 1) inside a MoE block: replicated, scaling this rank's share."""
        return ScalesShares()

    def mlp_plan(self) -> Plan:
        from fla.modules.mlp import SwiGLULinearParallel

        return {
            **self.gather("mlp"),
            "mlp.gate_proj": self.colwise(),
            "mlp.up_proj": self.colwise(),
            "mlp.down_proj": self.out_proj(),
            # fla's fused swish(gate) * up @ down_proj.weight bypasses down_proj's hooks.
            "mlp.swiglu_linear": IfPresent(
                SwiGLULinearParallel(output_layouts=self.activation, use_local_output=self.local_residual)
            ),
        }


def experts_placed(options: TPOptions) -> PlacedElsewhere:
    """A MoE block's stacked experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``):
    titan_ext.parallel.expert_parallel places them before TP, by expert parallelism or by splitting each expert's
    intermediate dim over the TP ranks."""
    return PlacedElsewhere("expert parallelism" if options.expert_parallel else "each expert's intermediate dim over TP")


def with_layer_mixers(plan_cls: type[TPPlan], layer_mixers: dict[int, Callable[[TPPlan], Plan]]) -> type[TPPlan]:
    """``plan_cls`` whose layers named in ``layer_mixers`` take those entries (a hybrid's, or every layer's mixer
    its own); the same arguments give the same class."""
    if not layer_mixers:
        return plan_cls
    return _with_layer_mixers(plan_cls, tuple(sorted(layer_mixers.items())))


@functools.cache
def _with_layer_mixers(plan_cls: type[TPPlan], layer_mixers: tuple) -> type[TPPlan]:
    return type(plan_cls.__name__, (plan_cls,), {"__module__": plan_cls.__module__, "__qualname__": plan_cls.__qualname__,
                                                   "layer_mixers": layer_mixers})


def short_conv_plan(at: str = "attn") -> Plan:
    """fla's ShortConvolutions on q/k/v (``use_short_conv``) of the mixer at ``at``: depthwise, so each rank
    convolves the channels its colwise projection produced (weight ``[C, 1, W]`` and bias sharded on ``C``)."""
    return {f"{at}.{name}": IfPresent(PlaceParameters(Shard(0))) for name in ("q_conv1d", "k_conv1d", "v_conv1d")}
