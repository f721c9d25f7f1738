"""A pipelined rank's stages among the other ranks': what they receive, which are twins, and the first step's setup.

A real rank learns its input's shapes from the previous rank in its first step; the planner steps one rank in
one process, so it answers those messages itself (``stages_told_by_the_planner``), and a rank whose one stage
is an interior twin of a stage stepped before takes that one's plan (``twin``).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from dataclasses import replace

import torch

from titan_ext import compat
from titan_ext.planner import memory, microbatches
from titan_ext.planner.host_patches import (
    SCHEDULE_FIRST_MICROBATCH_KEPT, SCHEDULE_SETUP_UNRECORDED, SCHEDULE_VOTE_ANSWERED, STAGE_META_RECEIVED,
    STAGE_META_SENT,
)


class StagesSeen:
    """The pipeline stages of one layout planned so far, at one microbatch count (``roles.plan_layout`` plans
    its ranks in pipeline order): the shapes each sent its next stage in the first step's setup, which is what
    that stage's rank receives in a real run (so a later rank builds no other rank's stages to learn its
    input), each stepped interior stage's plan by its structure and input (``twin_key``), and the job's
    checks, plan and whole meta model, the same for every rank (each copies its stages out of the model)."""

    def __init__(self):
        self.built: tuple | None = None
        """(the job config, its model args, their JobPlan, the whole model on the meta device), from the layout's
        first rank."""
        self.sent: dict = {}
        """stage index -> the ``_StageForwardMeta`` it sent the next stage."""
        self.stepped: list = []
        """(twin key, the RankPlan stepped for it, what its stage sent)."""


def stages_of(schedule) -> list:
    """The stages a torch pipeline schedule runs on this rank (a multi-stage schedule's, or a single stage's)."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def other_stages(model, choice, dims, job_config, parallelize, seen: StagesSeen) -> dict:
    """The stages before this rank's last one that other ranks run, built as they build them: a stage
    on another rank tells this one its output's shape and dtype in the first step (torch's handshake).
    None are built where every stage this rank hears from was planned before it (``seen.sent``: what it sent)."""
    from titan_ext.parallel.pipeline import stage_model

    local = set(choice.stage_indices(dims.get_mesh("pp").get_local_rank()))
    if all(index - 1 in local or index - 1 in seen.sent for index in local if index > 0):
        return {}
    return {index: parallelize(stage_model(model, choice.stages[index]), dims, job_config)
            for index in range(max(local)) if index not in local}


