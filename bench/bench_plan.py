"""The planner's ``--sweep``: seconds per phase and per layout kind, and the total, this tree beside a baseline.

    python bench/bench_plan.py                                   # the README's example sweep, this tree
    python bench/bench_plan.py --baseline /tmp/base              # and a checkout of an older commit, in turn
    python bench/bench_plan.py --baseline /tmp/base --sample 1   # the first layout of each kind only
    python bench/bench_plan.py --layout "pp 8 x fsdp 128"        # one layout (repeat --layout for more)
    python bench/bench_plan.py -- --training.seq_len 32768 --training.local_batch_size 1  # more flags for the job

Each tree runs in a fresh process (imports included, as a user's sweep), one after the other, the baseline
first; the machine's load average is printed before and after each, as both wall and CPU seconds are. A tree
without ``titan_ext.planner.layouts.plan_sweep`` (before the sweep was sped up) is driven layout by layout
through ``plan_layout``, which is what its ``sweep`` did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = ["--job.config_file", "train_configs/gla_340M.toml", "--model.flavor", "7B"]
WORLD = 1024


def drive(argv: list[str], world: int, names: list[str] | None) -> dict:
    """In the tree on ``sys.path``: plan the sweep (or the named layouts), return the figures."""
    wall, cpu = time.monotonic(), _cpu()
    from titan_ext.planner import job_config_of, prepare

    prepare()
    from titan_ext.planner import layouts, rank

    try:
        from titan_ext.planner import roles  # where the layout's planning lives (an older tree: in rank)
    except ImportError:
        roles = rank

    imported = time.monotonic() - wall
    experts = layouts.experts_of(argv) if hasattr(layouts, "experts_of") else 0
    chosen = [layout for layout in (layouts.candidates(world, experts) if experts else layouts.candidates(world))
              if names is None or layout.name() in names]
    seconds, phases, cpu_each = {}, None, []
    planned = roles.plan_layout

    def timed(*args, **kwargs):  # every layout reaches plan_layout, refused ones too: CPU seconds in order
        begin = time.process_time()
        try:
            return planned(*args, **kwargs)
        finally:
            cpu_each.append(time.process_time() - begin)

    roles.plan_layout = timed
    if hasattr(layouts, "plan_sweep"):
        phases = rank.Phases()
        original, layouts.candidates = layouts.candidates, lambda world, *more: chosen
        try:
            result = layouts.plan_sweep(argv, world, 50.0, phases=phases,
                                        progress=lambda line: print(line, file=sys.stderr, flush=True))
        finally:
            layouts.candidates = original
        seconds = {layout.name(): s for layout, s in result.seconds.items()}
        if hasattr(result, "cpu_seconds"):  # plan_layout may call itself (a model planned with fewer blocks)
            cpu_each = [result.cpu_seconds[layout] for layout in chosen]
    else:
        for layout in chosen:
            begin = time.monotonic()
            try:
                timed(job_config_of([*argv, *layout.flags()]), world)
            except Exception:  # noqa: BLE001  (skipped layouts take their time too)
                pass
            seconds[layout.name()] = time.monotonic() - begin
            print(f"{layout.name()}: {seconds[layout.name()]:.1f} s", file=sys.stderr, flush=True)
    kinds = {layout.name(): layouts.kind(layout) if hasattr(layouts, "kind") else _kind(layout) for layout in chosen}
    cpu_seconds = {layout.name(): c for layout, c in zip(chosen, cpu_each)}
    return {"imports": imported, "seconds": seconds, "cpu_seconds": cpu_seconds, "kinds": kinds,
            "wall": time.monotonic() - wall,
            "cpu": _cpu() - cpu, "phases": dict(phases.seconds) if phases else None}


def _cpu() -> float:
    """This process's CPU seconds and its ended children's (a sweep's further processes)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _kind(layout) -> str:
    if layout.pp > 1:
        return "PP"
    if layout.cp > 1:
        return "CP"
    return "FSDP/HSDP x TP" if layout.tp > 1 else "FSDP/HSDP"


def run_tree(tree: Path, flags: list[str], names: list[str] | None, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import bench_plan; "
            f"print('RESULT', json.dumps(bench_plan.drive({[*EXAMPLE, *flags]!r}, {WORLD}, {names!r})))")
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, text=True, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=None)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stdout[-2000:]}")
    return {**json.loads(lines[-1][7:]), "load": (load, os.getloadavg()[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--sample", type=int, default=0, help="plan only the first N layouts of each kind")
    parser.add_argument("--layout", action="append", help="plan only this layout (its name as the sweep prints it); repeat")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per tree")
    parser.add_argument("flags", nargs="*", help="torchtitan/titan_ext flags added to the example's (after --)")
    options = parser.parse_args()
    names = options.layout
    if options.sample:
        sys.path.insert(0, str(REPO))
        from titan_ext.planner import layouts

        taken = defaultdict(list)
        for layout in layouts.candidates(WORLD):
            if len(taken[layouts.kind(layout)]) < options.sample:
                taken[layouts.kind(layout)].append(layout.name())
        names = [name for group in taken.values() for name in group]
    trees = ([("baseline", options.baseline)] if options.baseline else []) + [("this tree", REPO)]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs; GLA 7B sweep at {WORLD} ranks"
          + (f", {len(names)} layouts" + (f" (--sample {options.sample})" if options.sample else "") if names else "") + "".join(f" {f}" for f in options.flags),
          flush=True)
    results = {label: run_tree(tree, options.flags, names, options.timeout) for label, tree in trees}
    by_kind = {label: defaultdict(float) for label in results}
    cpu_by_kind = {label: defaultdict(float) for label in results}
    counts = defaultdict(int)
    for label, result in results.items():
        for name, seconds in result["seconds"].items():
            by_kind[label][result["kinds"][name]] += seconds
            cpu_by_kind[label][result["kinds"][name]] += result["cpu_seconds"].get(name, 0.0)
    for name, kind in results["this tree"]["kinds"].items():
        counts[kind] += 1
    labels = list(results)
    for title, table in (("wall", by_kind), ("CPU", cpu_by_kind)):
        print(f"\n{'layout kind':<16}{'layouts':>8}" + "".join(f"{label + ' ' + title + ' s':>20}" for label in labels)
              + ("       ratio" if len(labels) == 2 else ""))
        for kind in sorted(counts):
            cells = [table[label][kind] for label in labels]
            ratio = f"{cells[0] / cells[1]:>11.1f}x" if len(cells) == 2 and cells[1] else ""
            print(f"{kind:<16}{counts[kind]:>8}" + "".join(f"{c:>20.1f}" for c in cells) + " " + ratio)
    print()
    for key, title in (("imports", "imports"), ("wall", "total (wall)"), ("cpu", "total (CPU)")):
        cells = [results[label][key] for label in labels]
        ratio = f"{cells[0] / cells[1]:>11.1f}x" if len(cells) == 2 and cells[1] else ""
        print(f"{title:<24}" + "".join(f"{c:>20.1f}" for c in cells) + " " + ratio)
    print("load average (1 min) before, after: "
          + "; ".join(f"{label} {r['load'][0]:.1f}, {r['load'][1]:.1f}" for label, r in results.items()))
    phases = {label: results[label]["phases"] or {} for label in labels}
    print("\nseconds per phase (summed over the ranks planned; pp stage setup is part of the recorded step):")
    print(f"  {'':<20}" + "".join(f"{label:>12}" for label in labels))
    for phase in sorted(phases["this tree"], key=lambda name: -phases["this tree"][name]):
        print(f"  {phase:<20}" + "".join(f"{phases[label].get(phase, 0.0):>12.1f}" for label in labels))


if __name__ == "__main__":
    main()
