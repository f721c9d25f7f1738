"""A damaged step stops before the build in one line (or gives way to the newest whole step), and Ctrl-C or
SIGTERM ends a job in one line.

Two launches save real steps, then are interrupted: FSDP2 (2 CPU ranks) gets SIGINT, as a terminal's Ctrl-C
hands torchrun, once its ``step-4`` is saved; PP2 gets SIGTERM (``kill``) once its ``step-2`` is. Copies of
their steps are then damaged in every way a disk or a killed copy leaves them and checked in-process, as the
job's preflight checks them; one more launch resumes past a damaged step (``--titan_ext.damaged_checkpoint
skip``). The one-line stop of a launch on a damaged step is one of ``test_bad_configs.py``'s launches.
"""

from __future__ import annotations

import re
import shutil
import signal
import zlib
from pathlib import Path

import pytest
from launch import torchrun, torchrun_interrupted

from titan_ext.checkpoints import dcp_steps
from titan_ext.errors import ConfigError

CONFIG = "debug_gla.toml"
JOB = ("--training.seq_len", "64", "--training.local_batch_size", "2", "--checkpoint.enable", "--debug.seed", "7")
LAYOUTS = {
    "fsdp2": (("--parallelism.data_parallel_shard_degree", "2"), signal.SIGINT),
    "pp2": (("--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"),
            signal.SIGTERM),
}
SAVED = 4
"""The step each launch is interrupted after: steps 2 and 4 saved, at least."""


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Each layout's launch, stopped by its signal once the step it waits for is saved."""
    runs = {}
    for layout, (flags, number) in LAYOUTS.items():
        folder = tmp_path_factory.mktemp(layout)
        saved = folder / "checkpoint" / f"step-{SAVED}" / ".metadata"
        runs[layout] = torchrun_interrupted(CONFIG, folder, *JOB, *flags, "--training.steps", "1000",
                                            "--checkpoint.interval", "2", nproc=2, ready=saved.is_file,
                                            signal_number=number)
    return runs


def finished_steps(run) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run.dump_folder / "checkpoint").glob("step-*/.metadata"))


def rank_output(output: str) -> str:
    """The output without torchrun's own report of the signal (its SignalException traceback, last)."""
    head, found, tail = output.rpartition("Traceback (most recent call last):")
    return head if found and "torch/distributed/run.py" in tail and "SignalException" in tail else output


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_signal_ends_the_job_in_one_line(interrupted, layout):
    run, number = interrupted[layout], LAYOUTS[layout][1]
    lines = [line for line in run.output.splitlines() if f"stopped by {number.name}" in line]
    newest = run.dump_folder / "checkpoint" / f"step-{finished_steps(run)[-1]}"
    assert len(lines) == 1, run.output[-4000:]
    assert " - WARNING - titan_ext: stopped by" in lines[0] and f"the same command resumes from {newest}" in lines[0]
    step = int(lines[0].split(" at step ")[1].split()[0])
    assert step >= SAVED and lines[0].endswith(f"{newest}"), lines[0]
    ranks = rank_output(run.output)
    assert "Traceback" not in ranks and "KeyboardInterrupt" not in ranks, ranks[-4000:]
    assert run.returncode != 0


def test_a_save_records_each_file_size_and_checksum(interrupted):
    """The manifest (each rank's piece, joined by rank 0) names exactly the files DCP's .metadata names, as they
    are on disk; no piece is left."""
    for run in interrupted.values():
        for step in finished_steps(run):
            path = run.dump_folder / "checkpoint" / f"step-{step}"
            assert [p.name for p in path.iterdir() if p.name.startswith(".titan_ext")] == [dcp_steps.MANIFEST]
            manifest = dcp_steps._read_manifest(str(path))
            assert set(manifest) == set(dcp_steps.compat.dcp_storage_extents(dcp_steps._metadata(str(path))))
            for name, entry in manifest.items():
                data = (path / name).read_bytes()
                assert entry == {"bytes": len(data), "crc32": zlib.crc32(data)}, (path, name)
            assert dcp_steps.step_damage(str(path)) is None


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def shard(step: Path) -> Path:
    return step / "__1_0.distcp"


