"""Training throughput of fla's GLA: a plain PyTorch loop vs titan_ext on stock torchtitan, in one run.

Rows, all at the same model, batch and sequence length:
  (a) plain loop over fla's model: bf16 autocast, fp32 params, fused AdamW;
  (b) titan_ext through stock torchtitan's ``Trainer`` (one rank, in this process), bf16 mixed precision;
  (c) (b) + per-block compile;
  (d) (c) + Float8 (``quantize.linear.float8``);
  (e) (c) + op-level selective AC (saves GLA's core and every other matmul: memory for speed);
  (f) (b) + document masking (``[titan_ext] document_mask``: fla's packed
      ``cu_seqlens`` path; the shipped GPU configs turn it on, so (b)-(e) and (g) turn it off);
  (g) (c) + the chunked loss (``[titan_ext] loss = "chunked"``: no full logits; 0.71x (c) on an H200,
      so the shipped GPU configs keep torchtitan's loss: bench/RESULTS.md).
Each row, side by side as ratios to the first row run ((a) where it runs): median tokens/s over the steps
after warm-up, peak allocated memory (``torch.cuda.max_memory_allocated``, from a reset at the row's start;
n/a on the CPU, which has no such counter), seconds from the row's start to the end of its step 1 (build,
compile, Triton's autotuning and the step), MFU from the spec's FLOPs per token (``get_nparams_and_flops``)
and torchtitan's ``get_peak_flops``, and the share of each step spent waiting for the batch (torchtitan's
``data_loading(%)``; 0 for the plain loop, whose tokens wait on the device). (b)-(g) read per-step metrics
written by ``--titan_ext.metrics_jsonl``. Row (c)'s last ``--profile-steps`` steps run under torch.profiler
(left out of its median): the top kernels by CUDA time (on the CPU: the top ops by CPU time), as a table.

    python bench/bench_train.py                 # GLA 340M, 16 x 2048, one GPU
    python bench/bench_train.py --rows a,c,d    # only these rows (the lease's: bench/gpu_lease.sh)
    python bench/bench_train.py --cpu-tiny      # debug model on CPU, the same code paths: CI checks that it runs

Each row is printed as soon as it is measured, so a run cut short by a time limit keeps its finished rows;
torchtitan's log lines and the plain loop's first step, stamped with the seconds since start, show where
a row's time went (autotuning, compiling, steps).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]


ROWS = "abcdefg"
"""The rows' letters, in the order they run."""


@dataclass
class Row:
    name: str
    tps: float
    allocated_peak_gib: float
    """Peak allocated memory over the row (``torch.cuda.max_memory_allocated``); NaN off CUDA (printed n/a)."""
    first_step_s: float
    """Seconds from the row's start to the end of its step 1."""
    note: str = ""
    data_loading_percent: float = 0.0
    """torchtitan's share of each step spent waiting for the batch (median; 0 for the plain loop's GPU tokens)."""


@dataclass
class Hotspot:
    """One kernel (on the CPU: one op) of a profile, summed over the profiled steps."""
    name: str
    ms: float
    share_percent: float
    calls: int


START = time.monotonic()


def progress(message: str) -> None:
    print(f"[bench +{time.monotonic() - START:.0f} s] {message}", flush=True)


def row_letters(rows: str) -> str:
    """``--rows`` as the letters to run, in order ("c,g" -> "cg"); ValueError saying what is wrong."""
    letters = rows.replace(",", "")
    unknown = sorted(set(letters) - set(ROWS))
    if unknown or not letters:
        raise ValueError(f"{'unknown rows ' + ','.join(unknown) if unknown else 'no rows'}; give letters of {ROWS}")
    return letters


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="train_configs/gla_340M.toml")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--profile-steps", type=int, default=3, help="row (c)'s last steps run under torch.profiler")
    parser.add_argument("--cpu-tiny", action="store_true", help="debug model, 2 x 128, 7 steps, CPU backends, one dataloader worker")
    parser.add_argument("--rows", default=ROWS, help=f"the rows to run, in order, e.g. c,g (default: all, {ROWS})")
    args = parser.parse_args(argv)
    try:
        args.rows = row_letters(args.rows)
    except ValueError as error:
        parser.error(f"--rows {args.rows.replace(',', '')!r}: {error}, e.g. --rows c,g")
    if args.cpu_tiny:
        args.config, args.batch, args.seq, args.steps, args.warmup = "train_configs/debug_gla.toml", 2, 128, 7, 2
        args.compile_backend, args.profile_steps = "aot_eager", 2
    if args.profile_steps < 1:
        parser.error(f"--profile-steps ({args.profile_steps}) must be at least 1")
    if args.steps <= args.warmup + args.profile_steps:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) "
                     f"+ --profile-steps ({args.profile_steps})")
    return args


