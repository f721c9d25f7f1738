"""Mixture-of-experts models: the routers' load-balancing loss as the model was trained, its metrics, expert
parallelism, the experts' tensor parallelism, and the parallelisms titan_ext cannot combine with them yet,
refused in one line.

transformers' MoE blocks hold a router (``router_logits, scores, indices = router(x)``; found by what it holds,
``router_of``: Qwen's ``gate``, gpt-oss's ``router``) and one ``experts`` module of stacked weights. Their causal LMs add ``router_aux_loss_coef`` x the Switch
Transformer balancing loss only when asked for router logits and given labels, which torchtitan never
does (it computes the loss from the logits). Here a forward hook on each router keeps its logits, and the
loss adds the balancing term (``with_balance_loss``).

The term is counted per token, as torchtitan's cross entropy is (a sum the trainer divides by the global
count of valid tokens): over one sequence the model's own formula (``load_balancing_loss_func`` with the
valid labels as its mask: expert shares and mean router probabilities over all MoE layers), weighted by the
sequence's valid tokens. A sequence's term needs nothing from other sequences, so the loss is the same under
FSDP/HSDP/DDP and with gradient accumulation; for one sequence per batch it is the model's own loss exactly.
Under CP each rank holds pieces of every sequence: the ranks sum each sequence's expert assignments and valid
tokens (no gradient flows through them), and each rank's term is its own tokens' share of the probability
sum, which is linear, so the ranks' terms add up to the whole sequence's loss and its gradient, as the cross
entropy's do. Under PP the stages before the last carry their routers' statistics to the loss with their hidden
states, and the gradient comes back the same way (``apply_router_records``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate

from titan_ext import compat
from titan_ext.errors import ConfigError
from titan_ext.job_plan import MoEChoice

logger = logging.getLogger()

IGNORE_INDEX = -100


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """transformers' sparse MoE blocks: a router (``router_of``) beside an ``experts`` module."""
    return [m for m in model.modules() if router_of(m) is not None]


