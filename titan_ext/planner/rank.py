"""One rank of an N-rank job, built as torchtitan's Trainer builds it and stepped once on fake tensors, in this
process, on a fake process group (``simulate_rank``)."""

from __future__ import annotations

import contextlib
import copy
import os
import time
import weakref
from collections import Counter
from dataclasses import dataclass, replace

import torch

from titan_ext import compat
from titan_ext.errors import ConfigError
from titan_ext.job_plan import job_plan_of
from titan_ext.patching import scoped
from titan_ext.planner import collectives, estimates, experts, host_patches, memory, microbatches, stages


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
    """A pipelined rank stepped to be extrapolated (``Stepping.attribute``): what one of its middle microbatches
    saved and issued, the step's peak at m microbatches (``microbatches.middle``: the largest of (bytes, growth
    per further microbatch) pairs, and one such that must stay below it, or None), whether that rule holds
    (False where the peak comes while they run, they keep tensors, and the step shows no repeating period: the
    layout is then stepped in full), and the microbatches it was stepped with (the bytes and collectives above
    are at that count)."""

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


@dataclass(frozen=True)
class Stepping:
    """How ``simulate_rank`` steps a rank, beyond the job and the rank.

    ``seen``: the earlier ranks of the same layout (a pipelined layout's): a rank whose one stage is an interior
    twin of a stage stepped before (``stages.twin_key``) is built but not stepped, its plan is the twin's.
    ``attribute``: a pipelined rank's plan also holds what one middle microbatch saved and issued, and its step's
    peak as a rule of m (``microbatches.NotAffine`` where there is none: the layout is stepped in full).
    ``microbatches``: a pipelined rank's schedule stepped with these, fewer than the job's
    (``microbatches.stage_microbatches``)."""

    phases: Phases | None = None
    seen: stages.StagesSeen | None = None
    attribute: bool = False
    microbatches: int | None = None


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
    with _environment(env), scoped((host_patches.EXCEPTHOOK_KEPT,)):
        compat.clear_dtensor_caches()  # meshes of whatever ran before in this process (a layout clears its own)
        dist.init_process_group("fake", store=fake.FakeStore(), rank=rank, world_size=world)
        try:
            with scoped((host_patches.FAKE_GROUPS_OF_OTHER_RANKS,)):
                yield
        finally:
            dist.destroy_process_group()
            compat.clear_dtensor_caches()  # and this layout's meshes, kept by DTensor's caches


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    """These environment variables for the block; each as it was after (unset where it was unset)."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class _Built:
    """A rank's job as torchtitan's Trainer builds it, before parallelizing: the train spec, the model args,
    titan_ext's plan, the whole model on the meta device (converted), and the loss."""

    spec: object
    model_args: object
    plan: object
    model: torch.nn.Module
    loss_fn: object


@dataclass(frozen=True)
class _Parts:
    """The model parts this rank runs: its pipeline schedule (None without PP), and whether it holds the first
    and the last stage."""

    schedule: object
    parts: list
    first: bool
    last: bool


def simulate_rank(job_config, world: int, rank: int = 0, how: Stepping = Stepping()) -> RankPlan:
    """Build ``rank``'s model parts as torchtitan's Trainer does (train spec, converters, parallelize or
    pipeline), then run one step's forward and backward and the optimizer step on fake tensors: what the rank
    holds and issues, read off its tensors and recorded as issued.

    A config titan_ext refuses raises its ``ConfigError`` (before anything is built)."""
    phase = how.phases or Phases()
    with fake_group(world, rank), _schedules_as_on_a_real_group():
        with phase("build"):
            dims = parallel_dims_of(job_config, world)
            dims.build_mesh()
            built = _built(job_config, dims, how.seen)
        with phase("parallelize"):
            parts = _parallelized(job_config, dims, built, how.microbatches)
            param_bytes = memory.param_bytes(parts.parts)
            seen = how.seen if how.seen is not None else stages.StagesSeen()
            indices = tuple(built.plan.pp.stage_indices(dims.get_mesh("pp").get_local_rank())) if built.plan.pp else ()
            key = stages.twin_key(built.plan, parts.schedule, parts.parts, seen) if dims.pp_enabled else None
            twin = stages.twin(key, seen)
            if twin is not None:
                seen.sent[indices[0]] = twin[1]
                return replace(twin[0], rank=rank, stages=indices, parallel_dims=dims)
            neighbours = (stages.other_stages(built.model, built.plan.pp, dims, job_config,
                                              _raising(built.spec.parallelize_fn), seen) if dims.pp_enabled else {})
        stepped = _stepped(_Ready(job_config, dims, built, parts, neighbours, seen), how, phase)
        planned = RankPlan(rank, indices, param_bytes, stepped.grad_bytes, stepped.optimizer_bytes, stepped.saved_bytes,
                           stepped.peak_bytes, stepped.collectives, built.plan, dims, stepped.microbatch)
        if key is not None:
            seen.stepped.append((key, planned, seen.sent.get(indices[0])))
        return planned


