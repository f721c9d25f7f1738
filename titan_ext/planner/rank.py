"""One rank of an N-rank job, built and stepped in this process on a fake process group."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
import time
import types
import weakref
from collections import Counter
from dataclasses import dataclass, replace
from unittest import mock

import torch

from titan_ext import compat
from titan_ext.errors import ConfigError
from titan_ext.job_plan import plan_of
from titan_ext.planner import collectives, estimates, experts, host_patches, memory


@dataclass(frozen=True)
class RankPlan:
    rank: int
    stages: tuple[int, ...]
    """The pipeline stages this rank runs (empty without PP)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    """Activations: bytes autograd saved for backward in one forward (parameters excepted; under AC, what the
    checkpointed blocks keep)."""
    peak_bytes: int
    """The most bytes the step's own tensors held at once (``memory.StepPeak``): the saved activations with
    backward's transients, FSDP's gathered weights, the collectives' buffers, and the gradients from where
    backward allocates each (``memory.step_peak_bytes``)."""
    collectives: tuple[collectives.Collective, ...]
    plan: object
    """titan_ext's ``JobPlan`` for the job."""
    parallel_dims: object
    microbatch: tuple | None = None
    """A pipelined rank stepped to be extrapolated (``plan_layout``): what one of its middle microbatches
    saved and issued, the step's peak at m microbatches (``_Microbatches.middle``: the largest of (bytes,
    growth per further microbatch) pairs, and one such that must stay below it, or None), whether that
    rule holds (False where the peak comes while they run, they keep tensors, and the step shows no repeating
    period: the layout is then stepped in full), and the microbatches it was stepped with (the bytes and
    collectives above are at that count)."""

    @property
    def total_bytes(self) -> int:
        """What the rank needs: the state it holds across steps, and the step's peak on top (which holds the
        gradients: all of them at its end, where the optimizer steps)."""
        return self.param_bytes + self.optimizer_bytes + self.peak_bytes


class Phases:
    """Seconds spent per phase of planning, summed over the ranks planned (the sweep's bench prints them)."""

    def __init__(self):
        self.seconds: Counter[str] = Counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        begin = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] += time.monotonic() - begin


def parallel_dims_of(job_config, world: int):
    from torchtitan.distributed import ParallelDims

    p = job_config.parallelism
    return ParallelDims(
        dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world,
    )