def load_flavor(config: str):
    """The flavor's model args, from the TOML's [model] section."""
    import tomli  # not tomllib: Python 3.10 has none (pyproject.toml's requires-python)

    from titan_ext.train_specs import TRAIN_SPECS

    with open(REPO / config, "rb") as f:
        model = tomli.load(f)["model"]
    return model["name"], model["flavor"], TRAIN_SPECS[model["name"]]().model_args[model["flavor"]]


def flops_per_token(model_args, seq: int) -> int:
    from titan_ext.models.adapter import build_model

    with torch.device("meta"):
        model = build_model(copy.deepcopy(model_args))
    return model_args.get_nparams_and_flops(model, seq)[1]


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def allocated_peak_gib() -> float:
    """Peak allocated device memory since the last reset; NaN off CUDA (no caching allocator to ask)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else math.nan


def start_row() -> float:
    """The row's start: its peak memory counted from here; the time its first step is measured from."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return time.monotonic()


def measured_steps(args) -> range:
    """The steps every row's median is taken over: after the warm-up, before row (c)'s profiled steps (every row
    the same, so that the rows compare)."""
    return range(args.warmup + 1, args.steps - args.profile_steps + 1)


def plain_loop(model_args, args) -> Row:
    """(a): fla's model and the loop everyone writes first."""
    return _plain_loop(model_args, device(), args.batch, args.seq, args.steps, measured_steps(args))


