"""The GPU proof (issue 42) in few device calls: each stage's figures and logs land under ``--out``.

What has run on a GPU so far: ``bench/RESULTS.md``. The lent machine has Python 3.12 and torch 2.11 but
not torchtitan, fla or torchao: fetch them here with ``../shared/tools/gpu-wheels.sh`` (it writes
``.whl``); ``bench/gpu_lease.sh`` installs them there, runs this script within the call's time, and
carries the caches from one lease to the next:

    python3 bench/gpu_proof.py --out proof --deadline 470 bench:a,c,d      # the lease (gpu_lease.sh's default)
    python3 bench/gpu_proof.py --out proof --deadline 470 tests            # the CUDA tests, in a second call

Stages run in the order given, each NAME[:ARG][@SECONDS] (at most SECONDS, and within ``--deadline``):
  tests         the tests CPU skips for want of CUDA (fla's kernels behind the GLA, KDA and Gated DeltaNet ops, SDPA on
                CUDA, autotuning with configs compiled together), with the ops' gradient differences from
                fla's chunk_gla and chunk_kda
  train:CONFIG  ``--steps`` steps of train_configs/CONFIG.toml through torchrun on one GPU, compiled,
                with TORCH_LOGS=recompiles and (on CUDA) the profiler on the last step: seconds from
                launch to step 1, loss first/last, median tokens/s, peak memory, recompiles, and the kernels
                that took the most time (fla's Triton kernels show by name). The same config twice
                gives the cold and the warm (Triton cache filled) time to first step.
  eager:CONFIG  the same without compile: Triton's autotuning apart from Inductor's compiling
  bench         bench/bench_train.py: rows (a)-(g) side by side, one run (tokens/s, peak allocated memory, time
                to first step and data-loading share, each as a ratio to the first row; row (c)'s top kernels
                from torch.profiler); ``bench:a,c,d`` only those rows

A stage that runs out of time is stopped with everything it started, and its summary line says how
far it got; its log holds every line printed until then. A fresh machine spends minutes autotuning
fla's kernels and compiling: ``bench/gpu_lease.sh`` carries the autotuning results from one lease to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_train import row_letters

REPO = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_gated_delta_op.py", "tests/test_autotune_compile.py", "tests/test_kda_op.py",
              "tests/test_sdpa_fallback.py", "tests/test_float8.py", "tests/test_gla_op.py"]
"""Those never run on a GPU first: a stage cut short by its time still says something new (its log names each
test as it passes: ``-v``)."""
STEP_ONE = re.compile(r"step:\s*1[/\s]")  # titan_ext prints "step: 1/TOTAL"


def parse_stage(stage: str) -> tuple[str, str, float | None]:
    """"NAME[:ARG][@SECONDS]" -> (name, arg, seconds or None); ValueError saying what is wrong."""
    spec, _, limit = stage.partition("@")
    name, _, arg = spec.partition(":")
    if name not in ("tests", "bench", "train", "eager") or (name == "tests" and arg) or (name in ("train", "eager") and not arg):
        raise ValueError("use tests, bench, bench:ROWS, train:CONFIG or eager:CONFIG, each with an optional @SECONDS")
    try:
        seconds = float(limit) if limit else None
    except ValueError:
        seconds = -1.0
    if seconds is not None and not seconds > 0:
        raise ValueError(f"{limit!r} after @ is not a number of seconds, e.g. {spec}@300")
    if name == "bench" and arg:
        row_letters(arg)
    if name in ("train", "eager") and not (REPO / "train_configs" / f"{arg}.toml").is_file():
        raise ValueError(f"no train_configs/{arg}.toml")
    return name, arg, seconds


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="+", help="tests, bench, bench:ROWS (bench_train.py's --rows), train:CONFIG, "
                        "eager:CONFIG (a file stem in train_configs/), each with an optional @SECONDS")
    parser.add_argument("--out", type=Path, required=True, help="folder for logs and summary.jsonl")
    parser.add_argument("--steps", type=int, default=30, help="training steps of each train/eager stage and bench row")
    parser.add_argument("--deadline", type=float, help="seconds for all stages together; a stage gets what is left")
    args = parser.parse_args(argv)
    for stage in args.stages:
        try:
            parse_stage(stage)
        except ValueError as error:
            parser.error(f"stage {stage!r}: {error}")
    if args.steps < 4:
        parser.error(f"--steps={args.steps}: give at least 4 (the first third is warm-up; the profiler traces the last)")
    if args.deadline is not None and not args.deadline > 0:
        parser.error(f"--deadline={args.deadline}: give a number of seconds above 0")
    return args


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``): torchrun starts its workers in sessions of their own,
    out of reach of a process-group signal."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        except (ValueError, OSError, IndexError):
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, finished but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop(pid: int, grace: float = 15.0) -> None:
    """SIGTERM to ``pid``'s tree (torchrun passes it on), then SIGKILL to whatever is left after ``grace`` s."""
    tree = process_tree(pid)

    def signal_all(signal_number):
        for member in tree:
            try:
                os.kill(member, signal_number)
            except ProcessLookupError:
                pass

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(m) for m in tree):
        time.sleep(0.5)
    signal_all(signal.SIGKILL)


