"""Checks of the torch DCP step folders a job saves and loads: the manifest each save writes (every storage file's
size and CRC-32), what makes a step unloadable, and which step (or initial checkpoint) a job loads, with its
dataloader positions."""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from titan_ext import compat
from titan_ext.errors import ConfigError


MANIFEST = ".titan_ext_manifest.json"
"""Written into a step folder by titan_ext's save (``manifest_before_metadata``): each storage file's size and CRC-32,
so a load also finds bytes changed within a file's size."""
_CHUNK = 8 << 20


def _has_metadata(path: str) -> bool:
    """torchtitan's test for a complete DCP save: ``.metadata`` is written last."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def _metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


def _read_dcp_metadata(path: str, where: str):
    """The metadata of a step folder ``check_dcp_step`` passed (a torn pickle would raise anything)."""
    try:
        return _metadata(path)
    except Exception as error:  # noqa: BLE001
        raise ConfigError(f"{where}: .metadata is unreadable ({type(error).__name__}); point it at a whole step") from None


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _crc32s(folder: str, names: list[str]) -> list[int]:
    """In threads: zlib lets go of the GIL while it sums a chunk (~1.8 GB/s per core)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda name: _crc32(os.path.join(folder, name)), names))


def _write_json(path: str, content: dict) -> None:
    """Atomically (a rename, as DCP's own ``.metadata``)."""
    with open(path + ".tmp", "w") as f:
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _records(folder: str, names) -> dict[str, dict[str, int]]:
    names = sorted(set(names))
    return {name: {"bytes": os.path.getsize(os.path.join(folder, name)), "crc32": crc}
            for name, crc in zip(names, _crc32s(folder, names))}


def recording_checksums(write_data):
    """DCP's ``FileSystemWriter.write_data`` on each rank, then the size and CRC-32 of the files this rank wrote,
    read back while the page cache still holds them, as a piece of the step's manifest: no rank reads another's
    files."""

    def write_then_record(self, plan, planner):
        future = write_data(self, plan, planner)
        names = {result.storage_data.relative_path for result in future.wait()}
        if names:
            _write_json(os.path.join(os.fspath(self.path), f"{MANIFEST}.{min(names)}"),
                        {"files": _records(os.fspath(self.path), names)})
        return future

    return write_then_record


def manifest_before_metadata(finish):
    """DCP's ``FileSystemWriter.finish``, run by rank 0 once every rank's files are written, writes
    ``.metadata``: the ranks' manifest pieces are joined into the step's manifest first (a file no piece covers
    is read here), so every finished step titan_ext saved has one."""

    def finish_with_manifest(self, metadata, results):
        folder = os.fspath(self.path)
        pieces = [os.path.join(folder, name) for name in os.listdir(folder)
                  if name.startswith(f"{MANIFEST}.") and not name.endswith(".tmp")]
        files = {}
        for piece in pieces:
            with open(piece) as f:
                files.update(json.load(f)["files"])
        written = compat.dcp_written_files(results)
        files.update(_records(folder, written - set(files)))
        _write_json(os.path.join(folder, MANIFEST), {"files": {name: files[name] for name in sorted(written)}})
        for piece in pieces:
            os.remove(piece)
        finish(self, metadata, results)

    return finish_with_manifest


def _read_manifest(path: str) -> dict | None:
    """``{file: {"bytes", "crc32"}}``; None for a step saved without titan_ext's manifest."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)["files"]
    except FileNotFoundError:
        return None


def _short_or_missing(path: str, needed: dict[str, int]) -> str | None:
    """The first file (by name) that is absent or shorter than the bytes it must hold."""
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        size = os.path.getsize(file)
        if size < end:
            return f"{name} is truncated ({size} of {end} bytes)"
    return None


def _size_damage(path: str, manifest: dict | None) -> str | None:
    """What a look at the files alone finds: no or an unreadable ``.metadata``, a file it names missing or cut
    short (the largest offset + length of its entries), or, with a manifest, a size changed since the save."""
    if not _has_metadata(path):
        return "no .metadata: an unfinished save"
    try:
        needed = compat.dcp_storage_extents(_metadata(path))
    except Exception as error:  # noqa: BLE001  (a torn or foreign pickle raises anything)
        return f".metadata is unreadable ({type(error).__name__})"
    if manifest is None:
        return _short_or_missing(path, needed)
    damage = _short_or_missing(path, {**needed, **{name: entry["bytes"] for name, entry in manifest.items()}})
    if damage:
        return damage
    for name, entry in sorted(manifest.items()):
        size = os.path.getsize(os.path.join(path, name))
        if size != entry["bytes"]:
            return f"{name} holds {size} bytes, {entry['bytes']} when saved"
    return None


def _signature(path: str) -> tuple:
    """The folder's files with their sizes and modification times: a verdict holds while these do."""
    if not os.path.isdir(path):
        return ()
    return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))