def _built(job_config, dims, seen: stages.StagesSeen | None) -> _Built:
    """The train spec's model on the meta device, converted, with titan_ext's checks and plan; a pipelined
    layout's later ranks take its first rank's (each copies its stages out of the whole model)."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.protocols import train_spec as registry
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils

    spec = registry.get_train_spec(job_config.model.name)
    model_args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    if seen is not None and seen.built and seen.built[0] is job_config:
        model_args, plan, model = seen.built[1:]
    else:
        plan = _job_plan(job_config, dims, model_args)
        with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[job_config.training.dtype]):
            model = spec.model_cls(model_args)
        build_model_converters(job_config, dims).convert(model)
        if seen is not None and dims.pp_enabled:
            seen.built = (job_config, model_args, plan, model)
    loss_fn = _raising(spec.build_loss_fn)(job_config, parallel_dims=dims)
    return _Built(spec, model_args, plan, model, loss_fn)


def _parallelized(job_config, dims, built: _Built, count: int | None) -> _Parts:
    """The train spec's pipelining (its schedule set to ``count`` microbatches where given) or parallelize."""
    parallelize = _raising(built.spec.parallelize_fn)
    if not dims.pp_enabled:
        return _Parts(None, [parallelize(built.model, dims, job_config)], True, True)
    schedule, parts, first, last = _raising(built.spec.pipelining_fn)(
        built.model, dims, job_config, torch.device("cpu"), built.model_args, parallelize, built.loss_fn
    )
    if count is not None:
        compat.set_pipeline_microbatches(schedule._schedule, count)
    return _Parts(schedule, parts, first, last)


@dataclass(frozen=True)
class _Ready:
    """A rank built and parallelized, to be stepped: its job and mesh, what was built, its parts, the other
    ranks' stages it computes its input with (``stages.other_stages``), and the layout's ranks planned before."""

    job_config: object
    dims: object
    built: _Built
    parts: _Parts
    neighbours: dict
    seen: stages.StagesSeen


@dataclass(frozen=True)
class _Stepped:
    """What one fake step of a rank measured (``RankPlan``'s fields of the same names)."""

    grad_bytes: int
    optimizer_bytes: int
    saved_bytes: int
    peak_bytes: int
    collectives: tuple
    microbatch: tuple | None


def _stepped(ready: _Ready, how: Stepping, phase: Phases) -> _Stepped:
    """The rank's parts (and the other ranks' stages it computes its input with) on fake tensors, one step
    recorded, then the optimizer's step: the state it creates."""
    job_config, dims, built, parts = ready.job_config, ready.dims, ready.built, ready.parts
    device = torch.device("cpu")
    with _fake_tensors(), (_ScalarsReadOne() if dims.pp_enabled else contextlib.nullcontext()):
        with phase("parallelize"):
            for part in [*parts.parts, *ready.neighbours.values()]:
                part.to_empty(device=device)
                part.train()
            optimizers = built.spec.build_optimizers_fn(parts.parts, job_config.optimizer, dims)
            step = _step_runner(job_config, dims, parts.parts, parts.schedule, parts.first, parts.last, built.loss_fn,
                                built.model_args, device, how.microbatches)
        recorded, saved_bytes, peak_bytes, middle = _recorded_step(ready, step, how.attribute, phase)
        with phase("optimizer"):
            grad_bytes = memory.grad_bytes(parts.parts)
            with _UpdatesSkipped():
                optimizers.step()
            optimizer_bytes = memory.optimizer_bytes(optimizers)
    return _Stepped(grad_bytes, optimizer_bytes, saved_bytes, peak_bytes, recorded, middle)


