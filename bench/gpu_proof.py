"""The GPU proof (issue 11) in few device calls: each stage's figures and logs land under ``--out``.

Written and checked on a CPU machine (``--steps 4 train:debug_gla``); not yet run on a GPU. The lent
machine has Python 3.12 and torch 2.11 but not torchtitan, fla or torchao: fetch them here with
``../shared/tools/gpu-wheels.sh`` (it writes ``.whl``), then, with ``.whl`` carried:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site && \\
        python3 bench/gpu_proof.py --out $OUT tests train:gla_340M train:gla_340M

Stages run in the order given:
  tests         the tests CPU skips for want of CUDA (fla's kernels behind the GLA and KDA ops, SDPA on
                CUDA), with the ops' gradient differences from fla's chunk_gla and chunk_kda
  train:CONFIG  ``--steps`` steps of train_configs/CONFIG.toml through torchrun on one GPU, compiled,
                with TORCH_LOGS=recompiles and (on CUDA) the profiler on the last step: seconds from
                launch to step 1, loss first/last, median tokens/s, peak memory, recompiles, and the kernels
                that took the most time (fla's Triton kernels show by name). The same config twice
                gives the cold and the warm (Triton cache filled) time to first step.
  bench         bench/bench_train.py: rows (a)-(g) side by side, one run; ``bench:c,g`` only those rows

A fresh machine spends minutes autotuning fla's kernels before the first GLA step, and the machine
is released 30 s after a call: warm-up and measurement belong in one call.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_train import row_letters

REPO = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_gla_op.py", "tests/test_kda_op.py", "tests/test_sdpa_fallback.py", "tests/test_float8.py"]
STEP_ONE = re.compile(r"step:\s*1\s")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="+",
                        help="tests, bench, bench:ROWS (bench_train.py's --rows), train:CONFIG (a file stem in train_configs/)")
    parser.add_argument("--out", type=Path, required=True, help="folder for logs and summary.jsonl")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    for stage in args.stages:
        name, _, config = stage.partition(":")
        if name not in ("tests", "bench", "train") or (name == "tests" and config) or (name == "train" and not config):
            parser.error(f"stage {stage!r}: use tests, bench, bench:ROWS or train:CONFIG")
        if name == "bench" and config:
            try:
                row_letters(config)
            except ValueError as error:
                parser.error(f"stage {stage!r}: {error}, e.g. bench:c,g")
        if name == "train" and not (REPO / "train_configs" / f"{config}.toml").is_file():
            parser.error(f"stage {stage!r}: no train_configs/{config}.toml")
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: give at least 2 (the profiler traces the last step)")
    return args


def run_logged(command: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float | None, float]:
    """Run ``command``, its output to ``log``; (exit code, seconds to torchtitan's step 1 or None, seconds)."""
    start, first_step = time.monotonic(), None
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in proc.stdout:
            out.write(line)
            if first_step is None and STEP_ONE.search(line):
                first_step = time.monotonic() - start
        code = proc.wait()
    return code, first_step, time.monotonic() - start


def top_kernels(trace: Path, count: int = 12) -> list[tuple[str, float]]:
    """(name, total ms) of the GPU kernels that took the most time in a profiler trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    totals = defaultdict(float)
    for event in events:
        if event.get("cat") == "kernel" and "dur" in event:
            totals[event["name"]] += event["dur"] / 1000
    return sorted(totals.items(), key=lambda item: -item[1])[:count]


def train(config: str, args, out: Path) -> dict:
    dump = out / f"train_{config}_{time.strftime('%H%M%S')}"
    metrics = dump / "metrics.jsonl"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "torchtitan.train",
        "--job.config_file", f"train_configs/{config}.toml", "--job.dump_folder", str(dump),
        "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--titan_ext.metrics_jsonl", str(metrics),
        "--checkpoint.no-enable", "--compile.enable",
    ]
    if torch.cuda.is_available():  # torchtitan 0.2.2's profiler asks for a device activity a CPU run lacks
        command += ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps),
                    "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1"]
    log_file = dump.with_suffix(".log")
    code, first_step, seconds = run_logged(command, log_file, {"TORCH_LOGS": "recompiles"})
    log = log_file.read_text()
    result = {"stage": f"train:{config}", "exit": code, "seconds": round(seconds, 1),
              "seconds_to_step_1": None if first_step is None else round(first_step, 1),
              "recompiles": log.count("Recompiling function")}
    steps = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    if steps:
        steady = steps[len(steps) // 3:]
        result.update(loss_first=steps[0]["loss_metrics/global_avg_loss"], loss_last=steps[-1]["loss_metrics/global_avg_loss"],
                      tokens_per_s=round(statistics.median(s["throughput(tps)"] for s in steady)),
                      peak_memory_gib=max(s["memory/max_reserved(GiB)"] for s in steps),
                      mfu_percent=round(statistics.median(s.get("mfu(%)", 0.0) for s in steady), 2))
    traces = sorted(dump.glob("profile_traces/iteration_*/rank0_trace.json"))
    if traces:
        result["top_kernels_ms"] = [[name[:120], round(ms, 2)] for name, ms in top_kernels(traces[-1])]
    return result


def tests(out: Path) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-rsP", "-p", "no:cacheprovider", *CUDA_TESTS]
    code, _, seconds = run_logged(command, out / "tests.log")
    lines = (out / "tests.log").read_text().strip().splitlines()
    figures = [line for line in lines if "bit for bit" in line and line.startswith("cuda")]
    return {"stage": "tests", "exit": code, "seconds": round(seconds, 1), "summary": lines[-1:], "ops": figures}


def bench(out: Path, rows: str) -> dict:
    command = [sys.executable, "bench/bench_train.py", *(["--rows", rows] if rows else [])]
    code, _, seconds = run_logged(command, out / "bench.log")
    table = [line for line in (out / "bench.log").read_text().splitlines() if line.startswith(("|", "GLA", "FLOPs"))]
    return {"stage": "bench", "exit": code, "seconds": round(seconds, 1), "table": table}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for stage in args.stages:
        name, _, config = stage.partition(":")
        result = train(config, args, args.out) if name == "train" else tests(args.out) if name == "tests" else \
            bench(args.out, config)
        failed += result["exit"] != 0
        with open(args.out / "summary.jsonl", "a") as summary:
            summary.write(json.dumps(result) + "\n")
        print(json.dumps(result, indent=1), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