def _plain_loop(model_args, dev, batch, seq, steps, measured: range) -> Row:
    from fla.models import GLAForCausalLM

    from titan_ext import kernels

    start = start_row()
    torch.manual_seed(0)
    model = GLAForCausalLM(model_args.to_hf_config()).to(dev)
    if dev.type != "cuda":  # fla as shipped needs a GPU; elsewhere titan_ext's portable kernels
        kernels.portable(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(0, model_args.config["vocab_size"], (batch, seq + 1), device=dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times = []
    for _ in range(steps):
        step_start = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - step_start)
        if len(times) == 1:
            first_step = time.monotonic() - start
            progress(f"(a) step 1 took {times[0]:.1f} s (on a GPU: Triton's autotuning, unless its cache is warm)")
    tps = batch * seq / statistics.median(times[measured.start - 1:measured.stop - 1])
    row = Row("(a) plain PyTorch loop", tps, allocated_peak_gib(), first_step)
    del model, optimizer
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def torchtitan_run(name: str, args, overrides: list[str], note: str = "",
                   profiled: int = 0) -> tuple[Row, list[Hotspot]]:
    """One torchtitan job in this process: stock ``Trainer``, as torchrun's only rank runs it, without a
    new interpreter's imports per row; median of its per-step metrics after warm-up, and, with ``profiled``,
    the top kernels of its last ``profiled`` steps (left out of the median)."""
    import torch._dynamo
    import torch.distributed as dist
    from torchtitan.config import ConfigManager

    start = start_row()
    with tempfile.TemporaryDirectory() as folder, single_rank():
        metrics = Path(folder) / "metrics.jsonl"
        job_config = ConfigManager().parse_args([
            "--job.config_file", str(REPO / args.config), "--job.dump_folder", folder,
            "--titan_ext.metrics_jsonl", str(metrics), "--metrics.log_freq", "1", "--checkpoint.no-enable",
            "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq),
            "--training.steps", str(args.steps), "--training.mixed_precision_param", "bfloat16",
            "--debug.seed", "0", *worker_flags(args), *overrides,
        ])
        profiled_steps = range(args.steps - profiled + 1, args.steps + 1) if profiled else range(0)
        trainer = measured_trainer()(job_config, start, profiled_steps)
        try:
            trainer.train()
        except Exception as error:
            raise RuntimeError(f"{name}: torchtitan failed: {error}") from error
        finally:
            trainer.close()
            first_step, peak, hotspots = trainer.first_step_s, trainer.allocated_peak(), trainer.hotspots
            outliving = live_children()
            del trainer
            if dist.is_initialized():
                dist.destroy_process_group()
            torch._dynamo.reset()  # the next row compiles its own graphs
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if outliving:  # forked from this job, holding its process groups: the next row's would join them
            raise RuntimeError(f"{name}: processes {outliving} (a dataloader worker) outlived the job")
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steady = [s for s in steps if s["step"] in measured_steps(args)]
    tps = statistics.median(s["throughput(tps)"] for s in steady)
    data = statistics.median(s.get("time_metrics/data_loading(%)", math.nan) for s in steady)
    return Row(name, tps, peak, first_step, note, data), hotspots


def measured_trainer():
    """torchtitan's ``Trainer`` that also keeps what torchtitan's metrics do not: the time to the end of step 1,
    the row's peak allocated memory (torchtitan resets the peak at every logged step) and a profile of
    chosen steps (torchtitan's own profiler wants a device a CPU run lacks)."""
    from torchtitan.train import Trainer

    class MeasuredTrainer(Trainer):
        def __init__(self, job_config, start: float, profiled_steps: range):
            self.first_step_s, self._start, self._profiled, self._profile = math.nan, start, profiled_steps, None
            self._peak, self.hotspots = 0.0, []
            super().__init__(job_config)
            metrics = self.metrics_processor
            metrics.device_memory_monitor = PeakKeeping(metrics.device_memory_monitor, self)

        def train_step(self, data_iterator):
            if self._profiled and self.step == self._profiled[0]:
                self._profile = torch.profiler.profile(activities=profiler_activities())
                self._profile.__enter__()
            super().train_step(data_iterator)
            if self.step == 1:
                self.first_step_s = time.monotonic() - self._start
            if self._profiled and self.step == self._profiled[-1]:
                self._profile.__exit__(None, None, None)
                self.hotspots = top_hotspots(self._profile)

        def keep_peak(self) -> None:
            self._peak = max(self._peak, allocated_peak_gib())

        def allocated_peak(self) -> float:
            self.keep_peak()
            return self._peak if torch.cuda.is_available() else math.nan

    return MeasuredTrainer


class PeakKeeping:
    """torchtitan's device memory monitor, the trainer's peak kept before each of its resets."""

    def __init__(self, monitor, trainer):
        self._monitor, self._trainer = monitor, trainer

    def reset_peak_stats(self):
        self._trainer.keep_peak()
        self._monitor.reset_peak_stats()

    def __getattr__(self, name):
        return getattr(self._monitor, name)


def profiler_activities() -> list:
    activities = [torch.profiler.ProfilerActivity.CPU]
    return activities + [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else activities


def top_hotspots(profile, count: int = 15) -> list[Hotspot]:
    """The kernels that took the most CUDA time (on the CPU: the ops that took the most CPU time of their own),
    summed over the profiled steps, with their share of all of it."""
    on_cuda = torch.cuda.is_available()
    kind = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    events = [e for e in profile.key_averages() if e.device_type == kind]
    self_us = (lambda e: e.self_device_time_total) if on_cuda else (lambda e: e.self_cpu_time_total)
    total = sum(self_us(e) for e in events) or 1.0
    events.sort(key=self_us, reverse=True)
    return [Hotspot(e.key, self_us(e) / 1000, 100 * self_us(e) / total, e.count) for e in events[:count]]


def live_children() -> list[int]:
    """This process's children still running (Linux ``/proc``; a zombie has ended)."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError, IndexError):
            continue
        if int(parent) == os.getpid() and state != "Z":
            children.append(int(entry.name))
    return children


def single_rank():
    """torchrun's variables for a one-rank job, restored afterwards."""
    return mock.patch.dict(os.environ, {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_flags(args) -> list[str]:
    """``--cpu-tiny``'s debug TOML reads its data in the training loop's thread; its rows take one worker, as the
    shipped GPU TOMLs do (and each row checks that the worker ends with its job)."""
    return ["--training.dataloader.num_workers", "1"] if args.cpu_tiny else []


def titan_row_flags(args) -> dict[str, tuple[str, list[str], str]]:
    """Rows (b)-(g): letter -> (name, torchtitan flags, note)."""
    compile_flags = ["--compile.enable", "--compile.backend", args.compile_backend]
    float8 = ["--model.converters", "quantize.linear.float8"]
    unmasked = ["--titan_ext.no-document_mask"]
    op_sac = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
    rows = {
        "b": ("(b) titan_ext bf16", unmasked, ""),
        "c": ("(c) (b) + compile", unmasked + compile_flags, ""),
        "d": ("(d) (c) + Float8", unmasked + compile_flags + float8, ""),
        "e": ("(e) (c) + op-level SAC", unmasked + compile_flags + op_sac, ""),
        "f": ("(f) (b) + document mask", ["--titan_ext.document_mask"], ""),
        "g": ("(g) (c) + chunked loss", unmasked + compile_flags + ["--titan_ext.loss", "chunked"], ""),
    }
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        # torchao's emulation is eager-only; without a float8 GPU this row is (b) + emulated Float8.
        rows["d"] = ("(d) (b) + Float8 emulated", unmasked + float8 + ["--quantize.linear.float8.emulate"],
                     "no float8 GPU: emulated Float8, eager (emulation cannot compile)")
    return rows


def peak_flops() -> float:
    from torchtitan.tools.utils import get_peak_flops

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return get_peak_flops(name)


COLUMNS = ("run", "tokens/s", "vs base", "peak alloc GiB", "vs base", "first step s", "vs base", "MFU %", "data wait %")
"""The rows table's columns ("vs base": the figure to its left over the first row's, (a) where it ran)."""
HOTSPOT_COLUMNS = ("kernel (CPU: op)", "ms/step", "share %", "calls/step")


def markdown_table(header: tuple[str, ...], lines: list[list[str]]) -> list[str]:
    """A table as bench/RESULTS.md holds them: the first column left-aligned, the others right-aligned."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *lines)]

    def line(cells):
        aligned = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "| " + " | ".join(aligned) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return [line(header), rule, *(line(cells) for cells in lines)]


def ratio(value: float, base: float) -> str:
    return f"{value / base:.3f}" if math.isfinite(value) and math.isfinite(base) and base > 0 else "n/a"


def report(rows: list[Row], hotspots: list[Hotspot], flops: int, peak: float, args) -> list[str]:
    """The run's figures as lines to paste into bench/RESULTS.md: the rows side by side, then (c)'s profile."""
    base = rows[0]
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    measured = measured_steps(args)
    lines = [f"GLA {args.config}, batch {args.batch} x seq {args.seq}, "
             f"median of steps {measured.start}-{measured.stop - 1}, {where}",
             f"FLOPs/token {flops:,}, peak {peak / 1e12:.0f} TFLOP/s" if math.isfinite(peak) else
             f"FLOPs/token {flops:,}, peak unknown (MFU shows 0)"]
    if not torch.cuda.is_available():
        lines.append("peak alloc: n/a on the CPU (torch.cuda.max_memory_allocated counts CUDA memory only)")
    cells = [[row.name, f"{row.tps:,.1f}", ratio(row.tps, base.tps),
              f"{row.allocated_peak_gib:.2f}" if math.isfinite(row.allocated_peak_gib) else "n/a",
              ratio(row.allocated_peak_gib, base.allocated_peak_gib),
              f"{row.first_step_s:.1f}", ratio(row.first_step_s, base.first_step_s),
              f"{100 * row.tps * flops / peak:.3f}", f"{row.data_loading_percent:.1f}"] for row in rows]
    lines += markdown_table(COLUMNS, cells)
    if hotspots:
        kind = "kernels by CUDA time" if torch.cuda.is_available() else "ops by CPU time (no GPU: the CPU's own)"
        lines += ["", f"Top {len(hotspots)} {kind} of (c), steps {measured.stop}-{args.steps} (torch.profiler)"]
        lines += markdown_table(HOTSPOT_COLUMNS, [[h.name[:100], f"{h.ms / args.profile_steps:.2f}",
                                                   f"{h.share_percent:.1f}", f"{h.calls / args.profile_steps:g}"]
                                                  for h in hotspots])
    return lines


def main(argv=None) -> list[Row]:
    from torchtitan.tools.logging import init_logger

    args = parse_args(argv)
    _, _, model_args = load_flavor(args.config)
    flops, flags = flops_per_token(model_args, args.seq), titan_row_flags(args)
    init_logger()  # the in-process Trainer's log lines (compiling, each step) show where a row's time goes
    rows, hotspots = [], []
    for letter in args.rows:
        progress(f"row ({letter})")
        if letter == "a":
            row = plain_loop(model_args, args)
        else:
            name, overrides, note = flags[letter]
            if note:
                print(f"({letter}): {note}")
            row, profile = torchtitan_run(name, args, overrides, note, args.profile_steps if letter == "c" else 0)
            hotspots += profile
        print(f"measured {row.name}: {row.tps:,.1f} tokens/s, peak allocated {row.allocated_peak_gib:.2f} GiB, "
              f"first step after {row.first_step_s:.1f} s, waiting for data {row.data_loading_percent:.1f}% of the step",
              flush=True)
        rows.append(row)
    assert all(math.isfinite(r.tps) for r in rows)
    print("\n" + "\n".join(report(rows, hotspots, flops, peak_flops(), args)), flush=True)
    return rows


if __name__ == "__main__":
    main()