DAMAGES = {
    "truncated shard": (lambda s: cut_in_half(shard(s)), "__1_0.distcp is truncated ("),
    "zero-length shard": (lambda s: shard(s).write_bytes(b""), "__1_0.distcp is truncated (0 of "),
    "missing shard": (lambda s: shard(s).unlink(), "__1_0.distcp is missing"),
    "bytes flipped within size": (lambda s: flip_a_byte(shard(s)),
                                  "__1_0.distcp does not match its checksum (bytes changed since the save)"),
    "shard grown": (lambda s: shard(s).open("ab").write(b"x"), "__1_0.distcp holds "),
    "truncated without a manifest": (lambda s: ((s / dcp_steps.MANIFEST).unlink(), cut_in_half(shard(s))),
                                     "__1_0.distcp is truncated ("),
    "missing .metadata": (lambda s: (s / ".metadata").unlink(), None),
    "truncated .metadata": (lambda s: cut_in_half(s / ".metadata"), ".metadata is unreadable (UnpicklingError)"),
    "empty folder": (lambda s: (shutil.rmtree(s), s.mkdir()), None),
}  # fmt: skip


def damaged_copy(run, tmp_path: Path, damage) -> tuple[Path, int, int]:
    """The run's checkpoint folder, copied, its newest finished step damaged: (folder, that step, the one before)."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(run.dump_folder / "checkpoint", folder)
    *_, older, newest = finished_steps(run)
    damage(folder / f"step-{newest}")
    return folder, newest, older


def signature(folder: Path) -> dict:
    return {p: (p.stat().st_size, p.read_bytes()) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_step_stops_naming_the_file_and_the_step_to_load(interrupted, tmp_path, layout, case):
    damage, phrase = DAMAGES[case]
    folder, newest, older = damaged_copy(interrupted[layout], tmp_path, damage)
    before = signature(folder)
    if phrase is None:  # an unfinished save: passed over, as torchtitan does, and named
        found = dcp_steps.resume_from(str(folder), -1, "stop")
        assert found.path == str(folder / f"step-{older}")
        assert f"step-{newest} (unfinished: no .metadata)" in found.passed_over, found.passed_over
    else:
        with pytest.raises(ConfigError) as info:
            dcp_steps.resume_from(str(folder), -1, "stop")
        message = str(info.value)
        assert "\n" not in message and f"step-{newest} is damaged: " in message and phrase in message, message
        assert f"--checkpoint.load_step {older} (steps with every file at full size: " in message, message
        if case == "bytes flipped within size":  # found by the one rank that sums that file: skip stops too
            with pytest.raises(ConfigError, match=re.escape(message)):
                dcp_steps.resume_from(str(folder), -1, "skip")
        else:  # what every rank sees alike: skip passes over it
            found = dcp_steps.resume_from(str(folder), -1, "skip")
            assert found.path == str(folder / f"step-{older}")
            assert any(p.startswith(f"step-{newest} (damaged: ") and phrase in p for p in found.passed_over), found
        asked = f"--checkpoint.load_step={newest}: step-{newest} in .*: {re.escape(phrase)}"
        with pytest.raises(ConfigError, match=asked):
            dcp_steps.resume_from(str(folder), newest, "skip")  # the step asked for: never passed over
    assert signature(folder) == before  # nothing on disk changes


def test_resuming_past_a_damaged_step_warns_once_and_trains_on(interrupted, tmp_path):
    run = interrupted["fsdp2"]
    folder, newest, older = damaged_copy(run, tmp_path, lambda s: cut_in_half(shard(s)))
    damaged = signature(folder / f"step-{newest}")
    resumed = torchrun(CONFIG, tmp_path, *JOB, *LAYOUTS["fsdp2"][0], "--training.steps", str(older + 1),
                       "--checkpoint.interval", "1000", "--titan_ext.damaged_checkpoint", "skip", nproc=2).check()
    warnings = [line for line in resumed.output.splitlines() if "passed over" in line]
    assert len(warnings) == 1 and " - WARNING - titan_ext: " in warnings[0], resumed.output[-4000:]
    assert f"step-{newest} (damaged: __1_0.distcp is truncated" in warnings[0], warnings[0]
    assert warnings[0].endswith(f"resuming from step-{older}"), warnings[0]
    loads = [line for line in resumed.output.splitlines() if "Loading the checkpoint from" in line]
    assert loads and all(line.rstrip(".").endswith(f"step-{older}") for line in loads), loads
    assert [m["step"] for m in resumed.metrics] == [older + 1]
    assert signature(folder / f"step-{newest}") == damaged
