"""Checks of an HF model directory a job loads: its config.json, complete safetensors files, an index naming no
missing shard, and tensor shapes the model's own, read from the files' headers alone."""

from __future__ import annotations

import json
import os

from titan_ext.errors import ConfigError


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