def twin_key(plan, schedule, parts, seen: StagesSeen):
    """What makes two pipeline ranks' plans equal, or None where the planner steps the rank whatever came
    before: one interior stage (not the first, which embeds, nor the last, which computes the loss) of a
    schedule of one stage per rank; the same input (what the previous stage sent: known, as the ranks are
    planned in order) and the same modules (``structure``: classes, settings, parameters, local bytes).
    Such a stage runs the same forwards and backwards as its twin, only their order differs with its place
    in 1F1B's warm-up, which changes no count where FSDP keeps the blocks gathered across the step's
    microbatches (its default under PP). Where it reshards after each forward, when it gathers again
    follows that order: no stage is taken for another's there (each is stepped). The step's peak follows
    the order too (how many microbatches' activations are held at once): twins also run the same order,
    GPipe's (every forward, then every backward) or 1F1B's as many warm-up forwards (``min(m, stages -
    index)``: never, as titan_ext's checks ask 1F1B for m >= stages), any other schedule's never."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    inner = schedule._schedule
    stages = stages_of(inner)
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
    return None if received is None else (received, order, structure(parts[0]))


def twin(key, seen: StagesSeen) -> tuple | None:
    """(the RankPlan, what its stage sent) of a stage stepped before that this one's key matches, or that two
    of other warm-up depths give (``_deeper_twin``); None where the rank is to be stepped."""
    if key is None:
        return None
    found = next(((planned, sent) for k, planned, sent in seen.stepped if k == key), None)
    return found if found is not None else _deeper_twin(key, seen)


def _deeper_twin(key, seen: StagesSeen):
    """An interior 1F1B stage whose twins differ only in their warm-up depth (``twin_key``'s order): two
    stepped before at depths a and b that hold, save and issue the same, differing only in the step's peak,
    give this one's: the peak comes in the steady phase, with as many microbatches' activations in flight
    as the depth, so each further microbatch of depth adds the same. ``tests/test_plan.py`` plans 8 stages
    both ways. None where there are not two such, or they differ otherwise."""
    received, depth, modules = key
    found = [(k[1], planned, sent) for k, planned, sent in seen.stepped
             if isinstance(k[1], int) and (k[0], k[2]) == (received, modules)]
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
    deeper = _deeper_rule(one, other, a - b, depth - a)
    return None if deeper is None else (deeper, sent)


def _deeper_rule(one, other, apart: int, further: int):
    """``one``, stepped with its own microbatches (``microbatches.stage_microbatches``), with its peak's rule
    moved ``further`` depths on by what a depth added from ``other``: compared, and moved, at no microbatches (a
    middle microbatch's share taken off each count). None where they differ otherwise."""
    if one.microbatch[::3] != other.microbatch[::3] or Counter(one.microbatch[1]) != Counter(other.microbatch[1]) \
            or microbatches.at_microbatches(one, 0) != microbatches.at_microbatches(other, 0):
        return None
    (rule, below), (rule_b, below_b) = one.microbatch[2], other.microbatch[2]
    pairs = [*zip(rule, rule_b), *([(below, below_b)] if below and below_b else [])]
    if len(rule) != len(rule_b) or (below is None) != (below_b is None) or any(x[1] != y[1] for x, y in pairs):
        return None  # the peak's rule (``microbatches.middle``): each of its bytes by depth
    count, count_b = one.microbatch[4], other.microbatch[4]
    deeper = [_by_depth(x[0] - count * x[1], y[0] - count_b * y[1], apart, further) for x, y in pairs]
    if None in deeper:
        return None
    moved = [(nbytes + count * x[1], x[1]) for nbytes, (x, _) in zip(deeper, pairs)]  # at ``one``'s count
    rule = (tuple(moved[: len(rule)]), moved[len(rule)] if below else None)
    microbatch = (*one.microbatch[:2], rule, *one.microbatch[3:])
    return replace(one, peak_bytes=max(nbytes for nbytes, _ in rule[0]), microbatch=microbatch)


def _by_depth(one: int, other: int, apart: int, further: int) -> int | None:
    """``one`` moved ``further`` depths on, by what a depth added from ``other`` (``apart`` depths before); None
    where that is no whole number of bytes."""
    step, rest = divmod(one - other, apart)
    return None if rest else one + further * step


def structure(module: torch.nn.Module) -> tuple:
    """A module tree without its names: each module's class and settings, and its own parameters' and
    buffers' shapes, dtypes, placements and local bytes (a pipeline stage's blocks are named by their index
    in the whole model)."""
    from torch.distributed.tensor import DTensor

    def tensors(items):
        return tuple((type(t).__name__, tuple(t.shape), t.dtype, str(t.placements) if isinstance(t, DTensor) else "",
                      memory.local_bytes(t), t.requires_grad) for _, t in items if t is not None)

    return tuple((type(m).__qualname__, m.extra_repr(), tensors(m.named_parameters(recurse=False)),
                  tensors(m.named_buffers(recurse=False))) for m in module.modules())


def stages_told_by_the_planner(schedule, neighbours: dict, first_input: torch.Tensor, sent: dict) -> None:
    """torch's schedule sets its stages up in its first step by messages between the ranks: a vote (whose
    result it reads with ``.item()``) on whether every stage was given its shapes, then each stage's output
    shapes and dtypes sent on as pickled objects, and its input gradients' sent back. On the fake group
    nothing arrives, so the planner answers for the other ranks: the vote as real runs decide it (no stage
    given shapes: inferred), a stage's input as the previous stages compute it from the microbatch
    (``neighbours`` and this rank's own; ``first_input``: the step's tokens as the first stage gets them, its
    piece of the sequence under CP), and its output gradients as the outputs' shapes and dtypes. A stage
    planned before this rank (``sent``: stage -> what it sent on) answers for itself, and this rank's stages
    add what they send. Only a first step needs this, and the planner runs one (``first_step_setup_unrecorded``)."""
    inner = schedule._schedule
    stages = stages_of(inner)
    modules = {**neighbours, **{stage.stage_index: stage.submod for stage in stages}}
    microbatch: dict = {}

    def first_microbatch_kept(original):
        def step_microbatches(*args, **kwargs):
            arg_mbs, kwarg_mbs = (list(args) + [kwargs.get("arg_mbs"), kwargs.get("kwarg_mbs")])[:2]
            # the first stage's microbatch: given to this rank's schedule only where it runs that stage
            own = arg_mbs[0] if arg_mbs and arg_mbs[0] else None
            microbatch.update(args=own or first_input[: len(first_input) // inner._n_microbatches],
                              kwargs=(kwarg_mbs or [{}])[0] or {})
            return original(*args, **kwargs)

        return step_microbatches

    SCHEDULE_FIRST_MICROBATCH_KEPT.apply(inner, first_microbatch_kept)
    SCHEDULE_VOTE_ANSWERED.apply(inner, lambda original: _shapes_inferred)
    schedule._warm_up = False  # titan_ext's gloo warm-up step (TokenMeanSchedule): values do not matter here
    for stage in stages:
        STAGE_META_SENT.apply(stage, lambda original, stage=stage: functools.partial(_kept_for_the_next, stage, sent))
        STAGE_META_RECEIVED.apply(
            stage, lambda original, stage=stage: functools.partial(_received, stage, sent, modules, microbatch))


def _shapes_inferred(stages, has_backward, p2p_done) -> None:
    """The ranks' vote, as real runs decide it: no stage was given its shapes, each infers them."""
    meta = compat.pipeline_metadata()
    for stage in stages:
        stage._inference_mode = meta.InferenceMode.DYNAMIC


def _kept_for_the_next(stage, sent: dict, meta_, destination: int) -> None:
    """What ``stage`` sends its next stage, kept for the rank that runs it (its backward messages dropped)."""
    if destination > stage.stage_index:
        sent[stage.stage_index] = meta_


def _received(stage, sent: dict, modules: dict, microbatch: dict, source: int):
    """What ``stage`` receives from ``source``: the next stage's input gradients as this stage's outputs, or
    the previous stage's outputs, as sent when planned before or as computed from the microbatch."""
    meta = compat.pipeline_metadata()
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


def first_step_setup_unrecorded(schedule, recorders, phase) -> None:
    """The one step the planner runs under PP is a first step: before its microbatches the schedule sets its
    stages up (the metadata inference's forward of one microbatch, and the other stages' forwards the planner
    answers their messages with; its backward is left out where ``input_gradients_derived`` applies), and
    titan_ext's schedule first gives every copy of a tied weight the first stage's values. A real run does both
    in its first step only: neither is recorded, so the recorded step is what every later step of a real run
    issues and saves (``tests/test_plan.py``'s real runs: step 2)."""
    inner = schedule._schedule
    stages = stages_of(inner)

    def unrecorded(original):
        def initialize(*args, **kwargs):
            with phase("pp stage setup"), contextlib.ExitStack() as stack:
                for recorder in recorders:
                    stack.enter_context(recorder.paused())
                stack.enter_context(input_gradients_derived(stages))
                return original(*args, **kwargs)

        return initialize

    SCHEDULE_SETUP_UNRECORDED.apply(inner, unrecorded)
    tied = getattr(schedule, "_tied", None)
    if tied is not None and not tied.synced:
        tied.sync()


@contextlib.contextmanager
def input_gradients_derived(stages):
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