def router_of(block: nn.Module) -> nn.Module | None:
    """A MoE block's router, whatever the block calls it (Qwen's ``gate``, gpt-oss's ``router``): beside the
    block's ``experts``, which its forward hands the router's choice (``experts(hidden, indices, weights)``), the
    module choosing ``top_k`` of them (its contract is probed at the job's start: ``host_checks``). Llama 4's
    experts take the tokens already weighted: no such block."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module) or not _experts_take_the_choice(type(block)):
        return None
    router = next((child for child in block.children() if child is not experts and hasattr(child, "top_k")), None)
    return router if router is not None and _scores_each_expert(router, experts) else None


def _scores_each_expert(router: nn.Module, experts: nn.Module) -> bool:
    """Whether a linear of the router has one row per expert (LongCat's scores computeless experts too: its
    logits are not the experts', which the balancing loss counts)."""
    stacked = getattr(experts, "gate_up_proj", None)
    count = getattr(router, "num_experts", None) or (stacked.shape[0] if stacked is not None else None)
    weights = [p for p in router.parameters() if p.ndim == 2]
    return count is None or not weights or any(w.shape[0] == count for w in weights)


@functools.cache
def _experts_take_the_choice(cls: type) -> bool:
    """Whether ``cls.forward`` calls ``self.experts`` with three arguments or more (hidden states, the top-k
    experts and their weights); True where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "experts"
               and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
               and len(node.args) + len(node.keywords) >= 3 for node in ast.walk(tree))


def routers(model: nn.Module) -> list[nn.Module]:
    return [router_of(block) for block in moe_blocks(model)]


STACKED = ["down_proj", "gate_up_proj"]
"""The experts' parameters expert parallelism and expert TP split and compute: ``down(act(gate) * up)``."""


def stacked_plainly(experts: nn.Module) -> bool:
    """Experts of stacked ``gate_up_proj`` and ``down_proj`` alone (not gpt-oss's, which add biases, a clamped
    SwiGLU and interleaved gate/up rows)."""
    return sorted(name for name, _ in experts.named_parameters()) == STACKED


BALANCES = ("aux_loss", "bias")
"""``[titan_ext] moe_balance``'s values."""

ROUTER_FIELDS = ("weight", "hidden_dim", "num_experts", "top_k", "norm_topk_prob")
"""What the biased router reads of transformers' router (Qwen2/3-MoE's, Qwen3-Next's, OLMoE's; not Mixtral's)."""

BIAS_RATE = 1e-3
"""How far one optimizer step moves an expert's routing bias (torchtitan's default ``load_balance_coeff``)."""


def balance_option(job_config) -> str:
    return getattr(getattr(job_config, "titan_ext", None), "moe_balance", "aux_loss")


def moe_choice(model: nn.Module, job_config=None) -> MoEChoice | None:
    """From the meta model: None for a dense model. With the routing bias the loss needs no router logits and
    the routers count their own tokens."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    gate = router_of(blocks[0])
    balance = balance_option(job_config)
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) if balance == "aux_loss" else 0.0
    p = job_config.parallelism if job_config is not None else None
    return MoEChoice(aux_loss_coef=coef, num_experts=gate.num_experts, top_k=gate.top_k,
                     ep=p.expert_parallel_degree if p else 1,
                     split_intermediate=bool(p) and splits_intermediate(p, blocks),
                     balance=balance, record_routers=balance == "aux_loss",
                     moe_layers=tuple(moe_layer_indices(model)))


def check_moe(model: nn.Module, job_config) -> None:
    """Expert parallelism and balancing options titan_ext cannot follow, refused in one line."""
    p = job_config.parallelism
    blocks = moe_blocks(model)
    balance = balance_option(job_config)
    if balance not in BALANCES:
        raise ConfigError(f"--titan_ext.moe_balance={balance!r} is not one of {', '.join(BALANCES)}; pick one")
    if balance == "bias" and not blocks:
        raise ConfigError("--titan_ext.moe_balance='bias': this model has no experts (a dense model); remove it")
    router = router_of(blocks[0]) if blocks else None
    if balance == "bias" and not all(hasattr(router, name) for name in ROUTER_FIELDS):
        raise ConfigError(
            f"--titan_ext.moe_balance='bias': titan_ext biases transformers' softmax top-k routers (holding "
            f"{', '.join(ROUTER_FIELDS)}); {type(router).__name__} is not one; use moe_balance='aux_loss'"
        )
    checkpoint = getattr(job_config, "checkpoint", None)
    hf_flags = [flag for flag in ("initial_load_in_hf", "last_save_in_hf") if getattr(checkpoint, flag, False)]
    if balance == "bias" and hf_flags:
        raise ConfigError(
            f"--titan_ext.moe_balance='bias' with --checkpoint.{hf_flags[0]}: transformers' {model.config.model_type} "
            "has no routing bias among its weights, so the HF checkpoint would lose it; use torchtitan's (DCP) "
            "checkpoints with the bias, or moe_balance='aux_loss'"
        )
    if p.expert_parallel_degree > 1 and not blocks:
        raise ConfigError(
            f"--parallelism.expert_parallel_degree={p.expert_parallel_degree}: this model has no experts (a dense "
            "model); set it to 1"
        )
    if not blocks:
        return
    if p.expert_parallel_degree > 1:
        _check_ep(blocks, p)
    if splits_intermediate(p, blocks):
        _check_split_intermediate(blocks, p)
    if p.tensor_parallel_degree > 1 and torch.__version__ < "2.13" and _softmax_top_k(router):
        raise ConfigError(
            f"--parallelism.tensor_parallel_degree={p.tensor_parallel_degree} with {type(router).__name__} needs torch "
            f"2.13 or later: torch {torch.__version__}'s DTensor cannot backpropagate the replicated router's top-k "
            "values (its backward mixes a plain tensor into a DTensor scatter); upgrade torch, or use expert "
            "parallelism or FSDP alone"
        )


def _softmax_top_k(router: nn.Module) -> bool:
    """transformers' softmax top-k router (Qwen2/3-MoE's, Qwen3-Next's, OLMoE's): it backpropagates through its
    top-k values, which torch 2.11's DTensor cannot. DeepSeek-V3's and Kimi Linear's gather their weights by the
    top-k's indices, which it can (their TP rows pass on torch 2.11); they carry a score correction bias."""
    return all(hasattr(router, name) for name in ROUTER_FIELDS) and not hasattr(router, "e_score_correction_bias")


def splits_intermediate(p, blocks: list[nn.Module]) -> bool:
    """Whether each expert's intermediate dim is split over the TP ranks: torchtitan's TP of the experts, under
    TP without EP and under EP with ``expert_tensor_parallel_degree`` equal to the TP degree (ETP=TP). Experts
    other than plainly stacked ones are split by no path: under TP without EP their block stays whole on every
    rank (as their model's HF plan, naming no split of them, leaves it; gpt-oss's), under EP refused."""
    tp = p.tensor_parallel_degree
    if p.expert_parallel_degree == 1 and not all(stacked_plainly(block.experts) for block in blocks):
        return False
    return tp > 1 and (p.expert_parallel_degree == 1 or p.expert_tensor_parallel_degree == tp)