def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None,
               seconds: float | None = None) -> tuple[int, float | None, float, bool]:
    """Run ``command``, its output to ``log`` line by line (a stage cut short keeps what it printed);
    (exit code, seconds to torchtitan's step 1 or None, seconds, whether it ran out of time and was stopped)."""
    start, first_step = time.monotonic(), None
    with open(log, "w", buffering=1) as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        ran_out = threading.Event()

        def out_of_time():
            ran_out.set()
            stop(proc.pid)

        timer = threading.Timer(seconds, out_of_time) if seconds is not None else None
        if timer:
            timer.start()
        for line in proc.stdout:
            out.write(line)
            if first_step is None and STEP_ONE.search(line):
                first_step = time.monotonic() - start
        code = proc.wait()
        if timer:
            timer.cancel()
            timer.join()  # a stop under way finishes first: nothing of this stage outlives it
        timed_out = ran_out.is_set()
        if timed_out:
            out.write(f"\n[gpu_proof] stopped after {seconds:.0f} s, the stage's time\n")
    return code, first_step, time.monotonic() - start, timed_out


def top_kernels(trace: Path, count: int = 12) -> list[tuple[str, float]]:
    """(name, total ms) of the GPU kernels that took the most time in a profiler trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    totals = defaultdict(float)
    for event in events:
        if event.get("cat") == "kernel" and "dur" in event:
            totals[event["name"]] += event["dur"] / 1000
    return sorted(totals.items(), key=lambda item: -item[1])[:count]


def train(config: str, args, out: Path, seconds: float | None, compiled: bool = True) -> dict:
    stage = "train" if compiled else "eager"
    dump = out / f"{stage}_{config}_{time.strftime('%H%M%S')}"
    metrics = dump / "metrics.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "torchtitan.train",
        "--job.config_file", f"train_configs/{config}.toml", "--job.dump_folder", str(dump),
        "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--titan_ext.metrics_jsonl", str(metrics),
        "--checkpoint.no-enable", *(["--compile.enable"] if compiled else []),
    ]
    if torch.cuda.is_available():  # torchtitan 0.2.2's profiler asks for a device activity a CPU run lacks
        command += ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps),
                    "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1"]
    log_file = dump.with_suffix(".log")
    code, first_step, took, timed_out = run_logged(command, log_file, {"TORCH_LOGS": "recompiles"}, seconds)
    log = log_file.read_text()
    result = {"stage": f"{stage}:{config}", "exit": code, "timed_out": timed_out, "seconds": round(took, 1),
              "seconds_to_step_1": None if first_step is None else round(first_step, 1),
              "recompiles": log.count("Recompiling function")}
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    result["steps_done"] = len(steps)
    if steps:
        steady = steps[len(steps) // 3:]
        result.update(loss_first=steps[0]["loss_metrics/global_avg_loss"], loss_last=steps[-1]["loss_metrics/global_avg_loss"],
                      tokens_per_s=round(statistics.median(s["throughput(tps)"] for s in steady)),
                      peak_memory_gib=max(s["memory/max_reserved(GiB)"] for s in steps),
                      mfu_percent=round(statistics.median(s.get("mfu(%)", 0.0) for s in steady), 2),
                      data_loading_percent=round(statistics.median(s.get("time_metrics/data_loading(%)", 0.0)
                                                                   for s in steady), 1))
    traces = sorted(dump.glob("profile_traces/iteration_*/rank0_trace.json"))
    if traces:
        result["top_kernels_ms"] = [[name[:120], round(ms, 2)] for name, ms in top_kernels(traces[-1])]
    return result


def tests(out: Path, seconds: float | None) -> dict:
    command = [sys.executable, "-m", "pytest", "-v", "-rsP", "-p", "no:cacheprovider", *CUDA_TESTS]
    code, _, took, timed_out = run_logged(command, out / "tests.log", seconds=seconds)
    lines = (out / "tests.log").read_text().strip().splitlines()
    figures = [line for line in lines if "bit for bit" in line and line.startswith("cuda")]
    return {"stage": "tests", "exit": code, "timed_out": timed_out, "seconds": round(took, 1), "summary": lines[-1:],
            "ops": figures}


def bench(out: Path, rows: str, args, seconds: float | None) -> dict:
    command = [sys.executable, "bench/bench_train.py", "--steps", str(args.steps), "--warmup", str(args.steps // 3),
               *(["--rows", rows] if rows else [])]
    code, _, took, timed_out = run_logged(command, out / "bench.log", seconds=seconds)
    lines = (out / "bench.log").read_text().splitlines()
    return {"stage": "bench", "exit": code, "timed_out": timed_out, "seconds": round(took, 1),
            "measured": [line for line in lines if line.startswith("measured")],
            "table": [line for line in lines if line.startswith(("|", "GLA", "FLOPs", "peak alloc", "Top"))]}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed, start = 0, time.monotonic()
    for stage in args.stages:
        name, arg, seconds = parse_stage(stage)
        if args.deadline is not None:
            left = args.deadline - (time.monotonic() - start)
            seconds = left if seconds is None else min(seconds, left)
        if seconds is not None and seconds < 10:
            result = {"stage": stage, "exit": None, "skipped": f"{seconds:.0f} s for it (its @SECONDS, or what --deadline left)"}
        elif name in ("train", "eager"):
            result = train(arg, args, args.out, seconds, compiled=name == "train")
        elif name == "tests":
            result = tests(args.out, seconds)
        else:
            result = bench(args.out, arg, args, seconds)
        failed += result["exit"] != 0  # a stage skipped for time leaves the proof unfinished
        with open(args.out / "summary.jsonl", "a") as summary:
            summary.write(json.dumps(result) + "\n")
        print(json.dumps(result, indent=1), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