@contextlib.contextmanager
def fake_group(world: int, rank: int):
    """A fake process group standing in for ``rank`` of ``world``; torchrun's variables to match."""
    import torch.distributed as dist

    fake = compat.fake_process_group()
    env = {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    # torch's init_process_group wraps sys.excepthook to prefix "[rankN]: " to a traceback's lines; a sweep
    # inits hundreds of groups in one process, so the wrappers stacked up on its error's every line
    with mock.patch.dict(os.environ, env), mock.patch.object(sys, "excepthook", sys.excepthook):
        compat.clear_dtensor_caches()  # meshes of whatever ran before in this process (a layout clears its own)
        dist.init_process_group("fake", store=fake.FakeStore(), rank=rank, world_size=world)
        try:
            with host_patches.scoped((host_patches.FAKE_GROUPS_OF_OTHER_RANKS,)):
                yield
        finally:
            dist.destroy_process_group()
            compat.clear_dtensor_caches()  # and this layout's meshes, kept by DTensor's caches


class StagesSeen:
    """The pipeline stages of one layout planned so far, at one microbatch count (``plan_layout`` plans its
    ranks in pipeline order): the shapes each sent its next stage in the first step's setup, which is what
    that stage's rank receives in a real run (so a later rank builds no other rank's stages to learn its
    input), each stepped interior stage's plan by its structure and input (``_twin_key``), and the job's
    checks, plan and whole meta model, the same for every rank (each copies its stages out of the model)."""

    def __init__(self):
        self.built: tuple | None = None
        """(the job config, its model args, their JobPlan, the whole model on the meta device), from the layout's
        first rank."""
        self.sent: dict = {}
        """stage index -> the ``_StageForwardMeta`` it sent the next stage."""
        self.stepped: list = []
        """(twin key, the RankPlan stepped for it, what its stage sent)."""


def plan_rank(job_config, world: int, rank: int = 0, phases: Phases | None = None,
              seen: StagesSeen | None = None, attribute: bool = False, microbatches: int | None = None) -> RankPlan:
    """Build ``rank``'s model parts as torchtitan's Trainer does (train spec, converters, parallelize or
    pipeline), then run one step's forward and backward and the optimizer step on fake tensors.

    ``seen``: the earlier ranks of the same layout (a pipelined layout's). A rank whose one stage is an
    interior twin of a stage stepped before (``_twin_key``) is built but not stepped: its plan is the twin's.
    ``attribute``: a pipelined rank's plan also holds what one middle microbatch saved and issued, and its
    step's peak as a rule of m (``_NotAffine`` where there is none: the layout is stepped in full).
    ``microbatches``: a pipelined rank's schedule stepped with these, fewer than the job's (``_stage_microbatches``).

    A config titan_ext refuses raises its ``ConfigError`` (before anything is built)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.protocols import train_spec as registry
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils

    phase = phases or Phases()
    with fake_group(world, rank), _schedules_as_on_a_real_group():
        with phase("build"):
            dims = parallel_dims_of(job_config, world)
            dims.build_mesh()
            spec = registry.get_train_spec(job_config.model.name)
            model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
            if seen is not None and seen.built and seen.built[0] is job_config:
                model_args, plan, model = seen.built[1:]  # an earlier rank's: pipelined ranks copy their stages out
            else:
                plan = _job_plan(job_config, dims, model_args)
                with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
                    model = spec.model_cls(model_args)
                build_model_converters(job_config, dims).convert(model)
                if seen is not None and dims.pp_enabled:
                    seen.built = (job_config, model_args, plan, model)
            loss_fn = _raising(spec.build_loss_fn)(job_config, parallel_dims=dims)
        device = torch.device("cpu")
        parallelize = _raising(spec.parallelize_fn)
        with phase("parallelize"):
            if dims.pp_enabled:
                schedule, parts, first, last = _raising(spec.pipelining_fn)(
                    model, dims, job_config, device, model_args, parallelize, loss_fn
                )
                if microbatches is not None:
                    compat.set_pipeline_microbatches(schedule._schedule, microbatches)
            else:
                schedule, parts, first, last = None, [parallelize(model, dims, job_config)], True, True
            param_bytes = memory.param_bytes(parts)
            seen = seen if seen is not None else StagesSeen()
            stages = tuple(plan.pp.stage_indices(dims.get_mesh("pp").get_local_rank())) if plan.pp else ()
            key = _twin_key(plan, schedule, parts, seen) if dims.pp_enabled else None
            twin = next(((planned, sent) for k, planned, sent in seen.stepped if k == key), None) if key else None
            if twin is None and key is not None:
                twin = _deeper_twin(key, seen)
            if twin is not None:
                seen.sent[stages[0]] = twin[1]
                return replace(twin[0], rank=rank, stages=stages, parallel_dims=dims)
            neighbours = _other_stages(model, plan.pp, dims, job_config, parallelize, seen) if dims.pp_enabled else {}
        with _fake_tensors(), \
                (_ScalarsReadOne() if dims.pp_enabled else contextlib.nullcontext()):
            with phase("parallelize"):
                for part in [*parts, *neighbours.values()]:
                    part.to_empty(device=device)
                    part.train()
                optimizers = spec.build_optimizers_fn(parts, job_config.optimizer, dims)
                step = _step_runner(job_config, dims, parts, schedule, first, last, loss_fn, model_args, device,
                                    microbatches)
            recorder = collectives.Recorder(collectives.group_labels(dims))
            saved, peak = _SavedBytes(), memory.StepPeak()
            microbatches = (_Microbatches(schedule, recorder, saved, peak, step.tokens.shape[0])
                            if dims.pp_enabled and attribute else None)
            if dims.pp_enabled:
                _stages_told_by_the_planner(schedule, neighbours, step.tokens[:, : step.tokens.shape[1] // dims.cp],
                                            seen.sent)
                _first_step_setup_unrecorded(schedule, (recorder, saved, peak), phase)
            with phase("recorded step"), _whole_windows(), _documents_as_whole_rows(), experts.evenly_routed([*parts, *neighbours.values()]), \
                    peak, recorder, saved, microbatches or contextlib.nullcontext():
                step()
            recorded, saved_bytes = tuple(recorder.log), saved.bytes
            passes = estimates.accumulation_steps(job_config, dims)
            peak_bytes = memory.step_peak_bytes(peak, parts, passes)
            middle = (*microbatches.middle(memory.held_through(parts, passes)), microbatches.count) if microbatches else None
            if middle is not None and not middle[3]:
                raise _NotAffine("the step's peak comes while the middle microbatches run, and they keep tensors")
            with phase("optimizer"):
                grad_bytes = memory.grad_bytes(parts)
                with _UpdatesSkipped():
                    optimizers.step()
                optimizer_bytes = memory.optimizer_bytes(optimizers)
        planned = RankPlan(rank, stages, param_bytes, grad_bytes, optimizer_bytes, saved_bytes, peak_bytes, recorded,
                           plan, dims, middle)
        if key is not None:
            seen.stepped.append((key, planned, seen.sent.get(stages[0])))
        return planned


def _job_plan(job_config, dims, model_args=None):
    """What torchtitan calls: the HF config, then titan_ext's checks and plan (carried by the args)."""
    from torchtitan.protocols import train_spec as registry

    if model_args is None:  # a copy: the flavor's registered args stay as the train spec has them for later jobs
        model_args = copy.deepcopy(registry.get_train_spec(job_config.model.name).model_args[job_config.model.flavor])
    _raising(type(model_args).update_from_config)(model_args, job_config)
    plan = plan_of(model_args)
    if dims.pp_enabled and torch.__version__ < PIPELINE_TORCH:
        raise ConfigError(
            f"planning --parallelism.pipeline_parallel_degree={dims.pp} needs torch >= {PIPELINE_TORCH} (torch "
            f"{torch.__version__}'s pipeline stages lack the shape metadata the planner hands them); plan the "
            "layout on a newer torch, or without PP"
        )
    return plan


PIPELINE_TORCH = "2.13"
"""The first torch whose pipeline stages take the metadata the planner hands them (``compat.pipeline_metadata``)."""


def _other_stages(model, choice, dims, job_config, parallelize, seen: StagesSeen) -> dict:
    """The stages before this rank's last one that other ranks run, built as they build them: a stage
    on another rank tells this one its output's shape and dtype in the first step (torch's handshake).
    None are built where every stage this rank hears from was planned before it (``seen.sent``: what it sent)."""
    from titan_ext.parallel.pipeline import stage_model

    local = set(choice.stage_indices(dims.get_mesh("pp").get_local_rank()))
    if all(index - 1 in local or index - 1 in seen.sent for index in local if index > 0):
        return {}
    return {index: parallelize(stage_model(model, choice.stages[index]), dims, job_config)
            for index in range(max(local)) if index not in local}


def _twin_key(plan, schedule, parts, seen: StagesSeen):
    """What makes two pipeline ranks' plans equal, or None where the planner steps the rank whatever came
    before: one interior stage (not the first, which embeds, nor the last, which computes the loss) of a
    schedule of one stage per rank; the same input (what the previous stage sent: known, as the ranks are
    planned in order) and the same modules (``_structure``: classes, settings, parameters, local bytes).
    Such a stage runs the same forwards and backwards as its twin, only their order differs with its place
    in 1F1B's warm-up, which changes no count where FSDP keeps the blocks gathered across the step's
    microbatches (its default under PP). Where it reshards after each forward, when it gathers again
    follows that order: no stage is taken for another's there (each is stepped). The step's peak follows
    the order too (how many microbatches' activations are held at once): twins also run the same order,
    GPipe's (every forward, then every backward) or 1F1B's as many warm-up forwards (``min(m, stages -
    index)``: never, as titan_ext's checks ask 1F1B for m >= stages), any other schedule's never."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    inner = schedule._schedule
    stages = _stages_of(inner)
    resharded = plan.data_parallel is not None and (plan.data_parallel.reshard_blocks or plan.data_parallel.reshard_head)
    if len(stages) != 1 or stages[0].is_first or stages[0].is_last or resharded:
        return None
    received = seen.sent.get(stages[0].stage_index - 1)
    if isinstance(inner, ScheduleGPipe):
        order = "all forwards, all backwards"
    elif isinstance(inner, Schedule1F1B):
        order = min(inner._n_microbatches, inner._num_stages - stages[0].stage_index)
    else:
        order = stages[0].stage_index
    return None if received is None else (received, order, _structure(parts[0]))


def _stages_of(schedule) -> list:
    """The stages a torch pipeline schedule runs on this rank (a multi-stage schedule's, or a single stage's)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def _deeper_twin(key, seen: StagesSeen):
    """An interior 1F1B stage whose twins differ only in their warm-up depth (``_twin_key``'s order): two
    stepped before at depths a and b that hold, save and issue the same, differing only in the step's peak,
    give this one's: the peak comes in the steady phase, with as many microbatches' activations in flight
    as the depth, so each further microbatch of depth adds the same. ``tests/test_plan.py`` plans 8 stages
    both ways. None where there are not two such, or they differ otherwise."""
    received, depth, structure = key
    found = [(k[1], planned, sent) for k, planned, sent in seen.stepped
             if isinstance(k[1], int) and (k[0], k[2]) == (received, structure)]
    if not isinstance(depth, int) or len(found) < 2:
        return None
    (a, one, sent), (b, other, _) = found[-2:]
    same = ("param_bytes", "grad_bytes", "optimizer_bytes")
    if a == b or any(getattr(one, name) != getattr(other, name) for name in same):
        return None
    if one.microbatch is None or other.microbatch is None:
        peaks = _by_depth(one.peak_bytes, other.peak_bytes, a - b, depth - a)
        if one.microbatch != other.microbatch or peaks is None or one.saved_bytes != other.saved_bytes \
                or Counter(one.collectives) != Counter(other.collectives):  # in the order of each one's warm-up
            return None
        return replace(one, peak_bytes=peaks), sent
    # each stepped with its own microbatches (``_stage_microbatches``): compared, and its peak's rule moved by
    # depth, at none (a middle microbatch's share taken off each count)
    if one.microbatch[::3] != other.microbatch[::3] or Counter(one.microbatch[1]) != Counter(other.microbatch[1]) \
            or _at_microbatches(one, 0) != _at_microbatches(other, 0):
        return None
    (rule, below), (rule_b, below_b) = one.microbatch[2], other.microbatch[2]
    pairs = [*zip(rule, rule_b), *([(below, below_b)] if below and below_b else [])]
    if len(rule) != len(rule_b) or (below is None) != (below_b is None) or any(x[1] != y[1] for x, y in pairs):
        return None  # the peak's rule (``_Microbatches.middle``): each of its bytes by depth
    count, count_b = one.microbatch[4], other.microbatch[4]
    deeper = [_by_depth(x[0] - count * x[1], y[0] - count_b * y[1], a - b, depth - a) for x, y in pairs]
    if None in deeper:
        return None
    moved = [(nbytes + count * x[1], x[1]) for nbytes, (x, _) in zip(deeper, pairs)]  # at ``one``'s count
    rule = (tuple(moved[: len(rule)]), moved[len(rule)] if below else None)
    microbatch = (*one.microbatch[:2], rule, *one.microbatch[3:])
    return replace(one, peak_bytes=max(nbytes for nbytes, _ in rule[0]), microbatch=microbatch), sent


def _at_microbatches(stepped: RankPlan, m: int) -> tuple[int, Counter]:
    """A stepped rank's saved bytes and each collective's count at m microbatches: a middle microbatch's for
    each one more (or fewer) than it was stepped with. At m = 0 what ranks stepped with other counts compare by."""
    saved, issued, _, _, count = stepped.microbatch
    counts = Counter(stepped.collectives)
    for collective, n in Counter(issued).items():
        counts[collective] += (m - count) * n
    return stepped.saved_bytes + (m - count) * saved, counts


def _by_depth(one: int, other: int, apart: int, further: int) -> int | None:
    """``one`` moved ``further`` depths on, by what a depth added from ``other`` (``apart`` depths before); None
    where that is no whole number of bytes."""
    step, rest = divmod(one - other, apart)
    return None if rest else one + further * step


def _structure(module: torch.nn.Module) -> tuple:
    """A module tree without its names: each module's class and settings, and its own parameters' and
    buffers' shapes, dtypes, placements and local bytes (a pipeline stage's blocks are named by their index
    in the whole model)."""
    from torch.distributed.tensor import DTensor

    def tensors(items):
        return tuple((type(t).__name__, tuple(t.shape), t.dtype, str(t.placements) if isinstance(t, DTensor) else "",
                      memory.local_bytes(t), t.requires_grad) for _, t in items if t is not None)

    return tuple((type(m).__qualname__, m.extra_repr(), tensors(m.named_parameters(recurse=False)),
                  tensors(m.named_buffers(recurse=False))) for m in module.modules())


@contextlib.contextmanager
def _fake_tensors():
    """A planned rank's FakeTensorMode, its cache keyed the planner's faster way (``host_patches.FAKE_CACHE_KEYS``),
    and the mode of the watchers entered inside it (``collectives.watched_fake_tensors``)."""
    with host_patches.scoped((host_patches.FAKE_CACHE_KEYS,)), \
            collectives.watched_fake_tensors(allow_non_fake_inputs=True):
        yield


@contextlib.contextmanager
def _schedules_as_on_a_real_group():
    """torch's schedules module reads the fake group as gloo while a rank is planned
    (``host_patches.SCHEDULES_ON_A_FAKE_GROUP``)."""
    with host_patches.scoped((host_patches.SCHEDULES_ON_A_FAKE_GROUP,)):
        yield


@contextlib.contextmanager
def _whole_windows():
    """The fake batch holds whole windows, no packed documents (``host_patches.WHOLE_WINDOWS``)."""
    try:
        compat.transformers_masking_module()
    except compat.CompatError:  # no transformers model to plan
        yield
        return
    with host_patches.scoped((host_patches.WHOLE_WINDOWS,)):
        yield


@contextlib.contextmanager
def _documents_as_whole_rows():
    """Masked attention under CP (``kernels.cp_attention.per_document_sdpa``: document masking, a sliding window)
    chooses its SDPA calls from the step's global positions and documents, which fake tensors do not hold. The
    fake batch holds whole windows: each row is planned as one document at the positions of this rank's pieces
    (``state_passing.piece_order``), the calls a real step of whole windows makes."""
    from titan_ext.kernels import cp_attention
    from titan_ext.kernels.state_passing import piece_order

    attend = cp_attention.per_document_sdpa

    def planned(query, keys, values, layout, scale=None, window=None, dropout=0.0):
        size = query.shape[2] // layout.per_rank
        pieces = piece_order(layout.rank, layout.world, layout.per_rank)
        positions = [g for piece in pieces for g in range(piece * size, (piece + 1) * size)]
        rows = types.SimpleNamespace(positions=_Rows([positions] * query.shape[0]),
                                     document_positions=_Rows([list(range(keys.shape[2]))] * query.shape[0]))
        return attend(query, keys, values, rows, scale, window, dropout)

    with mock.patch.object(cp_attention, "per_document_sdpa", planned):
        yield


class _Rows(list):
    """Rows of positions read as ``per_document_sdpa`` reads a tensor's (``.tolist()``)."""

    def tolist(self) -> list:
        return list(self)


def _stages_told_by_the_planner(schedule, neighbours: dict, first_input: torch.Tensor, sent: dict) -> None:
    """torch's schedule sets its stages up in its first step by messages between the ranks: a vote (whose
    result it reads with ``.item()``) on whether every stage was given its shapes, then each stage's output
    shapes and dtypes sent on as pickled objects, and its input gradients' sent back. On the fake group
    nothing arrives, so the planner answers for the other ranks: the vote as real runs decide it (no stage
    given shapes: inferred), a stage's input as the previous stages compute it from the microbatch
    (``neighbours`` and this rank's own; ``first_input``: the step's tokens as the first stage gets them, its
    piece of the sequence under CP), and its output gradients as the outputs' shapes and dtypes. A stage
    planned before this rank (``sent``: stage -> what it sent on) answers for itself, and this rank's stages
    add what they send. Only a first step needs this, and the planner runs one (``_first_step_setup_unrecorded``)."""
    meta = compat.pipeline_metadata()
    inner = schedule._schedule
    stages = _stages_of(inner)
    modules = {**neighbours, **{stage.stage_index: stage.submod for stage in stages}}
    microbatch: dict = {}

    def step_microbatches(*args, _original=inner._step_microbatches, **kwargs):
        arg_mbs, kwarg_mbs = (list(args) + [kwargs.get("arg_mbs"), kwargs.get("kwarg_mbs")])[:2]
        # the first stage's microbatch: given to this rank's schedule only where it runs that stage
        own = arg_mbs[0] if arg_mbs and arg_mbs[0] else None
        microbatch.update(args=own or first_input[: len(first_input) // inner._n_microbatches],
                          kwargs=(kwarg_mbs or [{}])[0] or {})
        return _original(*args, **kwargs)

    def vote(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = meta.InferenceMode.DYNAMIC

    def received(stage, source: int):
        if source > stage.stage_index:  # the next stage's input gradients: as this stage's outputs
            return meta._StageBackwardMeta(backward_metas=meta._derive_grad_metas(stage._stage_meta.outputs))
        if source in sent:
            return sent[source]
        hidden = microbatch["args"]
        with torch.no_grad():
            for index in range(source + 1):
                hidden = modules[index](*(hidden if isinstance(hidden, tuple) else (hidden,)), **microbatch["kwargs"])
        hidden = hidden if isinstance(hidden, tuple) else (hidden,)
        outputs = tuple(h.requires_grad_() for h in hidden)  # as the stage's forward leaves them
        return meta._StageForwardMeta(forward_metas=meta.extract_tensor_metas(outputs))

    inner._step_microbatches = step_microbatches
    inner._warmup_p2p = vote
    schedule._warm_up = False  # titan_ext's gloo warm-up step (TokenMeanSchedule): values do not matter here
    for stage in stages:
        stage._send_meta = lambda meta_, destination, stage=stage: (
            sent.__setitem__(stage.stage_index, meta_) if destination > stage.stage_index else None)
        stage._recv_meta = lambda source, stage=stage: received(stage, source)


def _first_step_setup_unrecorded(schedule, recorders, phase: Phases) -> None:
    """The one step the planner runs under PP is a first step: before its microbatches the schedule sets its
    stages up (the metadata inference's forward of one microbatch, and the other stages' forwards the planner
    answers their messages with; its backward is left out where ``_input_gradients_derived`` applies), and
    titan_ext's schedule first gives every copy of a tied weight the first stage's values. A real run does both
    in its first step only: neither is recorded, so the recorded step is what every later step of a real run
    issues and saves (``tests/test_plan.py``'s real runs: step 2)."""
    inner = schedule._schedule
    stages = _stages_of(inner)

    def initialize(*args, _original=inner._initialize_pp_stages, **kwargs):
        with phase("pp stage setup"), contextlib.ExitStack() as stack:
            for recorder in recorders:
                stack.enter_context(recorder.paused())
            stack.enter_context(_input_gradients_derived(stages))
            return _original(*args, **kwargs)

    inner._initialize_pp_stages = initialize
    tied = getattr(schedule, "_tied", None)
    if tied is not None and not tied.synced:
        tied.sync()


@contextlib.contextmanager
def _input_gradients_derived(stages):
    """The setup's backward (torch's ``_backward_metadata_inference``: ``autograd.grad`` of one microbatch's
    outputs for the stage's inputs) tells the previous stage its input gradients' shapes and dtypes, which for
    inputs that are plain tensors are the inputs' own (as torch's STATIC mode derives them,
    ``_derive_grad_metas``); a stage reads them again only for an input its backward leaves without a gradient
    (it sends zeros). So each stage answers "no input gradients" (torch then derives them from the inputs),
    and its FSDP modules end the iteration as that backward's final callback would have
    (``FSDPModule.reset_iter_state``: resharded, the forward order that FSDP's backward prefetching reads
    cleared): it computes no parameter's gradient, and leaves nothing else for the step after it. One
    microbatch's backward less per pipelined rank, every figure the same (``tests/test_plan.py``). Inputs
    that are DTensors get torch's backward."""
    from torch.distributed.tensor import DTensor

    def answer(outputs, inputs, grad_outputs=None, *, stage, torch_s):
        wanted = [tensor for tensor in inputs if isinstance(tensor, torch.Tensor) and tensor.requires_grad]
        if not wanted or any(isinstance(tensor, DTensor) for tensor in wanted):  # none: torch runs no backward
            return torch_s(outputs, inputs, grad_outputs)
        for module in _fsdp_roots(stage.submod):
            module.reset_iter_state()
        return tuple(None for _ in inputs)

    for stage in stages:
        torch_s = compat.stage_input_gradients(stage)
        compat.answer_stage_input_gradients(stage, functools.partial(answer, stage=stage, torch_s=torch_s))
    try:
        yield
    finally:
        for stage in stages:
            compat.answer_stage_input_gradients(stage, None)


def _fsdp_roots(module: torch.nn.Module) -> list:
    """The outermost FSDP modules in ``module``: each is the root of its FSDP modules' iteration state."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
    inside = {id(below) for m in fsdp for below in list(m.modules())[1:]}
    return [m for m in fsdp if id(m) not in inside]


class _UpdatesSkipped(compat.torch_dispatch_mode()):
    """The optimizer step with its fused update left out: on fake tensors the update computes nothing, and
    what the planner reads, the state the step creates (``Adam._init_group``: the moments and the step
    counter, before the update), is there all the same. DTensor's sharding of the fused op's tensor lists is
    most of a planned optimizer step's time."""

    SKIPPED = {torch.ops.aten._fused_adam_.default, torch.ops.aten._fused_adamw_.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return None
        return func(*args, **(kwargs or {}))


class _ScalarsReadOne(collectives.Watcher):
    """``.item()`` of a fake tensor reads 1: under PP, titan_ext's schedule reads the step's token count
    (it divides the loss, and scales no shape or collective)."""

    @staticmethod
    def _one(args):
        if getattr(args[0], "constant", None) is not None:
            return collectives.NOT_ANSWERED
        return True if args[0].dtype == torch.bool else 1.0 if args[0].is_floating_point() else 1

    answers = {torch.ops.aten._local_scalar_dense.default: _one}


def _raising(hook):
    """A train spec's hook without its ``config_boundary`` (which ends the process on a ``ConfigError``):
    the planner reports the error, and a sweep goes on to the next layout."""
    return getattr(hook, "__wrapped__", hook)


def _step_runner(job_config, dims, parts, schedule, first, last, loss_fn, model_args, device, microbatches=None):
    """torchtitan's own ``Trainer.forward_backward_step`` over these parts, on one fake batch of token 0 (of
    ``microbatches`` microbatches where given)."""
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.train import Trainer

    class Step(Trainer):
        def __init__(self, **attrs):  # only what forward_backward_step reads
            self.__dict__.update(attrs)

    trainer = Step(
        job_config=job_config, parallel_dims=dims, model_parts=parts, pp_schedule=schedule,
        pp_has_first_stage=first, pp_has_last_stage=last, loss_fn=loss_fn, model_args=model_args,
        tokenizer=None, device=device,
        train_context=dist_utils.get_train_context(dims.tp_enabled and not job_config.parallelism.disable_loss_parallel),
        maybe_enable_amp=dist_utils.maybe_enable_amp(dims, job_config.training.mixed_precision_param, device.type),
    )
    batch, seq = job_config.training.local_batch_size, job_config.training.seq_len
    if microbatches is not None:
        batch = microbatches * job_config.parallelism.pipeline_parallel_microbatch_size
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    labels = tokens.clone()  # the batch, as a real step's is, held before the step (not in its peak)

    def step():
        trainer.forward_backward_step(input_dict={"input": tokens}, labels=labels,
                                      global_valid_tokens=torch.tensor(float(tokens.numel())))

    step.tokens = tokens
    return step


class _SavedBytes(collectives.Pausable):
    """Bytes of the tensors autograd saves for backward, each once, parameters (and views of them: FSDP's
    gathered weights) excepted. Under AC this is what the checkpointed blocks keep: torch's checkpoint
    saves their inputs through autograd too (its ``_NoopSaveInputs``)."""

    def __init__(self):
        self.bytes, self._seen = 0, weakref.WeakValueDictionary()
        """id -> the tensor while it lives: a later tensor that takes a freed one's id is counted (under PP
        each microbatch's are freed at its backward while later ones are saved), and holding none keeps the
        step's peak (``memory.StepPeak``) as a real step's."""
        self._paused = False
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        base = tensor._base if tensor._is_view() else tensor
        if not self._paused and id(tensor) not in self._seen and not isinstance(base, torch.nn.Parameter):
            self._seen[id(tensor)] = tensor
            self.bytes += memory.local_bytes(tensor)
            self.counted(memory.local_bytes(tensor))
        return tensor

    def counted(self, nbytes: int) -> None:
        """Told of each tensor's bytes as they are counted (``_Microbatches`` attributes them)."""

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


_STEPPED: list["_Microbatches"] = []
"""The pipelined ranks being stepped (innermost last), told of the schedule's sends (``schedule_p2p``)."""


def schedule_p2p(original, ops, *args, **kwargs):
    """torch's ``_batch_p2p`` while the planner steps a pipelined rank (``host_patches.SCHEDULE_SENDS``)."""
    if not _STEPPED:
        return original(ops, *args, **kwargs)
    return _STEPPED[-1].p2p(original, ops, *args, **kwargs)


class _Microbatches:
    """Which microbatch each collective a pipelined rank's step issues, and each byte it saves, belongs to:
    those issued or saved while the stage runs a microbatch's forward, loss or backward, and its sends and
    receives (each P2P op is made for one microbatch); the rest (the step's own: token counts, tied weights)
    to none. ``middle()``: what a microbatch between the first and the last saved and issued, the same for
    each such (checked) or ``_NotAffine``."""

    def __init__(self, schedule, recorder, saved, peak: memory.StepPeak, batch: int):
        self.current, self.tags, self.saved, self.unattributed, self.batch = None, [], Counter(), 0, batch
        self.started = False
        self.log, self._recorder, self._p2p, self._peak = recorder.log, recorder, None, peak
        peak.tag_of, peak.inherited = self._tag, lambda tag: tag != "batch"  # a sum of the batch is no batch
        record = recorder._record

        def tagged(*args, **kwargs):
            record(*args, **kwargs)
            self.tags.append(self.current)

        recorder._record = tagged
        saved.counted = lambda nbytes: self.saved.update({self.current: nbytes})
        inner = schedule._schedule
        self.count = inner._n_microbatches
        self.stages = _stages_of(inner)
        self.ops: list[tuple[int, str, int]] = []
        """(the step's peak's event count as a forward or backward of a microbatch starts, "F" or "B", the microbatch)."""
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._during(getattr(stage, name), 0, name[0].upper()))
            for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
                setattr(stage, name, self._stamped(getattr(stage, name)))
        inner._maybe_compute_loss = self._during(inner._maybe_compute_loss, 3)
        self.finished = -1
        """The last of the step's peak's events once every microbatch is done (the schedule's sends waited for)."""

        def step_microbatches(*args, _original=inner._step_microbatches, **kwargs):
            out = _original(*args, **kwargs)
            self.finished = len(peak.events) - 1
            return out

        inner._step_microbatches = step_microbatches

    def _tag(self, tensor: torch.Tensor):
        """The step's peak's tag of a tensor: its microbatch's, or before the first "batch" for one of the whole
        batch (its first dimension the batch's: under CP the batch's piece of the sequence), a microbatch's
        share each."""
        if (self.current is None and not self.started and tensor.dim() and tensor.shape[0] == self.batch
                and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()):  # not an expanded one
            return "batch"
        return self.current

    @contextlib.contextmanager
    def _for(self, microbatch):
        """What is allocated, saved and issued inside belongs to ``microbatch``."""
        outer, self.current = self.current, microbatch
        try:
            yield
        finally:
            self.current = outer

    def _during(self, method, position: int, kind: str | None = None):
        def run(*args, **kwargs):
            if kind is not None and not self._recorder._paused:
                self.ops.append((len(self._peak.events), kind, args[position]))
            self.started = True
            with self._for(args[position]):
                return method(*args, **kwargs)

        return run

    def _stamped(self, method):
        """A stage's P2P ops for a microbatch, each stamped with it, and what making them allocates tagged with
        it: in torch 2.15 a receive's buffer is allocated as its op is made, and held by the stage after the
        microbatch (torch 2.13 allocates them all in the first step's setup)."""
        def ops(index, *args, **kwargs):
            with self._for(index):
                made = method(index, *args, **kwargs)
            for op in made:
                op.planner_microbatch = index
            return made

        return ops

    def __enter__(self):
        _STEPPED.append(self)
        self._p2p = host_patches.scoped((host_patches.SCHEDULE_SENDS,))
        self._p2p.__enter__()
        return self

    def __exit__(self, *exc):
        _STEPPED.remove(self)
        return self._p2p.__exit__(*exc)

    def p2p(self, original, ops, *args, **kwargs):
        """torch's ``_batch_p2p``, each send and receive it posts tagged with its microbatch."""
        import torch.distributed as dist

        first = len(self.log)
        works = original(ops, *args, **kwargs)
        if self._recorder._paused:  # the first step's setup
            return works
        kinds = ["send" if op.op in (dist.isend, dist.send) else "recv" for op in ops]
        if [c.kind for c in self.log[first:]] != kinds:  # not one recorded op per P2P op, in order
            self.unattributed += 1
        else:
            self.tags[first:] = [getattr(op, "planner_microbatch", None) for op in ops]
        return works

    def middle(self, kept) -> tuple:
        """(bytes saved, collectives issued, bytes added to the step's peak) for one middle microbatch.

        The step's peak at m microbatches: 1F1B keeps as many microbatches in flight whatever m, and what each
        allocates that outlives the microbatches (the losses the schedule keeps) adds up, as do the step's
        tensors of the whole batch (``_tag``): each further microbatch adds what a middle one holds once all
        are done and a microbatch's share of those, where the peak comes after the middle ones ran (what they
        keep adds up there too). A peak while they run is the same at any m where they keep nothing; where they
        keep something it is not extrapolated (``_NotAffine``: a later point may peak at more microbatches)."""
        if self.unattributed or len(self.tags) != len(self.log):
            raise _NotAffine("P2P ops not recorded one by one")
        middles = range(1, self.count - 1)
        end = self._peak.held(self.finished, kept)
        at = self._peak.peak_event(kept)
        at_peak = self._peak.held(at, kept)
        if not end.get("batch", {}).keys() <= at_peak.get("batch", {}).keys():
            raise _NotAffine("the step's peak comes before the batch's tensors")
        verified, while_they_run = True, at <= max(self._peak.last_tagged.get(index, -1) for index in middles)
        if while_they_run:  # the peak while they run, and what they keep adds up: it may peak later at more
            verified = not any(end.get(index) for index in middles)
        elif any(not end.get(index, {}).keys() <= at_peak.get(index, {}).keys() for index in middles):
            raise _NotAffine("the step's peak comes before what a middle microbatch holds after the microbatches")
        batch = sum(end.get("batch", {}).values())
        if batch % self.count:
            raise _NotAffine("the batch's tensors are not a whole number of microbatches'")
        each = {index: (self.saved[index], tuple(c for c, tag in zip(self.log, self.tags) if tag == index),
                        sum(end.get(index, {}).values()) + batch // self.count)
                for index in middles}
        if len({(nbytes, tuple(sorted(Counter(issued).items(), key=repr)), peak)
                for nbytes, issued, peak in each.values()}) != 1:
            raise _NotAffine("middle microbatches differ")
        saved, issued, held = each[1]
        gradients = sum(memory.local_bytes(g) for g in kept)  # as ``memory.step_peak_bytes`` adds them
        rule = None
        if not verified:  # the peak while they run: where the schedule repeats a period, each further one inserted
            rule = self._periods(kept, end, middles, held - batch // self.count, batch // self.count, gradients)
            verified = rule is not None
        return saved, issued, rule or (((self._peak.peak_bytes(kept) + gradients, held),), None), verified

    def _periods(self, kept, end, middles, kept_each: int, batch_each: int, gradients: int) -> tuple | None:
        """The step's peak at m microbatches as the largest of (bytes, growth per further microbatch) pairs, from
        this step alone, where 1F1B's steady phase repeats: each steady period (a forward, then a backward, up to
        the next forward or backward) allocates and frees the same bytes in the same order, and one more microbatch is one more
        period. Two consecutive periods alike (compared allocation by allocation) mark where the repeats begin
        (the first backwards allocate the gradients); a step of m microbatches is this one with m - count copies
        of that period inserted there. So an event before it holds what it held here plus the batch's tensors'
        share of each further microbatch; an event after it, also every inserted period's net bytes (what a
        microbatch keeps: checked equal to what a middle one holds when all are done), up to the first release
        of a tensor kept across the microbatches (the schedule's losses at the step's end): what comes after may
        hold less at m, never more, and must stay below (else ``_NotAffine`` when extrapolated). None where no
        two periods are alike, or several stages run on this rank.

        The last period ends where the cooldown's first backward starts: in torch 2.15 the receive for that
        backward allocates its buffer just before (``_stamped``), an allocation of that backward's microbatch
        that the periods before make inside the next period. It is alike where it is the period before it and
        then only such allocations."""
        if len(self.stages) != 1:
            return None
        events, sizes = self._peak.events, self._peak.sizes(kept)
        kinds = "".join(kind for _, kind, _ in self.ops)
        # (a period's first event, its end's, the microbatch of the forward or backward it ends at)
        periods = [(self.ops[i][0], *self.ops[i + 2][::2]) for i in range(len(kinds) - 2) if kinds[i: i + 2] == "FB"]

        def alike(a: int, b: int, d: int, ending: int) -> bool:
            if sizes[a:b] == sizes[b:d]:
                return True
            cooldown = b + (b - a)
            return (d == periods[-1][1] and sizes[a:b] == sizes[b:cooldown]
                    and all(size > 0 and self._peak.tag(number) == ending for number, size in events[cooldown:d]))

        pairs = zip(periods, periods[1:])
        insert = next((b for (a, b, _), (c, d, ending) in pairs if b == c and alike(a, b, d, ending)), None)
        if insert is None or kept_each < 0:
            return None
        start = next(a for a, b, _ in periods if b == insert)
        if sum(sizes[start:insert]) != kept_each:
            return None
        kept_across = {number for index in (*middles, "batch") for number in end.get(index, {})}
        release = next((i for i in range(insert, len(events))
                        if events[i][1] < 0 and events[i][0] in kept_across), len(events))
        before: dict[int, int] = {}  # the batch's bytes live -> the most bytes live at an event before the period
        now = batch_live = 0
        after = below = None
        for i, (number, _) in enumerate(events):
            now += sizes[i]
            if self._peak.tag(number) == "batch":
                batch_live += sizes[i]
            if i < insert:
                before[batch_live] = max(before.get(batch_live, now), now)
            elif i < release:
                after = now if after is None else max(after, now)
            else:
                below = now if below is None else max(below, now)
        if any(live % self.count for live in before) or after is None:
            return None
        rule = tuple((most + gradients, live // self.count) for live, most in sorted(before.items()))
        growth = kept_each + batch_each
        return (*rule, (after + gradients, growth)), None if below is None else (below + gradients, growth)


def plan_layout(job_config, world: int, phases: Phases | None = None, extrapolate: bool | None = None,
                reuse: bool = True, blocks: bool | None = None):
    """One RankPlan per role: rank 0, and the first rank of each further pipeline stage, planned in pipeline
    order: each rank learns its input's shapes from the stage before it, and a rank whose stage is an
    interior twin of one stepped before takes that one's plan (``_twin_key``). ``reuse=False``: each rank
    planned on its own (the other ranks' stages built, every rank stepped), for the tests.

    A pipelined rank steps every microbatch through its stages, and a fake step costs per operator whatever
    the shapes: its m microbatches cost m times one. Every microbatch has the same shapes and the schedule
    is deterministic: a microbatch between the first (which FSDP gathers the weights for) and the last
    (whose backward reduces the gradients) saves and issues what any other such does. So the rank is
    stepped with the fewest microbatches its schedule takes that have one in the middle, what each saves
    and issues recorded on its own (``_Microbatches``), and extrapolated to the job's m by adding the
    middle one's (``extrapolate=None``: where that is cheaper and the schedule is one ``tests/test_plan.py``
    verifies it for; ``False``: never; ``True``: wherever m exceeds that count, for the tests).

    ``blocks``: a model of identical blocks is planned with 2 and 3 blocks per pipeline stage and
    extrapolated to its own (``_blocks_extrapolated``; None: where that is cheaper, True: wherever it
    applies, for the tests, False: never)."""
    checked = None
    if blocks is not False:
        found, checked = _blocks_extrapolated(job_config, world, phases, extrapolate, reuse, blocks is True)
        if found is not None:
            return found
    pp = job_config.parallelism.pipeline_parallel_degree
    ranks = [stage * (world // pp) for stage in range(pp)]
    count = _stepped_microbatches(job_config, extrapolate)

    def planned(job, attribute=False):
        seen = StagesSeen()
        return [plan_rank(job, world, rank, phases, seen if reuse else None, attribute,
                          _stage_microbatches(job, stage) if attribute else None) for stage, rank in enumerate(ranks)]

    if count is None:
        return planned(job_config)
    plan = checked or _checked_plan(job_config, world)  # the job's own refusals first, and its plan (its microbatches)
    if plan.data_parallel is not None and (plan.data_parallel.reshard_blocks or plan.data_parallel.reshard_head):
        return planned(job_config)  # FSDP gathers again in the middle microbatches, as the schedule's order has it
    m = _microbatches(job_config)
    try:
        stepped = planned(_with_microbatches(job_config, count), attribute=True)
        return [_extrapolated(rank, m, plan) for rank in stepped]
    except (ConfigError, _NotAffine):  # a check the smaller batch does not pass (a global batch), or not affine
        return planned(job_config)


EXTRAPOLATED_SCHEDULES = {"1F1B", "Interleaved1F1B"}
"""The schedules whose pipelined ranks are stepped with fewer microbatches and extrapolated: those
``tests/test_plan.py`` plans both ways and finds equal, field by field."""


def _microbatches(job_config) -> int:
    return job_config.training.local_batch_size // job_config.parallelism.pipeline_parallel_microbatch_size


def _stepped_microbatches(job_config, extrapolate: bool | None) -> int | None:
    """The microbatches a pipelined rank is stepped with, or None to step the job's own: p + 1 for p ranks
    (1F1B takes a microbatch per stage, and with one more every stage runs a steady forward-backward pair,
    as it does at more: the step's peak there) and at least 3 (one between the first and the last)."""
    p = job_config.parallelism
    if extrapolate is False or p.pipeline_parallel_degree <= 1 or p.pipeline_parallel_schedule not in EXTRAPOLATED_SCHEDULES:
        return None
    if job_config.training.local_batch_size % p.pipeline_parallel_microbatch_size:
        return None  # refused by titan_ext's checks, in the full plan
    count = _fewest_microbatches(p, p.pipeline_parallel_degree)
    return count if count < _microbatches(job_config) else None


def _fewest_microbatches(p, warm_up: int) -> int:
    """What a stage that warms up with ``warm_up`` forwards is stepped with: one more, for a steady
    forward-backward pair; at least 3 (one between the first and the last); under CP ``PERIODS`` pairs."""
    count = max(3, warm_up + 1)
    if p.context_parallel_degree > 1:  # every stage keeps each microbatch's positions: the first needs the periods
        count += PERIODS - 1
    elif p.tensor_parallel_degree > 1:  # the last stage keeps the losses (its warm-up is one microbatch)
        count = max(count, PERIODS + 1)
    return count


def _stage_microbatches(job_config, stage: int) -> int | None:
    """The microbatches pipeline rank ``stage`` of a 1F1B layout stepped with ``_stepped_microbatches`` is
    stepped with: its own warm-up's fewest (1F1B's stage s warms up with p - s forwards), fewer than the first
    stage's where it is later. torch's 1F1B takes no fewer microbatches than stages (the whole pipeline's
    rule), so the schedule is built with the first stage's count and set to this one (``plan_rank``). None
    (the job's count) under other schedules."""
    p = job_config.parallelism
    if p.pipeline_parallel_schedule != "1F1B":
        return None
    return min(_microbatches(job_config), _fewest_microbatches(p, p.pipeline_parallel_degree - stage))


PERIODS = 2
"""Steady 1F1B periods a stage whose middle microbatches keep tensors while the step's peak comes mid-schedule
(under TP the last stage: the schedule's losses; under CP each stage: each microbatch's positions) is stepped
with: its peak is extrapolated from two consecutive periods alike (``_Microbatches._periods``). Two suffice: the
gradients the first backward allocates are held through the step (``memory.held_through``), left out of the
comparison; where the two differ all the same the rank is stepped in full (``tests/test_plan.py`` checks TP
and CP layouts both ways)."""


def _with_microbatches(job_config, count: int):
    small = copy.deepcopy(job_config)
    small.training.local_batch_size = count * job_config.parallelism.pipeline_parallel_microbatch_size
    if job_config.validation.local_batch_size == job_config.training.local_batch_size:
        small.validation.local_batch_size = small.training.local_batch_size
    return small


class _NotAffine(Exception):
    """A rank's middle microbatches that did not save and issue the same, or a collective not attributed."""


def _extrapolated(stepped: RankPlan, m: int, plan) -> RankPlan:
    """The rank at m microbatches from its step with fewer (its own count): the state it holds does not change with m;
    the activations (summed over the microbatches), each collective's count (by kind, group and bytes) and
    the step's peak gain a middle microbatch's for each further one (``_Microbatches.middle``). The collectives are listed in the order they first
    came, each repeated its count."""
    (rule, below), count = stepped.microbatch[2], stepped.microbatch[4]
    saved_bytes, counts = _at_microbatches(stepped, m)
    ordered = [c for c in dict.fromkeys(stepped.collectives) for _ in range(counts[c])]
    peak = max(nbytes + (m - count) * growth for nbytes, growth in rule)
    if below is not None and below[0] + (m - count) * below[1] > peak:
        raise _NotAffine("the step's peak may come after the tensors kept across the microbatches are freed")
    return replace(stepped, saved_bytes=saved_bytes, peak_bytes=peak, collectives=tuple(ordered), plan=plan,
                   microbatch=None)


def _checked_plan(job_config, world: int, model_args=None):
    """titan_ext's checks of the job, and its ``JobPlan``, as ``plan_rank`` builds them (nothing built);
    ``model_args``: the args to update (the flavor's, copied, if None)."""
    with fake_group(world, 0):
        dims = parallel_dims_of(job_config, world)
        dims.build_mesh()
        return _job_plan(job_config, dims, model_args)


BLOCK_POINTS = (2, 3)
"""Blocks per pipeline stage (or in the model, without PP) of the two smaller models a model of identical
blocks is planned with (``_blocks_extrapolated``): two, so that a stage's first block (which takes the
embedding's output) and its last (before the norm, or the next stage) are both there in each."""


def _blocks_extrapolated(job_config, world: int, phases, extrapolate, reuse, forced: bool):
    """A model whose blocks are all alike (``_blocks_alike``) planned with ``BLOCK_POINTS`` blocks per stage
    (each stage keeps its first ones, and its embedding, norm or head) and each rank's figures extrapolated to
    its stage's own count k: every block adds the same parameters, gradients, optimizer state, saved
    activations and collectives, and, where the step's peak comes after the blocks' forwards (their saved
    tensors all held), the same bytes to the peak: f(k) = f(2) + (k - 2) (f(3) - f(2)). ``tests/test_plan.py``
    plans layouts of each kind both ways and finds every field equal. None where it does not apply (a hybrid,
    AC every Nth block, several stages per rank), where it is not cheaper (unless ``forced``), or where a
    count would go negative: the layout is then planned in full. Returned with the job's checked plan (None
    without a ``[titan_ext]`` section), which the full planning reuses."""
    from torchtitan.protocols import train_spec as registry

    if getattr(getattr(job_config, "titan_ext", None), "hf_config", None) is None:
        return None, None
    model_args = copy.deepcopy(registry.get_train_spec(job_config.model.name).model_args[job_config.model.flavor])
    plan = _checked_plan(job_config, world, model_args)  # the job's own refusals first
    if not _blocks_alike(model_args, plan):
        return None, plan
    if plan.pp is None:
        counts, names = [model_args.to_hf_config().num_hidden_layers], None
    else:
        if len(plan.pp.stages) != plan.pp.degree:
            return None, plan  # several stages per rank: their counts differ
        names = [[_block_index(name) for name in stage] for stage in plan.pp.stages]
        counts = [sum(index is not None for index in stage) for stage in names]
    low, high = BLOCK_POINTS
    cost = sum(k + 1 for k in counts)  # a stage's blocks and one block's worth for its embedding, head, loss, step
    if all(k <= low for k in counts) or (not forced and sum(min(k, low) + min(k, high) + 2 for k in counts) >= cost):
        return None, plan
    import json
    import tempfile

    config = model_args.to_hf_config()
    small = []
    with tempfile.TemporaryDirectory(prefix="titan_ext_plan_") as folder:
        for point in BLOCK_POINTS:
            job = copy.deepcopy(job_config)
            fields = {"model_type": model_args.model_type, **model_args.architecture(),
                      "num_hidden_layers": sum(min(k, point) for k in counts)}
            if isinstance(getattr(config, "layer_types", None), list):
                fields["layer_types"] = config.layer_types[: fields["num_hidden_layers"]]
            path = os.path.join(folder, f"{point}.json")
            with open(path, "w") as f:
                json.dump(fields, f)
            job.titan_ext.hf_config = path
            if names is not None:
                job.parallelism.module_fqns_per_model_part = _fewer_blocks(plan.pp.stages, names, point)
            try:
                small.append(plan_layout(job, world, phases, extrapolate, reuse, blocks=False))
            except ConfigError:
                return None, plan  # a check the smaller model does not pass: planned in full
    ks = counts if plan.pp is not None else counts * len(small[0])
    out = []
    for two, three, k in zip(*small, ks):
        found = _block_line(two, three, k - low)
        if found is None:
            return None, plan
        out.append(replace(found, plan=plan))
    return out, plan


def _blocks_alike(model_args, plan) -> bool:
    """Every block the same module: one token mixer throughout, every FFN alike (no dense layers among MoE
    ones), and AC the same for each (not every Nth)."""
    config = model_args.to_hf_config()
    if model_args.structure().hybrid:
        return False
    if len(set(getattr(config, "layer_types", None) or [None])) != 1 or getattr(config, "attn", None):
        return False
    if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) > 1:
        return False
    if getattr(config, "first_k_dense_replace", 0):
        return False
    return plan.ac is None or plan.ac.every is None


def _block_index(name: str) -> int | None:
    """A stage's module FQN that names a block (``model.layers.7``): its index."""
    last = name.rsplit(".", 1)[-1]
    return int(last) if last.isdigit() else None


def _fewer_blocks(stages, indices, point: int) -> list[list[str]]:
    """The stages with their first ``point`` blocks each, renumbered in order; their other modules kept."""
    out, number = [], 0
    for stage, found in zip(stages, indices):
        kept, blocks = [], 0
        for name, index in zip(stage, found):
            if index is None:
                kept.append(name)
            elif blocks < point:
                kept.append(f"{name.rsplit('.', 1)[0]}.{number}")
                blocks, number = blocks + 1, number + 1
        out.append(kept)
    return out


def _block_line(two: RankPlan, three: RankPlan, more: int) -> RankPlan | None:
    """``two`` plus ``more`` times what a block added from ``two`` to ``three``; None where a count goes
    negative. The collectives in the order they first came, each repeated its count."""
    assert (two.rank, two.stages) == (three.rank, three.stages)
    low, high = Counter(two.collectives), Counter(three.collectives)
    counts = {c: low[c] + more * (high[c] - low[c]) for c in {*low, *high}}
    if any(n < 0 for n in counts.values()):
        return None
    ordered = [c for c in dict.fromkeys([*three.collectives, *two.collectives]) for _ in range(counts[c])]

    def line(name):
        return getattr(two, name) + more * (getattr(three, name) - getattr(two, name))

    figures = {name: line(name) for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "saved_bytes", "peak_bytes")}
    if any(v < 0 for v in figures.values()):
        return None
    return replace(two, **figures, collectives=tuple(ordered), microbatch=None)
