"""Run ``torchrun -m torchtitan.train`` on a shipped TOML and read back its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"


@dataclass
class Run:
    returncode: int
    output: str
    metrics: list[dict]
    dump_folder: Path

    @property
    def losses(self) -> list[float]:
        return [m["loss_metrics/global_avg_loss"] for m in self.metrics]

    @property
    def grad_norms(self) -> list[float]:
        return [m["grad_norm"] for m in self.metrics]

    def check(self) -> "Run":
        assert self.returncode == 0, f"training failed (exit {self.returncode}):\n{self.output[-6000:]}"
        return self


def _command(config: str, dump_folder: Path, nproc: int, overrides) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "-m", "torchtitan.train",
        "--job.config_file", str(CONFIGS / config),
        "--job.dump_folder", str(dump_folder),
        "--titan_ext.metrics_jsonl", str(dump_folder / "metrics.jsonl"),
        *overrides,
    ]


def _environment(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}


def _metrics(dump_folder: Path) -> list[dict]:
    metrics_file = dump_folder / "metrics.jsonl"
    if not metrics_file.exists():
        return []
    return [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]


def torchrun(
    config: str,
    dump_folder: Path,
    *overrides: str,
    nproc: int = 1,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Run:
    """Train with a TOML from ``train_configs/`` plus CLI overrides; never raises on failure."""
    (dump_folder / "metrics.jsonl").unlink(missing_ok=True)
    proc = subprocess.run(
        _command(config, dump_folder, nproc, overrides), cwd=REPO, env=_environment(env), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )
    return Run(proc.returncode, proc.stdout, _metrics(dump_folder), dump_folder)


def torchrun_interrupted(
    config: str, dump_folder: Path, *overrides: str, nproc: int, ready, signal_number: int, timeout: float = 600,
) -> Run:
    """Train as ``torchrun`` does, sending torchrun ``signal_number`` once ``ready()`` holds (a terminal's Ctrl-C
    reaches torchrun alone too: it starts each rank in a session of its own). Raises if the job ends before."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    log = dump_folder / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(config, dump_folder, nproc, overrides), cwd=REPO, env=_environment(None),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the job ended or timed out before it was ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        proc.send_signal(signal_number)
        proc.wait(timeout=120)
    return Run(proc.returncode, log.read_text(), _metrics(dump_folder), dump_folder)


def seed_checkpoint(config: str, dump_folder: Path, *overrides: str) -> Path:
    """Create a step-0 checkpoint in one process; runs load it with ``initial_load_path``.

    Initialized from ``--debug.seed 0``: every run of a test compares the same trajectories.
    """
    torchrun(
        config, dump_folder,
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--debug.seed", "0",
        "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "1",
        *overrides,
    ).check()
    path = dump_folder / "checkpoint" / "step-0"
    assert path.is_dir(), f"no seed checkpoint at {path}"
    return path


def from_seed(seed: Path) -> tuple[str, ...]:
    return ("--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), "--checkpoint.interval", "1000")


def assert_close(a: list[float], b: list[float], rtol: float, what: str) -> None:
    assert len(a) == len(b) and a, f"{what}: {len(a)} vs {len(b)} values"
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rtol * max(abs(x), abs(y)), f"{what} at step {i + 1}: {x!r} vs {y!r} (rtol {rtol})"