def _check_stacked(blocks: list[nn.Module], option: str) -> None:
    for block in blocks:
        experts = block.experts
        if not stacked_plainly(experts):
            names = sorted(name for name, _ in experts.named_parameters())
            raise ConfigError(
                f"{option}: {type(experts).__name__} (holding {', '.join(names)}) has no expert-parallel path in "
                f"titan_ext, which splits experts of stacked {' and '.join(STACKED)} alone; set it to 1"
            )


def _check_ep(blocks: list[nn.Module], p) -> None:
    ep = p.expert_parallel_degree  # ETP other than 1 or the TP degree: refused with the degrees (titan_ext.validate)
    option = f"--parallelism.expert_parallel_degree={ep}"
    _check_stacked(blocks, option)
    for block in blocks:
        count = block.experts.gate_up_proj.shape[0]
        if count % ep:
            raise ConfigError(f"{option} does not divide the model's {count} experts; pick a divisor")


def _check_split_intermediate(blocks: list[nn.Module], p) -> None:
    tp = p.tensor_parallel_degree
    option = f"--parallelism.tensor_parallel_degree={tp}"
    _check_stacked(blocks, option)
    intermediate = blocks[0].experts.gate_up_proj.shape[1] // 2
    if intermediate % tp:
        raise ConfigError(
            f"{option} does not divide the experts' intermediate size ({intermediate}, moe_intermediate_size), "
            "which TP splits; pick a degree that divides it"
        )


# ---------------------------------------------------------------- expert parallelism


def apply_ep(model: nn.Module, ep_mesh, tp_mesh=None) -> None:
    """Each rank of ``ep_mesh`` holds ``num_experts / ep`` experts (their stacked weights sharded on dim 0) and
    computes them for every rank's tokens: tokens go to their experts' ranks in one all-to-all and come back in
    another. The parameters keep their names (``mlp.experts.gate_up_proj``), so checkpoints are unchanged.

    Under TP (``tp_mesh``; torchtitan's ETP=1, the EP mesh spanning the TP ranks) every TP rank holds all of
    its batch's tokens (the block gathers them, ``model_plans``' ``moe_block``) and dispatches its share of them
    (a TP rank's slice of the flattened tokens); the block sums the shares."""
    from torch.distributed.tensor import Shard

    for block in moe_blocks(model):
        _place(block.experts, ep_mesh, {"gate_up_proj": [Shard(0)], "down_proj": [Shard(0)]})
        _parallel_experts(block.experts, ep_mesh.get_group(), tp_mesh, split_intermediate=False)
    logger.info(f"Applied expert parallelism (EP={ep_mesh.size()}) to {len(moe_blocks(model))} MoE blocks")


def apply_expert_tp(model: nn.Module, mesh) -> None:
    """torchtitan's TP of the experts: each expert's intermediate dim split over the TP ranks, on the tokens
    every TP rank holds whole (the block gathers them, ``model_plans``' ``moe_block``): ``gate_up_proj``'s gate
    rows and its up rows each split alike (rank r holds gate rows r and up rows r: ``act(gate) * up`` stays
    local), ``down_proj`` split on its input dim, each rank's output a partial sum that the block reduces.

    ``mesh``: the TP mesh (TP without EP), or the ``("ep", "etp")`` mesh (torchtitan's ETP=TP): the experts
    then split over the EP ranks too, each TP rank dispatching all its tokens over its EP group. The packed
    ``[gate; up]`` rows are laid out as a ``_StridedShard`` (the full tensor, checkpoints and HF exports
    unchanged), which DCP cannot describe as one box per rank: ``titan_ext.strided_checkpoint`` gives it its
    boxes."""
    from torch.distributed.tensor import Shard

    from titan_ext.checkpoints import host_patches

    host_patches.apply_once(host_patches.STRIDED_CHECKPOINT)

    ep = mesh.ndim == 2
    outer = [Shard(0)] if ep else []
    for block in moe_blocks(model):
        experts = block.experts
        _place(experts, mesh, {"gate_up_proj": [*outer, compat.strided_shard(1, 2)], "down_proj": [*outer, Shard(2)]})
        _parallel_experts(experts, mesh["ep"].get_group() if ep else None, mesh["etp"] if ep else mesh,
                          split_intermediate=True)
    where = f"EP={mesh['ep'].size()} x ETP={mesh['etp'].size()}" if ep else f"TP={mesh.size()}"
    logger.info(f"Split the experts' intermediate dims ({where}) in {len(moe_blocks(model))} MoE blocks")