@functools.lru_cache(maxsize=64)
def _damage(path: str, signature: tuple, share: tuple[int, int] | None) -> str | None:
    try:
        manifest = _read_manifest(path)
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    damage = _size_damage(path, manifest)
    if damage or share is None or manifest is None:
        return damage
    rank, world = share
    names = sorted(manifest)[rank::world]
    for name, crc in zip(names, _crc32s(path, names)):
        if crc != manifest[name]["crc32"]:
            return f"{name} does not match its checksum (bytes changed since the save)"
    return None


def _share() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them: rank r reads the checksums of every world-th file of a step, so a
    job reads its checkpoint once in all, not once per rank."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def step_damage(path: str, full: bool = True) -> str | None:
    """What makes a DCP step folder unloadable, naming the file, or None for a whole step. Every rank checks each
    file's size against the ``.metadata`` (and, for a step saved by titan_ext, against its manifest); each rank
    checks the checksums of its share of the files (``_share``: a changed byte stops the rank that reads it).
    ``full=False``: sizes only, the same verdict on every rank."""
    return _damage(path, _signature(path), _share() if full else None)


def check_dcp_step(path: str, where: str, fix: str) -> None:
    damage = "no such folder" if not os.path.isdir(path) else step_damage(path)
    if damage:
        raise ConfigError(f"{where}: {damage}; {fix}")


def check_dcp_checkpoint(path: str, expected: dict[str, tuple[int, ...]], where: str) -> None:
    """The DCP step folder (whole: ``check_dcp_step``) holds every parameter the model needs, with the model's
    shape.

    ``expected`` maps FQNs (``model.layers.0.attn.q_proj.weight``) to shapes;
    other entries (optimizer, lr_scheduler, dataloader, train_state) are ignored.
    """
    stored = _read_dcp_metadata(path, where).state_dict_metadata
    fix = "load a checkpoint of this --model.name/--model.flavor, or start a new --job.dump_folder"
    missing = [key for key in expected if not hasattr(stored.get(key), "size")]  # absent, or not a tensor
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{where} was written by another model or flavor: no {missing[0]!r}{more}; {fix}")
    for key, shape in expected.items():
        if list(stored[key].size) != list(shape):
            raise ConfigError(
                f"{where} holds {key!r} of shape {list(stored[key].size)}, this model needs {list(shape)}; {fix}"
            )


def dataloader_to_load(job_config) -> str | None:
    """The DCP checkpoint whose dataloader positions torchtitan 0.2.2's ``CheckpointManager.load`` restores,
    or None: a step-0 save (a seed checkpoint) and an initial checkpoint with ``initial_load_model_only`` load
    the model alone, ``exclude_from_loading`` may drop the dataloader, and fault tolerance keeps its own."""
    checkpoint = job_config.checkpoint
    if "dataloader" in checkpoint.exclude_from_loading:
        return None
    ft = getattr(job_config, "fault_tolerance", None)
    if getattr(ft, "enable", False) and checkpoint.enable_ft_dataloader_checkpoints:
        return None
    found = checkpoint_to_load(job_config)
    if not found or found[1] != "dcp":  # an HF checkpoint holds the model only
        return None
    path = found[0]
    if not os.path.exists(os.path.join(job_config.job.dump_folder, checkpoint.folder)):  # the initial checkpoint
        return None if checkpoint.initial_load_model_only else path
    return None if os.path.basename(path) == "step-0" else path  # torchtitan: ``model_only = step == 0``


def dataloader_resume_degree(job_config) -> int | None:
    """How many data-parallel ranks saved the dataloader positions this job loads (``dataloader_to_load``), or
    None."""
    path = dataloader_to_load(job_config)
    return dcp_dataloader_ranks(path) or None if path else None