def _recorded_step(ready: _Ready, step, attribute: bool, phase: Phases) -> tuple:
    """(the collectives, the saved bytes, the step's peak, a middle microbatch's share or None) of one step."""
    job_config, dims, parts, neighbours = ready.job_config, ready.dims, ready.parts, ready.neighbours
    recorder = collectives.Recorder(collectives.group_labels(dims))
    saved, peak = _SavedBytes(), memory.StepPeak()
    attributed = None
    if dims.pp_enabled and attribute:
        attributed = microbatches.Microbatches(parts.schedule, stages.stages_of(parts.schedule._schedule), recorder,
                                               saved, peak, step.tokens.shape[0])
    if dims.pp_enabled:
        stages.stages_told_by_the_planner(parts.schedule, neighbours,
                                          step.tokens[:, : step.tokens.shape[1] // dims.cp], ready.seen.sent)
        stages.first_step_setup_unrecorded(parts.schedule, (recorder, saved, peak), phase)
    modules = [*parts.parts, *neighbours.values()]
    with phase("recorded step"), _whole_windows(), scoped((host_patches.DOCUMENTS_AS_WHOLE_ROWS,)), \
            experts.evenly_routed(modules), peak, recorder, saved, attributed or contextlib.nullcontext():
        step()
    passes = estimates.accumulation_steps(job_config, dims)
    peak_bytes = memory.step_peak_bytes(peak, parts.parts, passes)
    middle = None
    if attributed is not None:
        middle = (*microbatches.middle(attributed, memory.held_through(parts.parts, passes)), attributed.count)
        if not middle[3]:
            raise microbatches.NotAffine(
                "the step's peak comes while the middle microbatches run, and they keep tensors")
    return tuple(recorder.log), saved.bytes, peak_bytes, middle


def _job_plan(job_config, dims, model_args=None):
    """What torchtitan calls: the HF config, then titan_ext's checks and plan (carried by the args)."""
    from torchtitan.protocols import train_spec as registry

    if model_args is None:  # a copy: the flavor's registered args stay as the train spec has them for later jobs
        model_args = copy.deepcopy(registry.get_train_spec(job_config.model.name).model_args[job_config.model.flavor])
    _raising(type(model_args).update_from_config)(model_args, job_config)
    plan = job_plan_of(model_args)
    if dims.pp_enabled and torch.__version__ < PIPELINE_TORCH:
        raise ConfigError(
            f"planning --parallelism.pipeline_parallel_degree={dims.pp} needs torch >= {PIPELINE_TORCH} (torch "
            f"{torch.__version__}'s pipeline stages lack the shape metadata the planner hands them); plan the "
            "layout on a newer torch, or without PP"
        )
    return plan


PIPELINE_TORCH = "2.13"
"""The first torch whose pipeline stages take the metadata the planner hands them (``compat.pipeline_metadata``)."""


def checked_plan(job_config, world: int, model_args=None):
    """titan_ext's checks of the job, and its ``JobPlan``, as ``simulate_rank`` builds them (nothing built);
    ``model_args``: the args to update (the flavor's, copied, if None)."""
    with fake_group(world, 0):
        dims = parallel_dims_of(job_config, world)
        dims.build_mesh()
        return _job_plan(job_config, dims, model_args)


@contextlib.contextmanager
def _fake_tensors():
    """A planned rank's FakeTensorMode, its cache keyed the planner's faster way (``host_patches.FAKE_CACHE_KEYS``),
    and the mode of the watchers entered inside it (``collectives.watched_fake_tensors``)."""
    with scoped((host_patches.FAKE_CACHE_KEYS,)), \
            collectives.watched_fake_tensors(allow_non_fake_inputs=True):
        yield


@contextlib.contextmanager
def _schedules_as_on_a_real_group():
    """torch's schedules module reads the fake group as gloo while a rank is planned
    (``host_patches.SCHEDULES_ON_A_FAKE_GROUP``)."""
    with scoped((host_patches.SCHEDULES_ON_A_FAKE_GROUP,)):
        yield


@contextlib.contextmanager
def _whole_windows():
    """The fake batch holds whole windows, no packed documents (``host_patches.WHOLE_WINDOWS``)."""
    try:
        compat.transformers_masking_module()
    except compat.CompatError:  # no transformers model to plan
        yield
        return
    with scoped((host_patches.WHOLE_WINDOWS,)):
        yield


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
        """Told of each tensor's bytes as they are counted (``microbatches.Microbatches`` attributes them)."""

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


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
