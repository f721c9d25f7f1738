"""A pipelined rank stepped with fewer microbatches than its job's, and extrapolated to the job's count.

A fake step costs per operator whatever the shapes, so m microbatches cost m times one. Every microbatch has the
same shapes and the schedule is deterministic: one between the first (which FSDP gathers the weights for) and
the last (whose backward reduces the gradients) saves and issues what any other such does. So the rank is
stepped with the fewest microbatches its schedule takes that have one in the middle, what each saves and issues
is attributed to it (``Microbatches``), and each further microbatch adds a middle one's (``extrapolated``).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import replace

import torch

from titan_ext.patching import scoped
from titan_ext.planner import memory
from titan_ext.planner.host_patches import (
    SCHEDULE_LOSS_ATTRIBUTED, SCHEDULE_SENDS, SCHEDULE_STEP_ENDS_TOLD, STAGE_CHUNKS_ATTRIBUTED, STAGE_P2P_OPS_STAMPED,
)

EXTRAPOLATED_SCHEDULES = {"1F1B", "Interleaved1F1B"}
"""The schedules whose pipelined ranks are stepped with fewer microbatches and extrapolated: those
``tests/test_plan.py`` plans both ways and finds equal, field by field."""

PERIODS = 2
"""Steady 1F1B periods a stage whose middle microbatches keep tensors while the step's peak comes mid-schedule
(under TP the last stage: the schedule's losses; under CP each stage: each microbatch's positions) is stepped
with: its peak is extrapolated from two consecutive periods alike (``_periods``). Two suffice: the gradients the
first backward allocates are held through the step (``memory.held_through``), left out of the comparison; where
the two differ all the same the rank is stepped in full (``tests/test_plan.py`` checks TP and CP layouts both
ways)."""


class NotAffine(Exception):
    """A rank's middle microbatches that did not save and issue the same, or a collective not attributed."""


def job_microbatches(job_config) -> int:
    return job_config.training.local_batch_size // job_config.parallelism.pipeline_parallel_microbatch_size


def stepped_microbatches(job_config, extrapolate: bool | None) -> int | None:
    """The microbatches a pipelined rank is stepped with, or None to step the job's own: p + 1 for p ranks
    (1F1B takes a microbatch per stage, and with one more every stage runs a steady forward-backward pair,
    as it does at more: the step's peak there) and at least 3 (one between the first and the last)."""
    p = job_config.parallelism
    if extrapolate is False or p.pipeline_parallel_degree <= 1 or p.pipeline_parallel_schedule not in EXTRAPOLATED_SCHEDULES:
        return None
    if job_config.training.local_batch_size % p.pipeline_parallel_microbatch_size:
        return None  # refused by titan_ext's checks, in the full plan
    count = _fewest_microbatches(p, p.pipeline_parallel_degree)
    return count if count < job_microbatches(job_config) else None


def _fewest_microbatches(p, warm_up: int) -> int:
    """What a stage that warms up with ``warm_up`` forwards is stepped with: one more, for a steady
    forward-backward pair; at least 3 (one between the first and the last); under CP ``PERIODS`` pairs."""
    count = max(3, warm_up + 1)
    if p.context_parallel_degree > 1:  # every stage keeps each microbatch's positions: the first needs the periods
        count += PERIODS - 1
    elif p.tensor_parallel_degree > 1:  # the last stage keeps the losses (its warm-up is one microbatch)
        count = max(count, PERIODS + 1)
    return count


def stage_microbatches(job_config, stage: int) -> int | None:
    """The microbatches pipeline rank ``stage`` of a 1F1B layout stepped with ``stepped_microbatches`` is
    stepped with: its own warm-up's fewest (1F1B's stage s warms up with p - s forwards), fewer than the first
    stage's where it is later. torch's 1F1B takes no fewer microbatches than stages (the whole pipeline's
    rule), so the schedule is built with the first stage's count and set to this one (``rank.simulate_rank``).
    None (the job's count) under other schedules."""
    p = job_config.parallelism
    if p.pipeline_parallel_schedule != "1F1B":
        return None
    return min(job_microbatches(job_config), _fewest_microbatches(p, p.pipeline_parallel_degree - stage))