def _place(experts: nn.Module, mesh, placements: dict) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(experts.named_parameters(recurse=False)):
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, placements[name])))


def _parallel_experts(experts: nn.Module, ep_group, tp_mesh, split_intermediate: bool) -> None:
    experts.__class__ = _expert_parallel_class(type(experts))
    experts.ep_group, experts.tp_mesh, experts.split_intermediate = ep_group, tp_mesh, split_intermediate


@functools.cache
def _expert_parallel_class(cls: type) -> type:
    """The model's experts class with an expert-parallel forward (isinstance checks, e.g. its weight init, hold)."""
    return type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _expert_parallel_forward})


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, as the model's own
    forward computes it, with this rank's experts only; under TP (ETP=1) this TP rank's share of the tokens,
    zeros elsewhere; with the intermediate dims split (``apply_expert_tp``) this TP rank's partial sum."""
    if self.tp_mesh is None:
        return _dispatch_and_combine(self, hidden_states, top_k_index, top_k_weights)
    hidden_states, top_k_weights = (share_gradient(x, self.tp_mesh) for x in (hidden_states, top_k_weights))
    if self.split_intermediate:
        compute = _dispatch_and_combine if self.ep_group is not None else _combine_locally
        return compute(self, hidden_states, top_k_index, top_k_weights)
    rows = torch.arange(hidden_states.shape[0], device=hidden_states.device)
    mine = rows.tensor_split(self.tp_mesh.size())[self.tp_mesh.get_local_rank()]
    out = _dispatch_and_combine(self, hidden_states[mine], top_k_index[mine], top_k_weights[mine])
    return hidden_states.new_zeros(hidden_states.shape).index_copy(0, mine, out)