def dcp_dataloader_ranks(path: str) -> int:
    """How many data-parallel ranks saved a dataloader position in this DCP checkpoint (torchtitan's
    ``ParallelAwareDataloader`` keys each rank's state ``dataloader.dp_rank_<n>``); 0 when none did."""
    keys = _read_dcp_metadata(path, repr(path)).state_dict_metadata
    return sum(1 for key in keys if re.fullmatch(r"dataloader\.dp_rank_\d+", key))


# ---------------------------------------------------------------- which checkpoint a job loads

DAMAGED_OPTION = "--titan_ext.damaged_checkpoint"
DAMAGED_CHOICES = ("stop", "skip")


def damaged_checkpoint_policy(job_config) -> str:
    """``[titan_ext] damaged_checkpoint``: what resuming does when its step is damaged."""
    policy = getattr(getattr(job_config, "titan_ext", None), "damaged_checkpoint", "stop")
    if policy not in DAMAGED_CHOICES:
        raise ConfigError(f"{DAMAGED_OPTION}={policy!r} is not one of {DAMAGED_CHOICES}; use one of them")
    return policy


def _step_folders(folder: str) -> dict[int, str]:
    """Every ``step-N`` entry of the checkpoint folder (torchtitan's pattern), by step."""
    found = {}
    for name in os.listdir(folder):
        match = re.search(r"step-(\d+)", name)
        if match:
            found[int(match.group(1))] = os.path.join(folder, name)
    return found


def _finished(path: str) -> bool:
    """torchtitan's ``_find_load_step``: a DCP ``.metadata``, or an HF index (saved last)."""
    return _has_metadata(path) or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))


def _complete_steps(folder: str) -> list[int]:
    """Step numbers torchtitan would resume from (its ``_find_load_step``): finished saves only."""
    return sorted(step for step, path in _step_folders(folder).items() if _finished(path))


def _whole(path: str, full: bool = True) -> bool:
    """A finished step whose files are all there (an HF step is checked by its own loader's check)."""
    return not _has_metadata(path) or step_damage(path, full) is None


@dataclass(frozen=True)
class Resume:
    """The step folder a job resumes from (None: none, it trains from step 1) and the newer step folders it
    passes over, each with why."""

    path: str | None
    passed_over: tuple[str, ...] = ()


def _damaged_step(folder: str, step: int, damage: str, steps: dict[int, str]) -> ConfigError:
    older = [s for s in sorted(steps) if s < step and _finished(steps[s]) and _whole(steps[s], full=False)]
    fix = (f"resume from an older step with --checkpoint.load_step {older[-1]} (steps with every file at full size: "
           f"{', '.join(map(str, older))}), or set {DAMAGED_OPTION} skip to resume from the newest whole step"
           if older else f"no older step is whole: move {folder!r} aside to train from step 1")
    return ConfigError(f"--checkpoint.folder={folder!r}: step-{step} is damaged: {damage}; {fix}")


def resume_from(folder: str, load_step: int, policy: str) -> Resume:
    """The step torchtitan resumes from, ``load_step`` or else its latest finished save, checked whole (a damaged
    one stops, or with ``policy`` "skip" gives way to the newest whole step); newer unfinished saves are passed
    over, as torchtitan does."""
    steps = _step_folders(folder)
    if load_step != -1:
        if load_step not in steps or not _finished(steps[load_step]):
            raise ConfigError(
                f"--checkpoint.load_step={load_step}: no readable step-{load_step} in {folder!r} "
                f"(complete steps: {_complete_steps(folder)}); pick one of those, or -1 for the latest"
            )
        if _has_metadata(steps[load_step]):
            check_dcp_step(steps[load_step], f"--checkpoint.load_step={load_step}: step-{load_step} in {folder!r}",
                           "pick another step (--checkpoint.load_step), or -1 for the latest whole one")
        return Resume(steps[load_step])
    passed = []
    for step in sorted(steps, reverse=True):
        path = steps[step]
        if not _finished(path):
            passed.append(f"step-{step} (unfinished: no .metadata)")
            continue
        # "skip" passes over what every rank sees alike (sizes); a changed byte, found by one rank, stops the job
        damage = step_damage(path, full=False) if _has_metadata(path) else None
        if damage is None:
            if _has_metadata(path) and (changed := step_damage(path)):
                raise _damaged_step(folder, step, changed, steps)
            return Resume(path, tuple(passed))
        if policy == "stop":
            raise _damaged_step(folder, step, damage, steps)
        passed.append(f"step-{step} (damaged: {damage})")
    return Resume(None, tuple(passed))


