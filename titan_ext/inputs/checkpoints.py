"""Checks of the checkpoints a job loads: HF safetensors directories, torch DCP folders, and which one a job loads."""

from __future__ import annotations

import json
import os
import re

from titan_ext.errors import ConfigError


# ---------------------------------------------------------------- HF safetensors directories


def _read_json_object(path: str, where: str, fix: str) -> dict:
    """A JSON file that must hold an object (``config.json``, a safetensors index)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{where} has no {name}; {fix}")
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except ValueError:
        raise ConfigError(f"{where}: {name} is not valid JSON; {fix}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {name} holds no JSON object; {fix}")
    return value


def _safetensors_end(path: str) -> int | None:
    """Bytes the file must hold per its header (8-byte length, JSON header, data); None if unreadable."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else size
        if length > size - 8:
            return None
        try:
            header = json.loads(f.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # not the documented layout
            return None
    return 8 + length + max(ends, default=0)


def _check_safetensors(path: str, where: str) -> None:
    """A partial download or an interrupted save fails here, not mid-load with a Rust error."""
    name, size = os.path.basename(path), os.path.getsize(path)
    needed = _safetensors_end(path)
    if needed is None:
        raise ConfigError(f"{where}: {name} has no readable safetensors header; download or save it again")
    if needed > size:
        raise ConfigError(f"{where}: {name} is truncated ({size} of {needed} bytes); download or save it again")
    if needed < size:  # safetensors refuses a file its header does not cover exactly
        raise ConfigError(f"{where}: {name} has {size - needed} stray bytes after its data; download or save it again")


def _check_index(path: str, where: str, fix: str) -> None:
    """A sharded checkpoint's index must not name a shard that is missing."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return
    for shard in sorted(set(_read_json_object(index, where, fix).get("weight_map", {}).values())):
        if not os.path.isfile(os.path.join(path, shard)):
            raise ConfigError(f"{where}: model.safetensors.index.json names {shard}, which is missing; download it")


def check_hf_checkpoint_dir(path: str, option: str = "--checkpoint.initial_load_path") -> None:
    """An HF model directory: a config.json object and complete ``*.safetensors`` files."""
    where = f"{option}={path!r}"
    fix = "point it at an HF model directory (config.json + *.safetensors)"
    if not os.path.isdir(path):
        raise ConfigError(f"{where} is not a directory; {fix}")
    _read_json_object(os.path.join(path, "config.json"), where, fix)
    files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{where} holds no *.safetensors file; {fix}")
    for name in files:
        _check_safetensors(os.path.join(path, name), where)
    _check_index(path, where, fix)


def safetensors_shapes(path: str) -> dict[str, tuple[str, list[int]]]:
    """Each tensor of an HF directory's safetensors files: name -> (file, shape), from the headers alone."""
    shapes = {}
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        with open(os.path.join(path, name), "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        shapes.update({key: (name, entry["shape"]) for key, entry in header.items() if key != "__metadata__"})
    return shapes


def check_hf_checkpoint_shapes(path: str, expected: dict[str, tuple[int, ...]], option: str) -> None:
    """Every tensor of the HF checkpoint that the model has, with the model's shape (a config.json that
    matches tensors of another size loads as a size-mismatch traceback on every rank)."""
    for key, (file, shape) in safetensors_shapes(path).items():
        if key in expected and list(expected[key]) != list(shape):
            raise ConfigError(
                f"{option}={path!r}: {file} holds {key!r} of shape {list(shape)}, this model needs "
                f"{list(expected[key])}; its config.json does not describe its weights: fix it or re-export the checkpoint"
            )


# ---------------------------------------------------------------- torch DCP checkpoints


def _has_metadata(path: str) -> bool:
    """torchtitan's test for a complete DCP save: ``.metadata`` is written last."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def _read_dcp_metadata(path: str, option: str):
    """The checkpoint's metadata, or one line instead of an unpickling traceback."""
    from torch.distributed.checkpoint import FileSystemReader

    where = f"{option}={path!r}"
    if not _has_metadata(path):
        raise ConfigError(
            f"{where} holds no readable checkpoint (no .metadata); point it at a complete DCP step folder"
        )
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as error:  # a torn or foreign pickle raises anything
        raise ConfigError(
            f"{where}: .metadata is unreadable ({type(error).__name__}), the save was cut short or the file "
            f"is corrupt; point {option} at another step or delete this one"
        ) from None


def check_dcp_checkpoint(path: str, expected: dict[str, tuple[int, ...]], option: str) -> None:
    """The DCP folder holds every parameter the model needs, with the model's shape.

    ``expected`` maps FQNs (``model.layers.0.attn.q_proj.weight``) to shapes;
    other entries (optimizer, lr_scheduler, dataloader, train_state) are ignored.
    """
    stored = _read_dcp_metadata(path, option).state_dict_metadata
    where = f"{option}={path!r}"
    fix = f"point {option} at a checkpoint of this --model.name/--model.flavor, or start a new --job.dump_folder"
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
    keys = _read_dcp_metadata(path, "--checkpoint.folder").state_dict_metadata
    return sum(1 for key in keys if re.fullmatch(r"dataloader\.dp_rank_\d+", key))


def _complete_steps(folder: str) -> list[int]:
    """Step numbers torchtitan would resume from (its ``_find_load_step``): finished saves only."""
    steps = []
    for name in os.listdir(folder):
        match = re.search(r"step-(\d+)", name)
        full = os.path.join(folder, name)
        if match and (_has_metadata(full) or os.path.isfile(os.path.join(full, "model.safetensors.index.json"))):
            steps.append(int(match.group(1)))
    return sorted(steps)


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
    _read_dcp_metadata(checkpoint.initial_load_path, "--checkpoint.initial_load_path")
    return checkpoint.initial_load_path, "dcp"


def _resume_step(folder: str, load_step: int) -> str | None:
    """The step folder torchtitan resumes from: ``load_step``, else the latest finished save."""
    steps = _complete_steps(folder)
    if load_step != -1 and load_step not in steps:
        raise ConfigError(
            f"--checkpoint.load_step={load_step}: no readable step-{load_step} in {folder!r} "
            f"(complete steps: {steps}); pick one of those, or -1 for the latest"
        )
    if not steps:
        return None
    return os.path.join(folder, f"step-{load_step if load_step != -1 else steps[-1]}")


def checkpoint_to_load(job_config) -> tuple[str, str] | None:
    """``(path, "dcp" | "hf")`` that torchtitan 0.2.2's ``CheckpointManager.load`` will read, or None.

    As in torchtitan, once ``{dump_folder}/{checkpoint.folder}`` exists the
    initial checkpoint is ignored; a folder holding only unfinished saves
    (no ``.metadata``) loads nothing, so a crashed first save restarts cleanly.
    With ``initial_load_in_hf`` and no ``initial_load_path`` the path is
    ``model.hf_assets_path``. Unlike torchtitan, a ``load_step`` without a
    checkpoint folder is an error rather than silently ignored.
    """
    checkpoint = job_config.checkpoint
    if not checkpoint.enable or checkpoint.create_seed_checkpoint:  # a seed run only saves
        return None
    folder = os.path.join(job_config.job.dump_folder, checkpoint.folder)
    if os.path.exists(folder):
        path = _resume_step(folder, checkpoint.load_step)
        return (path, "dcp") if path else None
    if checkpoint.load_step != -1:
        raise ConfigError(
            f"--checkpoint.load_step={checkpoint.load_step} but {folder!r} does not exist; "
            "check --job.dump_folder and --checkpoint.folder, or use --checkpoint.load_step=-1"
        )
    return _initial_checkpoint(checkpoint, job_config.model.hf_assets_path)
