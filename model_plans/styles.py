"""Parallel styles the stock ones lack, and the Float8 swap.

torch's ``SequenceParallel`` (and fla's ``NormParallel``) keep only the first
positional input, so fla's fused norms lose their residual (``mlp_norm(h,
residual, True)``) or gate (``g_norm_swish_gate(o, g)``). ``NormParallel``
here lays out every tensor argument.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map


class NormParallel(ParallelStyle):
    """A norm whose weights are replicated and whose tensor inputs all share one layout.

    ``layout`` is ``Shard(1)`` for sequence-parallel norms on the residual
    stream, ``Replicate()`` without SP, and ``Shard(-2)`` (heads) for the
    per-head output norm inside attention, whose output meets plain local
    tensors (``use_local_output``).
    """

    def __init__(self, layout: Placement, use_local_output: bool = False):
        super().__init__()
        self.layout = layout
        self.use_local_output = use_local_output

    def _to_layout(self, x, mesh: DeviceMesh):
        if not isinstance(x, torch.Tensor):
            return x
        if not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, (self.layout,), run_check=False)
        if x.placements != (self.layout,):
            return x.redistribute(placements=(self.layout,))
        return x

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            # Norm weights start equal on every rank (ones, or one checkpoint).
            dparam = DTensor.from_local(param, device_mesh, (Replicate(),), run_check=False)
            module.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))

        def pre_hook(mod, args, kwargs):
            lay = lambda x: self._to_layout(x, device_mesh)  # noqa: E731
            return tuple(lay(a) for a in args), {k: lay(v) for k, v in kwargs.items()}

        def post_hook(mod, args, output):
            return tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, output)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if self.use_local_output:
            module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return f"NormParallel(layout={self.layout}, use_local_output={self.use_local_output})"


class MoEBlockParallel(ParallelStyle):
    """A MoE block (router + experts) whose TP ranks each compute a partial sum of its output: the experts for
    a share of the tokens (EP over the TP ranks), or every token's experts on a share of each expert's
    intermediate dim (``titan_ext.parallel.expert_parallel.apply_expert_tp``).

    Its input (the residual, laid out as ``layout``) is all-gathered and handed on as a plain tensor whose gradient is
    declared replicated: the block must make every rank's input gradient the whole one (the experts all-reduce their
    shares', ``titan_ext.parallel.expert_parallel``; the replicated router's is the same on every rank).
    Its output, the ranks' partial sums, is reduced to ``layout``.
    """

    def __init__(self, layout: Placement, use_local_output: bool = False):
        super().__init__()
        self.layout = layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(mod, args):
            x, *rest = args
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.layout,), run_check=False)
            return (x.redistribute(placements=(Replicate(),)).to_local(), *rest)

        def post_hook(mod, args, output):
            out = DTensor.from_local(output, device_mesh, (Partial(),), run_check=False)
            out = out.redistribute(placements=(self.layout,))
            return out.to_local() if self.use_local_output else out

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return f"MoEBlockParallel(layout={self.layout}, use_local_output={self.use_local_output})"


class LocalShare(ParallelStyle):
    """The last module of a shared expert inside a MoE block under TP (``MoEBlockParallel``): its DTensor
    output, this rank's partial share of the shared expert's output, handed on as a plain tensor like the
    routed experts' share (the block sums the shares). The gradient each share receives is the whole one,
    the same on every rank: declared replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, args, output: output.to_local(grad_placements=(Replicate(),)))
        return module

    def __repr__(self) -> str:
        return "LocalShare()"