def with_microbatches(job_config, count: int):
    """The job with ``count`` microbatches in its local batch (and its validation's, where they were equal)."""
    small = copy.deepcopy(job_config)
    small.training.local_batch_size = count * job_config.parallelism.pipeline_parallel_microbatch_size
    if job_config.validation.local_batch_size == job_config.training.local_batch_size:
        small.validation.local_batch_size = small.training.local_batch_size
    return small


def extrapolated(stepped, m: int, plan):
    """The rank at m microbatches from its step with fewer (its own count): the state it holds does not change
    with m; the activations (summed over the microbatches), each collective's count (by kind, group and bytes)
    and the step's peak gain a middle microbatch's for each further one (``middle``). The collectives are
    listed in the order they first came, each repeated its count."""
    (rule, below), count = stepped.microbatch[2], stepped.microbatch[4]
    saved_bytes, counts = at_microbatches(stepped, m)
    ordered = [c for c in dict.fromkeys(stepped.collectives) for _ in range(counts[c])]
    peak = max(nbytes + (m - count) * growth for nbytes, growth in rule)
    if below is not None and below[0] + (m - count) * below[1] > peak:
        raise NotAffine("the step's peak may come after the tensors kept across the microbatches are freed")
    return replace(stepped, saved_bytes=saved_bytes, peak_bytes=peak, collectives=tuple(ordered), plan=plan,
                   microbatch=None)


def at_microbatches(stepped, m: int) -> tuple[int, Counter]:
    """A stepped rank's saved bytes and each collective's count at m microbatches: a middle microbatch's for
    each one more (or fewer) than it was stepped with. At m = 0 what ranks stepped with other counts compare by."""
    saved, issued, _, _, count = stepped.microbatch
    counts = Counter(stepped.collectives)
    for collective, n in Counter(issued).items():
        counts[collective] += (m - count) * n
    return stepped.saved_bytes + (m - count) * saved, counts


_STEPPED: list["Microbatches"] = []
"""The pipelined ranks being stepped (innermost last), told of the schedule's sends (``schedule_p2p``)."""


def schedule_p2p(original, ops, *args, **kwargs):
    """torch's ``_batch_p2p`` while the planner steps a pipelined rank (``planner.host_patches.SCHEDULE_SENDS``)."""
    if not _STEPPED:
        return original(ops, *args, **kwargs)
    return _STEPPED[-1].p2p(original, ops, *args, **kwargs)


class Microbatches:
    """Which microbatch each collective a pipelined rank's step issues, and each byte it saves and allocates,
    belongs to: those issued or saved while the stage runs a microbatch's forward, loss or backward, and its
    sends and receives (each P2P op is made for one microbatch); the rest (the step's own: token counts, tied
    weights) to none. Entered around the step; ``middle`` reads what it attributed."""

    def __init__(self, schedule, stages: list, recorder, saved, peak: memory.StepPeak, batch: int):
        self.current, self.tags, self.saved, self.unattributed, self.batch = None, [], Counter(), 0, batch
        self.started = False
        self.log, self._recorder, self._p2p, self.peak = recorder.log, recorder, None, peak
        peak.tag_of, peak.inherited = self._tag, lambda tag: tag != "batch"  # a sum of the batch is no batch
        record = recorder._record

        def tagged(*args, **kwargs):
            record(*args, **kwargs)
            self.tags.append(self.current)

        recorder._record = tagged
        saved.counted = lambda nbytes: self.saved.update({self.current: nbytes})
        inner = schedule._schedule
        self.count = inner._n_microbatches
        self.stages = stages
        self.ops: list[tuple[int, str, int]] = []
        """(the step's peak's event count as a forward or backward of a microbatch starts, "F" or "B", the microbatch)."""
        self.finished = -1
        """The last of the step's peak's events once every microbatch is done (the schedule's sends waited for)."""
        self._attribute_runs(inner)

    def _attribute_runs(self, inner) -> None:
        """Each stage's forwards and backwards, its P2P ops and the schedule's loss attributed to their
        microbatch; the step's end noted."""
        for stage in self.stages:
            for row in STAGE_CHUNKS_ATTRIBUTED:
                name = row.target.rpartition(".")[2]
                row.apply(stage, lambda method, kind=name[0].upper(): self._during(method, 0, kind))
            for row in STAGE_P2P_OPS_STAMPED:
                row.apply(stage, self._stamped)
        SCHEDULE_LOSS_ATTRIBUTED.apply(inner, lambda method: self._during(method, 3))

        def step_ends_told(original):
            def step_microbatches(*args, **kwargs):
                out = original(*args, **kwargs)
                self.finished = len(self.peak.events) - 1
                return out

            return step_microbatches

        SCHEDULE_STEP_ENDS_TOLD.apply(inner, step_ends_told)

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
                self.ops.append((len(self.peak.events), kind, args[position]))
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
        self._p2p = scoped((SCHEDULE_SENDS,))
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