def share_gradient(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    """``x`` as it is, its gradient summed over ``tp_mesh`` (every TP rank's share, or partial sum, reads it)."""
    return DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def _dispatch_and_combine(self, hidden_states, top_k_index, top_k_weights):
    group, ep = self.ep_group, dist.get_world_size(self.ep_group)
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()  # [E/ep, 2I, H], [E/ep, H, I]
    local = gate_up.shape[0]
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    with torch.no_grad():
        sent_counts = torch.bincount(flat, minlength=local * ep)
        received_counts = compat.all_to_all_counts(sent_counts, group).view(ep, local)
        send = sent_counts.view(ep, local).sum(1).tolist()
        receive = received_counts.sum(1).tolist()
        # received rows come per source rank, each grouped by local expert: regroup them by local expert
        local_ids = torch.arange(local, device=flat.device).repeat(ep).repeat_interleave(received_counts.flatten())
        regroup = local_ids.argsort(stable=True)
    routed = compat.all_to_all_autograd(hidden_states[order // k], receive, send, group)[regroup]
    computed = _local_experts(self.act_fn, routed, received_counts.sum(0), gate_up, down)[_inverse(regroup)]
    returned = compat.all_to_all_autograd(computed, send, receive, group)[_inverse(order)]
    weighted = returned.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(-2).to(hidden_states.dtype)


def _combine_locally(self, hidden_states, top_k_index, top_k_weights):
    """The model's experts forward on this rank's local weights (every expert; under TP its intermediate share)."""
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    computed = _local_experts(self.act_fn, hidden_states[order // k], counts, gate_up, down)[_inverse(order)]
    weighted = computed.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(-2).to(hidden_states.dtype)


def _local_experts(act_fn, rows, counts, gate_up, down):
    """``down(act(gate) * up)`` of each local expert on its rows (``rows`` grouped by expert, ``counts`` per
    expert), all experts in one grouped GEMM (``compat.grouped_mm``)."""
    ends = counts.cumsum(0)
    gate, up = compat.grouped_mm(rows, gate_up.transpose(-2, -1), ends).chunk(2, dim=-1)
    return compat.grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), ends)


# ---------------------------------------------------------------- auxiliary-loss-free balancing


def apply_expert_bias(model: nn.Module) -> None:
    """torchtitan's auxiliary-loss-free balancing (arXiv 2408.15664) on transformers' routers: a per-expert
    ``expert_bias`` (a buffer saved in checkpoints) added to the router's probabilities to choose the top-k
    experts only (the chosen experts' weights are the unbiased probabilities), and the tokens each expert got
    since the last optimizer step (``tokens_per_expert``), which ``update_expert_bias`` turns into the bias."""
    for router in routers(model):
        bias_router(router)


def bias_router(gate: nn.Module) -> nn.Module:
    """One router, biased in place (a zero bias: it routes as before)."""
    gate.register_buffer("expert_bias", torch.zeros(gate.num_experts, device=gate.weight.device))
    gate.register_buffer("tokens_per_expert", torch.zeros(gate.num_experts, device=gate.weight.device),
                         persistent=False)
    gate.__class__ = _biased_router_class(type(gate))
    return gate


@functools.cache
def _biased_router_class(cls: type) -> type:
    return type(f"Biased{cls.__name__}", (cls,), {"forward": _biased_router_forward,
                                                   "init_titan_ext_buffers": _zero_expert_bias})


def _zero_expert_bias(self) -> None:
    with torch.no_grad():
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()


def _biased_router_forward(self, hidden_states):
    """``(router_logits, top_k_weights, top_k_index)`` as transformers' softmax routers return them, the top-k
    chosen on the probabilities plus ``expert_bias``."""
    weight = self.weight
    if isinstance(hidden_states, DTensor):  # under TP (model_plans' router): replicated, computed locally
        hidden_states, weight = hidden_states.to_local(), weight.to_local()
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), weight)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    index = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices
    weights = probs.gather(-1, index)
    if self.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # training forwards only: not validation, nor a recompute in backward (activation checkpointing), nor torch's
    # pipeline metadata inference (``RouterRecords.live``)
    if torch.is_grad_enabled() and not compat.in_backward() and RECORDS.live:
        with torch.no_grad():
            self.tokens_per_expert += torch.bincount(index.flatten(), minlength=self.num_experts)
    return logits, weights.to(logits.dtype), index


def update_expert_bias(model_parts: list[nn.Module], group: dist.ProcessGroup | None) -> None:
    """After a step's forwards and before its update (torchtitan's optimizer pre-hook, so once per step with
    gradient accumulation): each router's bias moves ``BIAS_RATE`` toward its under-used experts and away from
    its over-used ones (centered), from the tokens each expert got over the global batch (summed over
    ``group``, the batch's ranks): the same bias on every rank. Under PP ``model_parts`` are this rank's
    stages: each router's counts are its own stage's, over all the step's microbatches."""
    biased = [router for part in model_parts for router in routers(part)]
    if not biased:
        return
    counts = torch.stack([router.tokens_per_expert for router in biased])  # [MoE layers here, experts]
    slots = [RECORDS.choice.moe_layers.index(i) for part in model_parts for i in moe_layer_indices(part)]
    RECORDS.add_step(counts.new_zeros(()), counts.new_zeros(()), counts, slots)  # summed over the ranks when logged
    if group is not None and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    with torch.no_grad():
        for router, count in zip(biased, counts):
            delta = BIAS_RATE * torch.sign(count.mean() - count)
            router.expert_bias += delta - delta.mean()
            router.tokens_per_expert.zero_()


def tokens_counted(model_parts: list[nn.Module], counts: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The biased routers' token counts since the last update (none without the routing bias); given ``counts``
    (an earlier return), they are set back to those (the pipeline's warm-up step on gloo counts for no step)."""
    biased = [router for part in model_parts for router in routers(part) if hasattr(router, "expert_bias")]
    with torch.no_grad():
        for router, count in zip(biased, counts or ()):
            router.tokens_per_expert.copy_(count)
    return [router.tokens_per_expert.clone() for router in biased]


def with_expert_bias_update(build_optimizers):
    """Wrap a train spec's ``build_optimizers_fn``: with ``moe_balance = "bias"`` the optimizers update the
    routers' biases before each step."""

    @functools.wraps(build_optimizers)
    def build(model_parts, optimizer_config, parallel_dims, *args, **kwargs):
        from titan_ext.job_plan import plan_of

        optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, *args, **kwargs)
        choice = plan_of(model_parts[0]).moe
        if choice is not None and choice.balance == "bias":
            batch_mesh = parallel_dims.get_optional_mesh("loss")
            group = batch_mesh.get_group() if batch_mesh is not None else None
            optimizers.register_step_pre_hook(lambda *_, **__: update_expert_bias(model_parts, group))
        return optimizers

    return build


# ---------------------------------------------------------------- the routers' statistics, forward to loss


class RouterRecords:
    """What the loss takes from the forward before it (the last stage's router logits, and the statistics that
    earlier pipeline stages carried), and this step's statistics for the metrics. One per process: torchtitan
    builds the loss without the model."""

    def __init__(self) -> None:
        self.choice: MoEChoice | None = None
        self._cp_group: weakref.ref | None = None
        self.pending: list[tuple[list[torch.Tensor], torch.Tensor | None, list[int]]] = []
        """Per forward of the model's last part: its routers' logits, the carried statistics, its MoE layers' slots."""
        self.live = True
        """Whether a forward now is a real one. Under PP (``titan_ext.pipeline``) only the schedule's forwards of
        microbatches are: torch 2.13 first runs each stage once for its metadata inference, on uninitialized
        receive buffers, and that forward must neither count its routing nor leave logits for a loss."""
        self.reset_step()

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """The context-parallel ranks holding pieces of the same sequences (None: no CP). Held weakly: the job's
        mesh owns its groups, and a process that runs one job after another (the planner's sweep, the test
        matrix) frees each job's groups, their threads and sockets, with the job."""
        return self._cp_group() if self._cp_group is not None else None

    @cp_group.setter
    def cp_group(self, group: dist.ProcessGroup | None) -> None:
        self._cp_group = weakref.ref(group) if group is not None else None

    def reset_step(self) -> None:
        self.stats: torch.Tensor | None = None
        """[balancing loss sum, valid tokens, routed tokens per (MoE layer of the whole model, expert)...]."""

    def add_step(self, balance: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor,
                 slots: list[int] | None = None) -> None:
        """``counts``: ``[MoE layers here, experts]``; ``slots``: their places among the whole model's MoE
        layers (None: all of them), so that pipeline stages fill disjoint slots of one vector."""
        layers = counts.new_zeros(len(self.choice.moe_layers), self.choice.num_experts, dtype=torch.float64)
        layers[slots if slots is not None else slice(None)] = counts.double()
        stats = torch.cat([balance.detach().double().view(1), tokens.double().view(1), layers.flatten()])
        self.stats = stats if self.stats is None else self.stats + stats

    def take(self) -> tuple[list[torch.Tensor], torch.Tensor | None, list[int]] | None:
        taken, self.pending = self.pending, []
        if len(taken) > 1:  # a forward without its loss: its routing would join another batch's
            raise RuntimeError(
                f"titan_ext: {len(taken)} forwards of a MoE model reached one loss; every forward of a MoE model "
                "must be followed by its loss"
            )
        return taken[0] if taken else None


RECORDS = RouterRecords()


def moe_layer_indices(model: nn.Module) -> list[int]:
    """The decoder layers (their indices in the whole model, also in a pipeline stage) holding a MoE block."""
    from titan_ext.models.structure import layer_stack

    return [int(name) for name, layer in layer_stack(model).named_children() if moe_blocks(layer)]


def apply_router_records(model: nn.Module, choice: MoEChoice | None,
                         cp_group: dist.ProcessGroup | None = None) -> None:
    """Keep the routers' logits of each forward of ``model`` (the whole model, or one pipeline stage) for the
    loss (``choice`` from the job plan; None: a dense model; ``cp_group``: the CP ranks, whose pieces of each
    sequence the loss counts together).

    Under PP the loss runs on the last stage, and the balancing loss pools every MoE layer: each stage before
    it adds its routers' per-token statistics (probability sums, with their gradient, and top-k counts) to
    those it received and sends them on with its hidden states (``_stage_end``); the last stage hands its
    routers' logits and the received statistics to the loss. The gradient of the loss then flows back to
    every stage's routers through the same sends, as the hidden states' does. Under sequence parallel each TP
    rank sends the whole sequences' statistics, folded onto its shard of the tokens (``_stage_end``)."""
    for handle in getattr(model, "_router_record_hooks", ()):
        handle.remove()
    RECORDS.__init__()
    RECORDS.choice, RECORDS.cp_group = choice, cp_group
    if choice is None or not choice.record_routers:
        return
    logits: list[torch.Tensor] = []
    carried: list[torch.Tensor] = []
    slots = [choice.moe_layers.index(i) for i in moe_layer_indices(model)]
    hooks = [router.register_forward_hook(functools.partial(_record, logits)) for router in routers(model)]
    if getattr(model, "takes_hidden_states", False):  # a pipeline stage after the first
        hooks.append(model.register_forward_pre_hook(functools.partial(_receive_statistics, choice, carried)))
    hooks.append(model.register_forward_hook(functools.partial(_stage_end, choice, logits, carried, slots)))
    model._router_record_hooks = hooks


def _record(logits: list[torch.Tensor], module, inputs, output) -> None:
    # A block recomputed by activation checkpointing during backward routes again: that is no new forward.
    if not compat.in_backward():
        router_logits = output[0]  # under TP a replicated DTensor (model_plans' router): the same on every TP rank
        logits.append(router_logits.to_local() if isinstance(router_logits, DTensor) else router_logits)


def _statistics_width(num_experts: int, dtype: torch.dtype) -> int:
    """Channels the carried statistics (2 x experts, float32) take beside hidden states of ``dtype``."""
    return 2 * num_experts * 4 // dtype.itemsize if dtype.itemsize < 4 else 2 * num_experts


class _Reinterpret(torch.autograd.Function):
    """The float32 statistics as the bits of a narrower hidden dtype (bf16: 2 channels each), and their
    gradient back the same way: exact, where a cast to bf16 would round the probability sums."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = x.dtype
        return x.contiguous().view(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous().view(ctx.dtype), None


def _pack(statistics: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return statistics.to(dtype) if dtype.itemsize >= 4 else _Reinterpret.apply(statistics, dtype)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return packed.float() if packed.dtype.itemsize >= 4 else _Reinterpret.apply(packed, torch.float32)


def _sequence_shards(module) -> int:
    """Under sequence parallel a stage's hidden states cross stages as this TP rank's sequence shard, one of
    this many (``TitanCausalLM.residual_layout``); 1 without."""
    layout = getattr(module, "residual_layout", None)
    return layout[0].size() if layout is not None else 1


def _receive_statistics(choice: MoEChoice, carried: list, module, args):
    """A later stage's input: the previous stage's hidden states, then its statistics' channels (under sequence
    parallel every TP rank's whole sequences' statistics, folded onto its shard of the tokens: ``_stage_end``)."""
    packed = args[0]
    shards = _sequence_shards(module)
    width = shards * _statistics_width(choice.num_experts, packed.dtype)
    batch, tokens = packed.shape[:2]
    carried.append(_unpack(packed[..., -width:]).reshape(batch, tokens * shards, 2 * choice.num_experts))
    return (packed[..., :-width].contiguous(), *args[1:])


def _stage_end(choice: MoEChoice, logits: list, carried: list, slots: list[int], module, args, output):
    """The last part hands its routers' logits (and what it received) to the loss; an earlier stage sends its
    statistics on beside its hidden states."""
    own, received = logits[:], carried.pop() if carried else None
    logits.clear()
    if module.get_output_embeddings() is not None:  # the model's last part: the loss follows
        if RECORDS.live:
            RECORDS.pending.append((own, received, slots))
        return output
    (batch, tokens), shards = output.shape[:2], _sequence_shards(module)
    statistics, counts = routed_statistics(own, choice.num_experts, choice.top_k, (batch, tokens * shards),
                                           output.device)
    if received is not None:
        statistics = statistics + received
    if torch.is_grad_enabled() and RECORDS.live:  # training, not validation: this step's metrics (the routing counts)
        zero = counts.new_zeros(())
        RECORDS.add_step(zero, zero, counts, slots)
    # Under sequence parallel each TP rank sends its shard of the tokens [B, T/tp, D], and the statistics of the
    # whole sequences [B, T, 2E] (the routers saw them gathered; the loss on every TP rank needs them whole, as
    # without PP), folded into as many channels per sent token: [B, T/tp, tp x 2E].
    folded = statistics.reshape(batch, tokens, shards * statistics.shape[-1])
    return torch.cat([output, _pack(folded, output.dtype)], dim=-1)


def routed_statistics(router_logits: list[torch.Tensor], num_experts: int, top_k: int, shape, device) -> tuple:
    """(per token ``[*shape, 2 * experts]``: the router probabilities summed over ``router_logits``' layers,
    then their top-k assignments counted; per layer ``[layers, experts]``: the tokens routed to each expert).
    Only the probabilities carry a gradient."""
    probs_sum, chosen_sum, counts = 0, 0, []  # one layer at a time: no [layers, tokens, E] tensor
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1).view(*shape, num_experts)
        probs_sum = probs_sum + probs
        with torch.no_grad():
            chosen = torch.zeros_like(probs).scatter_(-1, probs.topk(top_k, dim=-1).indices, 1.0)
            chosen_sum = chosen_sum + chosen
            counts.append(chosen.flatten(0, -2).sum(0))
    if not router_logits:  # a pipeline stage without MoE layers
        return torch.zeros(*shape, 2 * num_experts, device=device), torch.zeros(0, num_experts, device=device)
    return torch.cat([probs_sum, chosen_sum], dim=-1), torch.stack(counts)


def balance_loss_sum(router_logits: list[torch.Tensor], labels: torch.Tensor, num_experts: int, top_k: int,
                     cp_group: dist.ProcessGroup | None = None, layers: int | None = None,
                     carried: torch.Tensor | None = None):
    """(sum over sequences of valid tokens x the model's balancing loss of that sequence, per-(layer, expert)
    routed-token counts of ``router_logits``), of this rank's tokens.

    ``router_logits``: per MoE layer ``[batch * seq, experts]``; ``labels``: ``[batch, seq]``. Per sequence,
    ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k assignments to expert e and ``P_e`` the mean
    router probability, both over the sequence's valid tokens and all ``layers`` MoE layers (default: those
    of ``router_logits``; under PP the earlier stages' come as ``carried``, ``routed_statistics`` summed).
    Under CP (``cp_group``) ``labels`` hold this rank's pieces of the sequences: ``f_e`` and the valid tokens
    are summed over the CP ranks, and the result is this rank's tokens' part of the loss (the parts add up to
    it, and so do their gradients: the loss is linear in the probabilities).
    """
    batch, seq = labels.shape
    valid = (labels != IGNORE_INDEX).to(torch.float32)  # [B, S]
    layers = layers or len(router_logits)
    statistics, counts = routed_statistics(router_logits, num_experts, top_k, (batch, seq), labels.device)
    if carried is not None:
        statistics = statistics.to(carried.device) + carried
    probs_sum, chosen = statistics.split(num_experts, dim=-1)
    assigned = (chosen.detach() * valid[..., None]).sum(1)  # valid top-k assignments per sequence
    sequence = torch.cat([assigned, valid.sum(-1, keepdim=True)], dim=-1)  # [B, E + 1]: no gradient
    if cp_group is not None:
        dist.all_reduce(sequence, group=cp_group)  # the whole sequences' assignments and valid tokens
    assigned, tokens = sequence.split([num_experts, 1], dim=-1)
    share = assigned / (layers * tokens.clamp_min(1))  # [B, E]
    loss = num_experts * (valid[..., None] * share[:, None, :] * probs_sum / layers).sum()
    return loss, counts


def with_balance_loss(build_loss_fn):
    """Wrap a train spec's ``build_loss_fn``: the built loss adds ``router_aux_loss_coef`` x the balancing
    term (a per-token sum, as the cross entropy is) of the model's forward before it."""

    @functools.wraps(build_loss_fn)
    def build(job_config, **kwargs):
        loss_fn = build_loss_fn(job_config, **kwargs)

        def loss_with_balance(pred, labels):
            loss = loss_fn(pred, labels)
            taken, choice = RECORDS.take(), RECORDS.choice
            if taken is None or choice is None:
                return loss
            logits, carried, slots = taken
            balance, counts = balance_loss_sum(logits, labels, choice.num_experts, choice.top_k, RECORDS.cp_group,
                                               len(choice.moe_layers), carried)
            if torch.is_grad_enabled():  # training, not validation: this step's metrics
                RECORDS.add_step(balance, (labels != IGNORE_INDEX).sum(), counts, slots)
            if not choice.aux_loss_coef:
                return loss
            balance = choice.aux_loss_coef * balance.to(loss.dtype)
            if isinstance(loss, DTensor):  # loss parallel: a replicated loss, as the balancing term is on each TP rank
                balance = DTensor.from_local(balance, loss.device_mesh, loss.placements, run_check=False)
            return loss + balance

        return loss_with_balance

    return build


# ---------------------------------------------------------------- metrics


def step_metrics(group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The balancing loss (per valid token, over the global batch) and tokens per expert (max and mean over MoE
    layers and experts) of the steps since the last log, summed over the ranks of ``group`` (the batch's) and
    of ``pp_group`` (the pipeline's: each stage counts its own MoE layers, the last one the loss)."""
    stats = RECORDS.stats
    if RECORDS.choice is None or stats is None:
        return {}
    for ranks in (group, pp_group):
        if ranks is not None and dist.is_initialized():
            dist.all_reduce(stats, group=ranks)
    RECORDS.reset_step()
    stats = stats.cpu()
    counts = stats[2:]
    balance = {} if RECORDS.choice.balance == "bias" else {"moe/aux_loss": (stats[0] / stats[1].clamp_min(1)).item()}
    return {
        **balance,
        "moe/tokens_per_expert_max": counts.max().item(),
        "moe/tokens_per_expert_mean": counts.mean().item(),
    }