def newest_whole_step(folder: str) -> int:
    """The step a resume with ``damaged_checkpoint`` "skip" loads, -1 for none (torchtitan's
    ``_find_load_step``'s answer)."""
    path = resume_from(folder, -1, "skip").path
    return -1 if path is None else int(re.search(r"step-(\d+)", os.path.basename(path)).group(1))


def newest_whole_step_finder(find_load_step):
    """torchtitan's ``CheckpointManager._find_load_step`` for the checkpoint folder: the newest whole step."""

    def find_whole_step(self, folder: str = "") -> int:
        if folder and folder != self.folder:  # fault tolerance's own folder
            return find_load_step(self, folder)
        return newest_whole_step(self.folder)

    return find_whole_step


def _initial_checkpoint(checkpoint, hf_assets_path: str) -> tuple[str, str] | None:
    """What torchtitan loads when the run has no checkpoint folder yet."""
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_model_only:
        raise ConfigError(
            "--checkpoint.initial_load_in_hf loads only the model; set --checkpoint.initial_load_model_only"
        )
    if checkpoint.initial_load_in_hf:
        return checkpoint.initial_load_path or hf_assets_path, "hf"
    if not checkpoint.initial_load_path:
        return None
    path = checkpoint.initial_load_path
    check_dcp_step(path, f"--checkpoint.initial_load_path={path!r}",
                   "point it at a whole DCP step folder (its .metadata and every file that names)")
    return path, "dcp"


def resume(job_config) -> Resume | None:
    """What a job resumes from in its checkpoint folder; None when it has none yet (or checkpointing is off, or
    it creates a seed checkpoint)."""
    checkpoint = job_config.checkpoint
    if not checkpoint.enable or checkpoint.create_seed_checkpoint:  # a seed run only saves
        return None
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if not os.path.exists(folder):
        return None
    return resume_from(folder, checkpoint.load_step, damaged_checkpoint_policy(job_config))


def checkpoint_to_load(job_config) -> tuple[str, str] | None:
    """``(path, "dcp" | "hf")`` that torchtitan 0.2.2's ``CheckpointManager.load`` will read, or None.

    As in torchtitan, once ``{dump_folder}/{checkpoint.folder}`` exists the
    initial checkpoint is ignored; a folder holding only unfinished saves
    (no ``.metadata``) loads nothing, so a crashed first save restarts cleanly.
    The step it loads must be whole (``resume_from``).
    With ``initial_load_in_hf`` and no ``initial_load_path`` the path is
    ``model.hf_assets_path``. Unlike torchtitan, a ``load_step`` without a
    checkpoint folder is an error rather than silently ignored.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable or checkpoint.create_seed_checkpoint:  # a seed run only saves
        return None
    found = resume(job_config)
    if found is not None:
        return (found.path, "dcp") if found.path else None
    if checkpoint.load_step != -1:
        folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
        raise ConfigError(
            f"--checkpoint.load_step={checkpoint.load_step} but {folder!r} does not exist; "
            "check --job.dump_folder and --checkpoint.folder, or use --checkpoint.load_step=-1"
        )
    return _initial_checkpoint(checkpoint, job_config.model.hf_assets_path)


def rerun_resumes_from(job_config) -> str:
    """What the same command run again would load, in words, by torchtitan's rule (its newest finished step;
    not checked whole: for a job's last line, not for loading)."""
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return "trains from step 1 again (checkpointing is off: --checkpoint.enable)"
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    steps = _complete_steps(folder) if os.path.isdir(folder) else []
    if steps:
        return f"resumes from {os.path.join(folder, f'step-{steps[-1]}')}"
    if checkpoint.initial_load_path or checkpoint.initial_load_in_hf:
        return f"starts again from {checkpoint.initial_load_path or job_config.model.hf_assets_path}"
    return "trains from step 1 again (no checkpoint saved yet)"
