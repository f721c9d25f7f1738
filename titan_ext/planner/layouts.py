"""``--sweep``: every layout of N ranks in the searched space, planned, checked by titan_ext, ranked."""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, field, replace

NODE = 8
"""Ranks per node: TP and CP stay inside one (tp x cp <= 8), as their collectives are on every block's path."""
PIPELINE_DEGREES = (1, 2, 4, 8)
EXPERT_DEGREES = (8, 64)
"""EP degrees tried for a mixture-of-experts model (besides none): its experts over a node's ranks, or over
eight nodes'; each where it divides the experts and torchtitan's EP region (fsdp x cp x tp: ETP 1)."""


@dataclass(frozen=True)
class Layout:
    pp: int
    replicate: int
    shard: int
    cp: int
    tp: int
    ep: int = 1

    def flags(self) -> list[str]:
        return [
            "--parallelism.pipeline_parallel_degree", str(self.pp),
            "--parallelism.data_parallel_replicate_degree", str(self.replicate),
            "--parallelism.data_parallel_shard_degree", str(self.shard),
            "--parallelism.context_parallel_degree", str(self.cp),
            "--parallelism.tensor_parallel_degree", str(self.tp),
            "--parallelism.expert_parallel_degree", str(self.ep),
        ]

    def name(self) -> str:
        parts = [("pp", self.pp), ("dp_replicate", self.replicate), ("fsdp", self.shard), ("cp", self.cp), ("tp", self.tp)]
        name = " x ".join(f"{n} {d}" for n, d in parts if d > 1) or "1 rank"
        return name + (f", experts over ep {self.ep}" if self.ep > 1 else "")


