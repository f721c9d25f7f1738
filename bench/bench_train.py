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
Each row: median tokens/s over the steps after warm-up, ratio to (a), peak
memory, and MFU from the spec's FLOPs per token (``get_nparams_and_flops``)
and torchtitan's ``get_peak_flops``. (b)-(f) read per-step metrics written by
``--titan_ext.metrics_jsonl``.

    python bench/bench_train.py                 # GLA 340M, 16 x 2048, one GPU
    python bench/bench_train.py --rows c,g      # only these rows (the chunked loss's decision)
    python bench/bench_train.py --cpu-tiny      # debug model on CPU: CI checks that it still runs

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
import resource
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
    memory_gib: float
    note: str = ""
    data_loading_percent: float = 0.0
    """torchtitan's share of each step spent waiting for the batch (median; 0 for the plain loop's GPU tokens)."""


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
    parser.add_argument("--cpu-tiny", action="store_true", help="debug model, 2 x 128, 6 steps, CPU backends, one dataloader worker")
    parser.add_argument("--rows", default=ROWS, help=f"the rows to run, in order, e.g. c,g (default: all, {ROWS})")
    args = parser.parse_args(argv)
    try:
        args.rows = row_letters(args.rows)
    except ValueError as error:
        parser.error(f"--rows {args.rows.replace(',', '')!r}: {error}, e.g. --rows c,g")
    if args.cpu_tiny:
        args.config, args.batch, args.seq, args.steps, args.warmup = "train_configs/debug_gla.toml", 2, 128, 6, 2
        args.compile_backend = "aot_eager"
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
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


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def plain_loop(model_args, batch: int, seq: int, steps: int, warmup: int) -> Row:
    """(a): fla's model and the loop everyone writes first."""
    return _plain_loop(model_args, device(), batch, seq, steps, warmup)


def _plain_loop(model_args, dev, batch, seq, steps, warmup) -> Row:
    from fla.models import GLAForCausalLM

    from titan_ext import kernels

    torch.manual_seed(0)
    model = GLAForCausalLM(model_args.to_hf_config()).to(dev)
    if dev.type != "cuda":  # fla as shipped needs a GPU; elsewhere titan_ext's portable kernels
        kernels.portable(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(0, model_args.config["vocab_size"], (batch, seq + 1), device=dev)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            progress(f"(a) step 1 took {times[0]:.1f} s (on a GPU: Triton's autotuning, unless its cache is warm)")
    tps = batch * seq / statistics.median(times[warmup:])
    row = Row("(a) plain PyTorch loop", tps, peak_memory_gib())
    del model, optimizer
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def torchtitan_run(name: str, args, overrides: list[str], note: str = "") -> Row:
    """One torchtitan job in this process: stock ``Trainer``, as torchrun's only rank runs it, without a
    new interpreter's imports per row; median of its per-step metrics after warm-up."""
    import torch._dynamo
    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    with tempfile.TemporaryDirectory() as folder, single_rank():
        metrics = Path(folder) / "metrics.jsonl"
        job_config = ConfigManager().parse_args([
            "--job.config_file", str(REPO / args.config), "--job.dump_folder", folder,
            "--titan_ext.metrics_jsonl", str(metrics), "--metrics.log_freq", "1", "--checkpoint.no-enable",
            "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq),
            "--training.steps", str(args.steps), "--training.mixed_precision_param", "bfloat16",
            "--debug.seed", "0", *worker_flags(args), *overrides,
        ])
        trainer = Trainer(job_config)
        try:
            trainer.train()
        except Exception as error:
            raise RuntimeError(f"{name}: torchtitan failed: {error}") from error
        finally:
            trainer.close()
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
    steady = [s for s in steps if s["step"] > args.warmup]
    tps = statistics.median(s["throughput(tps)"] for s in steady)
    memory = max(s["memory/max_reserved(GiB)"] for s in steady)
    data = statistics.median(s.get("time_metrics/data_loading(%)", math.nan) for s in steady)
    return Row(name, tps, memory, note, data)


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


def print_table(rows: list[Row], flops: int, peak: float, args) -> None:
    base = rows[0].tps  # (a) where it ran, else the first row run (the header says which)
    print(f"\nGLA {args.config}, batch {args.batch} x seq {args.seq}, median of steps {args.warmup + 1}-{args.steps}")
    peak_text = f"{peak / 1e12:.0f} TFLOP/s" if math.isfinite(peak) else "unknown (MFU shows 0)"
    print(f"FLOPs/token {flops:,}, peak {peak_text} ({device().type})")
    print(f"| {'run':<32} | {'tokens/s':>12} | {'vs ' + rows[0].name[:3]:>7} | {'peak mem GiB':>12} | {'MFU %':>7} |")
    print(f"|{'-' * 34}|{'-' * 14}|{'-' * 9}|{'-' * 14}|{'-' * 9}|")
    for row in rows:
        mfu = 100 * row.tps * flops / peak
        print(f"| {row.name:<32} | {row.tps:>12,.1f} | {row.tps / base:>7.3f} | {row.memory_gib:>12.2f} | {mfu:>7.3f} |")


def main(argv=None) -> list[Row]:
    from torchtitan.tools.logging import init_logger

    args = parse_args(argv)
    _, _, model_args = load_flavor(args.config)
    flops, flags = flops_per_token(model_args, args.seq), titan_row_flags(args)
    init_logger()  # the in-process Trainer's log lines (compiling, each step) show where a row's time goes
    rows = []
    for letter in args.rows:
        progress(f"row ({letter})")
        if letter == "a":
            row = plain_loop(model_args, args.batch, args.seq, args.steps, args.warmup)
        else:
            name, overrides, note = flags[letter]
            if note:
                print(f"({letter}): {note}")
            row = torchtitan_run(name, args, overrides, note)
        print(f"measured {row.name}: {row.tps:,.1f} tokens/s, peak {row.memory_gib:.2f} GiB, "
              f"waiting for data {row.data_loading_percent:.1f}% of the step", flush=True)
        rows.append(row)
    assert all(math.isfinite(r.tps) for r in rows)
    print_table(rows, flops, peak_flops(), args)
    return rows


if __name__ == "__main__":
    main()