class ScalesShares(ParallelStyle):
    """A module replicated on every TP rank whose output scales each rank's partial share of a sum (Qwen3-Next's
    ``shared_expert_gate`` inside a MoE block, ``MoEBlockParallel``): its weights replicated, its input the
    block's gathered plain tensor, its output plain. The gradient of its output is then partial per rank (each
    rank's share): summed over the TP ranks (one all-reduce in backward) before it reaches the module."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        NormParallel(Replicate(), use_local_output=True)._apply(module, device_mesh)

        def post_hook(mod, args, output):
            return DTensor.from_local(output, device_mesh, (Replicate(),), run_check=False).to_local(
                grad_placements=(Partial(),))

        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return "ScalesShares()"


class PlaceParameters(ParallelStyle):
    """A module's own parameters (not its children's) distributed with one placement; no input or output hooks.

    ``Replicate()`` keeps a module whole on every rank on purpose (the plan says so, and the
    coverage check accepts it).
    For parameters a kernel reads directly, without a linear in between:
    ShortConvolution's ``[C, 1, W]`` weight and ``[C]`` bias, Gated DeltaNet's
    per-head ``A_log``/``dt_bias``. ``Shard(0)`` splits their channels or heads
    as the colwise projection feeding them splits its outputs. They become
    DTensors with the global shape (for init, DCP and FSDP); the activations
    reaching them are plain local tensors, so the kernels that read them must
    take their local shard (``titan_ext.kernels.tp_local``).
    """

    def __init__(self, placement: Placement):
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            dparam = distribute_tensor(param, device_mesh, (self.placement,), src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"PlaceParameters({self.placement})"


class PlaceEach(ParallelStyle):
    """A module's own parameters distributed each with its placement (``{name: placement}``): parameters the
    module's own code reads beside DTensor activations (Kimi Linear's forget gate adds ``dt_bias``,
    ``[heads * head_dim]``, to its sharded output and scales it by ``A_log``, ``[1, 1, heads, 1]``)."""

    def __init__(self, placements: dict[str, Placement]):
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            param = module.get_parameter(name)
            dparam = distribute_tensor(param, device_mesh, (placement,), src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"PlaceEach({self.placements})"


class LocalWidth(ParallelStyle):
    """The module's ``attribute`` (a width its forward splits its projections' outputs by) divided by the
    TP degree, on the instance: those outputs hold this rank's heads only."""

    def __init__(self, attribute: str):
        super().__init__()
        self.attribute = attribute

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        setattr(module, self.attribute, getattr(module, self.attribute) // device_mesh.size())
        return module

    def __repr__(self) -> str:
        return f"LocalWidth({self.attribute!r})"


class HeadShare(ParallelStyle):
    """Records on the module which share of its heads this rank holds (``tp_share``: (rank, ranks)), as its
    colwise projections split them: for a forward that reads per-head values beside them that TP does not
    place (MiniMax's decay rates, a buffer its initializer sets)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.tp_share = (device_mesh.get_local_rank(), device_mesh.size())
        return module

    def __repr__(self) -> str:
        return "HeadShare()"


class SharedKeyLatent(ParallelStyle):
    """MLA's key-latent projection (``kv_a_proj_with_mqa``, what HF's plans call ``mla_kv_a_proj``) inside a
    head-split attention: its weight replicated, its output this rank's plain tensor.

    Its latent columns go on through the replicated ``kv_a_layernorm`` into the colwise ``kv_b_proj``, which
    sums their gradient over the ranks; its last ``width`` columns (``qk_rope_head_dim``) are the rotary key
    every head shares, read by this rank's heads alone, so their gradient is summed here (an all-reduce in the
    backward).
    """

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        replicated = PlaceParameters(Replicate())
        replicated.src_data_rank = self.src_data_rank
        replicated._apply(module, device_mesh)
        width, group = self.width, device_mesh.get_group()

        def to_local(mod, args, output):
            local = output.to_local() if isinstance(output, DTensor) else output
            return _SumTailGradient.apply(local, width, group)

        module.register_forward_hook(to_local)
        return module

    def __repr__(self) -> str:
        return f"SharedKeyLatent({self.width})"


class _SumTailGradient(torch.autograd.Function):
    """Identity forward; the backward sums the gradient of the last ``width`` columns over ``group``."""

    @staticmethod
    def forward(ctx, x, width: int, group):
        ctx.width, ctx.group = width, group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        tail = grad[..., -ctx.width:].contiguous()
        torch.distributed.all_reduce(tail, group=ctx.group)
        return torch.cat([grad[..., :-ctx.width], tail], dim=-1), None, None


class Replicated(ParallelStyle):
    """A module TP keeps whole on every rank, run as it is (a token mixer titan_ext does not know): every
    parameter beneath it a replicated DTensor, handed to its code as the plain local tensor; its tensor inputs
    gathered from the residual ``layout``, its output given back in it.

    Each rank computes the same output and, from the same output gradient, the same parameter and input
    gradients: the parameters' gradients are whole on every rank (replicated), as FSDP then reduces them.
    """

    covers_children = True
    """It places the parameters of every module beneath it (``model_plans.validate`` counts them covered)."""

    def __init__(self, layout: Placement, use_local_output: bool = False):
        super().__init__()
        self.layout = layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        owners = []
        for owner in module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                dparam = distribute_tensor(param, device_mesh, (Replicate(),), src_data_rank=self.src_data_rank)
                owner.register_parameter(name, nn.Parameter(dparam, requires_grad=param.requires_grad))
                owners.append((owner, name))
        held = []

        def gathered(x):
            return x.redistribute(placements=(Replicate(),)).to_local() if isinstance(x, DTensor) else x

        def pre_hook(mod, args, kwargs):
            # the parameters as their local tensors for the module's own code (restored after its forward)
            held.append([(owner, name, owner._parameters[name]) for owner, name in owners])
            for owner, name in owners:
                param = owner._parameters[name]
                if isinstance(param, DTensor):
                    owner._parameters[name] = param.to_local()
            return tree_map(gathered, args), tree_map(gathered, kwargs)

        def post_hook(mod, args, kwargs, output):
            for owner, name, param in held.pop():
                owner._parameters[name] = param

            def laid_out(x):
                if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() < 2:
                    return x
                out = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
                out = out.redistribute(placements=(self.layout,))
                return out.to_local() if self.use_local_output else out

            if isinstance(output, tuple):  # (hidden states, extras): the hidden states go back to the residual
                return (laid_out(output[0]), *output[1:])
            return laid_out(output)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"Replicated(layout={self.layout}, use_local_output={self.use_local_output})"


class PlacedElsewhere(ParallelStyle):
    """A module whose parameters another parallelism places (MoE experts under expert parallelism, applied
    before TP): TP leaves it as it is, and the plan still says where each parameter goes."""

    def __init__(self, by: str):
        super().__init__()
        self.by = by

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module

    def __repr__(self) -> str:
        return f"PlacedElsewhere(by={self.by!r})"


class GatheredHiddenStates(ParallelStyle):
    """A module's hidden states, whether its layer passes them first or as ``hidden_states`` (Mamba2's and
    Nemotron-H's layers pass them first, Bamba's by name), from the residual ``layout`` to a replicated DTensor:
    all-gathered with sequence parallel, and in the backward their gradient summed over the ranks."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicated(x):
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (self.layout,), run_check=False)
            return x if x.placements == (Replicate(),) else x.redistribute(placements=(Replicate(),))

        def pre_hook(mod, args, kwargs):
            if args:
                return (replicated(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": replicated(kwargs["hidden_states"])}

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"GatheredHiddenStates({self.layout})"


class Composed(ParallelStyle):
    """Several styles on one module, applied in order: a plan names each module once, and a module
    may need both its inputs laid out and its own parameters placed."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            style.src_data_rank = self.src_data_rank
            module = style._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"Composed({', '.join(map(repr, self.styles))})"


def float8_styles():
    """torchao's Float8 counterparts of (Colwise, Rowwise, PrepareModuleInput)."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def is_float8_style(style: ParallelStyle) -> bool:
    return type(style).__module__.startswith("torchao.float8")


def plain_style(style: ParallelStyle) -> ParallelStyle:
    """The high-precision style with the same layouts (for a module the converter left alone)."""
    if isinstance(style, ColwiseParallel) or isinstance(style, RowwiseParallel):
        base = ColwiseParallel if isinstance(style, ColwiseParallel) else RowwiseParallel
        return base(
            input_layouts=style.input_layouts[0],
            output_layouts=style.output_layouts[0],
            use_local_output=style.use_local_output,
        )
    if isinstance(style, PrepareModuleInput):
        return PrepareModuleInput(
            input_layouts=style.input_layouts,
            desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
            use_local_output=style.use_local_output,
        )
    raise TypeError(f"no plain counterpart for {style!r}")