def candidates(world: int, experts: int = 0) -> list[Layout]:
    """TP and CP inside a node (tp x cp <= NODE), PP in PIPELINE_DEGREES, and the data-parallel ranks either
    all FSDP or HSDP sharded within a node (shard = NODE / (tp x cp)) and replicated across nodes. A model of
    ``experts`` experts also has each of these with EXPERT_DEGREES that torchtitan's mesh takes: EP over
    ranks of fsdp x cp x tp (ETP 1: the TP ranks share the tokens), dividing the experts."""
    found = []
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4, 8):
            for pp in PIPELINE_DEGREES:
                if tp * cp > NODE or world % (tp * cp * pp):
                    continue
                data = world // (tp * cp * pp)
                splits = {(1, data)}
                in_node = NODE // (tp * cp)
                if data % in_node == 0 and data > in_node:
                    splits.add((data // in_node, in_node))
                for replicate, shard in sorted(splits):
                    found += [Layout(pp, replicate, shard, cp, tp, ep) for ep in (1, *EXPERT_DEGREES)
                              if ep == 1 or (experts and experts % ep == 0 and shard * cp * tp % ep == 0)]
    return found


def experts_of(argv: list[str]) -> int:
    """The routed experts of the job's model (0 for a dense one, or where its config cannot be read here:
    planning each layout then says why)."""
    from torchtitan.protocols import train_spec as registry

    from titan_ext.planner import job_config_of

    try:
        job_config = job_config_of(argv)
        args = copy.deepcopy(registry.get_train_spec(job_config.model.name).model_args[job_config.model.flavor])
        args.read_job_config(job_config)
        config = args.to_hf_config()
    except Exception:  # noqa: BLE001
        return 0
    return next((n for n in (getattr(config, name, None) for name in ("num_experts", "n_routed_experts", "num_local_experts"))
                 if isinstance(n, int)), 0)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def kind(layout: Layout) -> str:
    """The family a layout's planning cost follows (the bench's rows): PP steps every microbatch through
    its stages; CP and TP add collectives on every block's path; FSDP/HSDP alone is the cheapest."""
    if layout.pp > 1:
        return "PP"
    if layout.ep > 1:
        return "EP"
    if layout.cp > 1:
        return "CP"
    return "FSDP/HSDP x TP" if layout.tp > 1 else "FSDP/HSDP"


@dataclass
class Sweep:
    """Every layout's outcome: planned (``rows``: layout, the largest rank's bytes, collectives seconds per step,
    bubble; ``planned``: its RankPlans) or skipped with its reason, and the seconds each took."""

    world: int
    rows: list = field(default_factory=list)
    planned: dict = field(default_factory=dict)
    skipped: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    cpu_seconds: dict = field(default_factory=dict)
    """This process's CPU seconds per layout (the machine may be shared: wall seconds then say little)."""


def plan_sweep(argv: list[str], world: int, link_gbps: float, phases=None, progress=None, workers: int | None = None) -> Sweep:
    """Plans ``candidates(world)`` in this process and ``workers - 1`` more (default: one per CPU this process may
    use), each taking the next layout not yet taken, the costliest kinds first (``_cost``); each layout is
    planned on its own (nothing one leaves behind changes the next one's plan: ``tests/test_plan.py``), so
    the plans are those of one process. Imports, torchtitan's registry and titan_ext's kernels load once per
    process. ``progress(line)`` hears of each layout as it is done (``[how many are done/all]``); ``result`` lists
    them in the sweep's order."""
    import multiprocessing

    result, layouts = Sweep(world), candidates(world, experts_of(argv))
    workers = min(len(layouts), workers or len(os.sched_getaffinity(0)))
    order = sorted(range(len(layouts)), key=lambda index: _cost(layouts[index]), reverse=True)
    outcomes: dict[int, tuple] = {}
    if workers <= 1:
        for index in order:
            outcomes[index] = _plan_one(argv, world, link_gbps, layouts[index])
            _report(layouts, outcomes, [index], progress)
        return _gathered(result, layouts, outcomes, phases)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads
    tasks, done = context.Queue(), context.Queue()
    for index in order:
        tasks.put(index)
    for _ in range(workers):  # a stop mark for each process, this one's too
        tasks.put(None)
    helpers = [context.Process(target=_worker, args=(argv, world, link_gbps, layouts, tasks, done, os.getpid()), daemon=True)
               for _ in range(workers - 1)]
    for helper in helpers:
        helper.start()
    try:
        while True:
            index = tasks.get()
            if index is None:  # every layout taken: wait for the other processes' last ones
                break
            outcomes[index] = _plan_one(argv, world, link_gbps, layouts[index])
            _report(layouts, outcomes, [index, *_collect(done, outcomes, block=False)], progress)
        while len(outcomes) < len(layouts):
            if not any(helper.is_alive() for helper in helpers) and done.empty():
                raise RuntimeError("a sweep's worker process ended before planning its layouts")
            _report(layouts, outcomes, _collect(done, outcomes, block=True), progress)
    finally:
        for helper in helpers:
            helper.join(timeout=5)
            if helper.is_alive():
                helper.kill()
    return _gathered(result, layouts, outcomes, phases)


def _cost(layout: Layout) -> tuple:
    """What planning a layout costs, roughly, for the order the processes take them in: its pipeline ranks step
    every microbatch, TP and CP step more periods (``microbatches.PERIODS``)."""
    return layout.pp, layout.tp * layout.cp > 1


def _plan_one(argv: list[str], world: int, link_gbps: float, layout: Layout) -> tuple:
    """(its RankPlans and row, or its reason for being skipped; wall and CPU seconds; the phases' seconds)."""
    from titan_ext.errors import ConfigError
    from titan_ext.planner import estimates, job_config_of
    from titan_ext.planner.rank import Phases
    from titan_ext.planner.roles import plan_layout

    job_config = job_config_of([*argv, *layout.flags()])
    phases = Phases()
    begin, cpu = time.monotonic(), time.process_time()
    try:
        planned = plan_layout(job_config, world, phases)
    except ConfigError as error:
        outcome = str(error)
    except Exception as error:  # noqa: BLE001  (the planner's own limits, reported per layout)
        outcome = f"not planned: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    else:
        passes = estimates.accumulation_steps(job_config, planned[0].parallel_dims)
        row = (layout, max(r.total_bytes for r in planned), estimates.step_seconds(planned, link_gbps, passes),
               estimates.bubble(planned[0].plan, job_config))
        # the meshes and the job's plan (a model's TP plan may be a class made at run time) stay in their process
        outcome = ([replace(r, parallel_dims=None, plan=None) for r in planned], row)
    return outcome, time.monotonic() - begin, time.process_time() - cpu, dict(phases.seconds)


def _worker(argv, world, link_gbps, layouts, tasks, done, parent: int) -> None:
    """A sweep's further process: plans the layouts it takes until the stop mark, or until the sweep's process
    (``parent``) is gone: killed, it leaves no worker planning on for nobody (daemon processes end only with a
    parent that exits)."""
    from titan_ext.planner import prepare

    prepare()
    import pickle

    while os.getppid() == parent and (index := tasks.get()) is not None:
        outcome = _plan_one(argv, world, link_gbps, layouts[index])
        try:  # pickled here: the queue pickles in a thread of its own, where a failure would only lose the layout
            sent = pickle.dumps(outcome)
        except Exception as error:  # noqa: BLE001
            sent = pickle.dumps((f"not planned: the sweep's worker process could not send its plan "
                                 f"({type(error).__name__}: {str(error)[:120]})", *outcome[1:]))
        done.put((index, sent))


def _collect(done, outcomes: dict, block: bool) -> list[int]:
    """The layouts the other processes finished (waiting a little for one where ``block``)."""
    import pickle
    import queue

    got = []
    try:
        while True:
            index, sent = done.get(block=block, timeout=5 if block else None)
            outcomes[index] = pickle.loads(sent)
            got.append(index)
            block = False
    except queue.Empty:
        pass
    return got


def _report(layouts: list[Layout], outcomes: dict, indices: list[int], progress) -> None:
    from titan_ext.planner.memory import GIB

    for number, index in enumerate(indices, len(outcomes) - len(indices) + 1):
        outcome, seconds, cpu, _ = outcomes[index]
        if progress is not None:
            done = "skipped" if isinstance(outcome, str) else f"peak {outcome[1][1] / GIB:.3f} GiB"
            progress(f"[{number}/{len(layouts)}] {layouts[index].name()}: {done} ({seconds:.1f} s, {cpu:.1f} CPU s)")


def _gathered(result: Sweep, layouts: list[Layout], outcomes: dict, phases) -> Sweep:
    """Every layout's outcome into ``result``, in the sweep's order; the phases' seconds summed."""
    for index, layout in enumerate(layouts):
        outcome, result.seconds[layout], result.cpu_seconds[layout], seconds = outcomes[index]
        if isinstance(outcome, str):
            result.skipped.append((layout, outcome))
        else:
            result.planned[layout], row = outcome
            result.rows.append(row)
        if phases is not None:
            phases.seconds.update(seconds)
    return result


def report(result: Sweep, memory_gib: float, link_gbps: float) -> str:
    from titan_ext.planner.memory import GIB

    fits = [row for row in result.rows if row[1] <= memory_gib * GIB]
    too_big = [row for row in result.rows if row[1] > memory_gib * GIB]
    lines = [f"layouts of {result.world} ranks that fit {memory_gib:g} GiB per rank, fastest first by the collectives' time "
             f"at {link_gbps:g} GB/s (a lower bound on the step time):",
             "  collectives ms   peak GiB   bubble   layout"]
    lines += [f"  {_ms(s):>14} {peak / GIB:>10.3f} {bubble:>8.1%}   {layout.name()}"
              for layout, peak, s, bubble in sorted(fits, key=lambda r: (r[2], r[1]))]
    lines += ["", f"do not fit {memory_gib:g} GiB:"]
    lines += [f"  {layout.name()}: {peak / GIB:.3f} GiB" for layout, peak, _, _ in sorted(too_big, key=lambda r: r[1])]
    lines += ["", "skipped (titan_ext's checks, or the planner's limits):"]
    lines += [f"  {layout.name()}: {reason}" for layout, reason in result.skipped]
    return "\n".join(lines)


def sweep(argv: list[str], world: int, memory_gib: float, link_gbps: float, progress=None) -> str:
    return report(plan_sweep(argv, world, link_gbps, progress=progress), memory_gib, link_gbps)