def middle(attributed: Microbatches, kept) -> tuple:
    """(bytes saved, collectives issued, the step's peak as a rule of m, whether that rule holds) for one middle
    microbatch of a step ``attributed`` watched; ``NotAffine`` where middle microbatches differ.

    The step's peak at m microbatches: 1F1B keeps as many microbatches in flight whatever m, and what each
    allocates that outlives the microbatches (the losses the schedule keeps) adds up, as do the step's
    tensors of the whole batch (``Microbatches._tag``): each further microbatch adds what a middle one holds
    once all are done and a microbatch's share of those, where the peak comes after the middle ones ran (what
    they keep adds up there too). A peak while they run is the same at any m where they keep nothing; where
    they keep something it is extrapolated from the schedule's repeating periods (``_periods``), or not at
    all (a later point may peak at more microbatches)."""
    if attributed.unattributed or len(attributed.tags) != len(attributed.log):
        raise NotAffine("P2P ops not recorded one by one")
    peak, count = attributed.peak, attributed.count
    middles = range(1, count - 1)
    end = peak.held(attributed.finished, kept)
    at = peak.peak_event(kept)
    at_peak = peak.held(at, kept)
    if not end.get("batch", {}).keys() <= at_peak.get("batch", {}).keys():
        raise NotAffine("the step's peak comes before the batch's tensors")
    verified, while_they_run = True, at <= max(peak.last_tagged.get(index, -1) for index in middles)
    if while_they_run:  # the peak while they run, and what they keep adds up: it may peak later at more
        verified = not any(end.get(index) for index in middles)
    elif any(not end.get(index, {}).keys() <= at_peak.get(index, {}).keys() for index in middles):
        raise NotAffine("the step's peak comes before what a middle microbatch holds after the microbatches")
    batch = sum(end.get("batch", {}).values())
    if batch % count:
        raise NotAffine("the batch's tensors are not a whole number of microbatches'")
    saved, issued, held = _one_middle(attributed, end, middles, batch // count)
    gradients = sum(memory.local_bytes(g) for g in kept)  # as ``memory.step_peak_bytes`` adds them
    rule = None
    if not verified:  # the peak while they run: where the schedule repeats a period, each further one inserted
        rule = _periods(attributed, kept, end, middles, held - batch // count, batch // count, gradients)
        verified = rule is not None
    return saved, issued, rule or (((peak.peak_bytes(kept) + gradients, held),), None), verified


def _one_middle(attributed: Microbatches, end: dict, middles: range, batch_each: int) -> tuple:
    """(bytes saved, collectives issued, bytes held once all are done with its share of the batch's) of a
    middle microbatch: every middle one's the same, else ``NotAffine``."""
    each = {index: (attributed.saved[index],
                    tuple(c for c, tag in zip(attributed.log, attributed.tags) if tag == index),
                    sum(end.get(index, {}).values()) + batch_each)
            for index in middles}
    if len({(nbytes, tuple(sorted(Counter(issued).items(), key=repr)), peak)
            for nbytes, issued, peak in each.values()}) != 1:
        raise NotAffine("middle microbatches differ")
    return each[1]


def _periods(attributed: Microbatches, kept, end, middles, kept_each: int, batch_each: int,
             gradients: int) -> tuple | None:
    """The step's peak at m microbatches as the largest of (bytes, growth per further microbatch) pairs, from
    this step alone, where 1F1B's steady phase repeats: each steady period (a forward, then a backward, up to
    the next forward or backward) allocates and frees the same bytes in the same order, and one more microbatch
    is one more period. A step of m microbatches is this one with m - count copies of the first repeating period
    inserted (``_repeating_period``). So an event before it holds what it held here plus the batch's tensors'
    share of each further microbatch; an event after it, also every inserted period's net bytes (what a
    microbatch keeps: checked equal to what a middle one holds when all are done), up to the first release
    of a tensor kept across the microbatches (the schedule's losses at the step's end): what comes after may
    hold less at m, never more, and must stay below (else ``NotAffine`` when extrapolated). None where no
    two periods are alike, or several stages run on this rank."""
    if len(attributed.stages) != 1:
        return None
    peak = attributed.peak
    sizes = peak.sizes(kept)
    found = _repeating_period(attributed.ops, peak, sizes)
    if found is None or kept_each < 0:
        return None
    start, insert = found
    if sum(sizes[start:insert]) != kept_each:
        return None
    kept_across = {number for index in (*middles, "batch") for number in end.get(index, {})}
    release = next((i for i in range(insert, len(peak.events))
                    if peak.events[i][1] < 0 and peak.events[i][0] in kept_across), len(peak.events))
    return _rule_around(peak, sizes, insert, release, attributed.count, gradients, kept_each + batch_each)


def _repeating_period(ops, peak: memory.StepPeak, sizes: list[int]) -> tuple[int, int] | None:
    """(the first event, the end) of the first steady period followed by one alike (compared allocation by
    allocation): where the repeats begin (the first backwards allocate the gradients). None where there is none.

    The last period ends where the cooldown's first backward starts: in torch 2.15 the receive for that
    backward allocates its buffer just before (``Microbatches._stamped``), an allocation of that backward's
    microbatch that the periods before make inside the next period. It is alike where it is the period before
    it and then only such allocations."""
    kinds = "".join(kind for _, kind, _ in ops)
    # (a period's first event, its end's, the microbatch of the forward or backward it ends at)
    periods = [(ops[i][0], *ops[i + 2][::2]) for i in range(len(kinds) - 2) if kinds[i: i + 2] == "FB"]

    def alike(a: int, b: int, d: int, ending: int) -> bool:
        if sizes[a:b] == sizes[b:d]:
            return True
        cooldown = b + (b - a)
        return (d == periods[-1][1] and sizes[a:b] == sizes[b:cooldown]
                and all(size > 0 and peak.tag(number) == ending for number, size in peak.events[cooldown:d]))

    pairs = zip(periods, periods[1:])
    insert = next((b for (a, b, _), (c, d, ending) in pairs if b == c and alike(a, b, d, ending)), None)
    if insert is None:
        return None
    return next(a for a, b, _ in periods if b == insert), insert


def _rule_around(peak: memory.StepPeak, sizes: list[int], insert: int, release: int, count: int, gradients: int,
                 growth: int) -> tuple | None:
    """(the (bytes, growth) pairs of the events before the inserted periods, by the batch's bytes live, and of
    those after up to ``release``), and the pair the events after ``release`` must stay below (or None)."""
    before: dict[int, int] = {}  # the batch's bytes live -> the most bytes live at an event before the period
    now = batch_live = 0
    after = below = None
    for i, (number, _) in enumerate(peak.events):
        now += sizes[i]
        if peak.tag(number) == "batch":
            batch_live += sizes[i]
        if i < insert:
            before[batch_live] = max(before.get(batch_live, now), now)
        elif i < release:
            after = now if after is None else max(after, now)
        else:
            below = now if below is None else max(below, now)
    if any(live % count for live in before) or after is None:
        return None
    rule = tuple((most + gradients, live // count) for live, most in sorted(before.items()))
    return (*rule, (after + gradients, growth)), None if below is None else (below + gradients, growth)
