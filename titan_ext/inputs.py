"""Checks of the inputs a user hands a job: files, checkpoints, HF configs, numbers and names.

Each check is pure and fast (no model, no tensor loads, no process group) and
runs before any expensive work. A bad input raises ``ConfigError`` with one
line: the option and its value, what is wrong, and after a semicolon the fix.
torchtitan would otherwise fail late (after building and sharding the model,
or mid-load) with an assert, a ``KeyError`` or an unpickling traceback.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import itertools
import json
import math
import os
import re
import sys
import types
import typing

from titan_ext.errors import ConfigError

# ---------------------------------------------------------------- JSON-lines datasets


def _require_file(path: str, where: str, fix: str) -> None:
    """A directory or a missing path would fail later as an obscure ``OSError``."""
    if os.path.isdir(path):
        raise ConfigError(f"{where} is a directory, not a file; {fix}")
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file; {fix}")


def _jsonl_record(raw: bytes, number: int, text_field: str, where: str, fix: str) -> dict:
    """One line of a JSON-lines dataset, parsed: an object with a string text field."""
    try:
        record = json.loads(raw)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        raise ConfigError(f"{where}: line {number} is not JSON; {fix}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: line {number} is a JSON {type(record).__name__}, not an object; {fix}")
    if text_field not in record:
        raise ConfigError(f"{where}: line {number} has no {text_field!r} field; {fix}")
    if not isinstance(record[text_field], str):
        kind = type(record[text_field]).__name__
        raise ConfigError(f"{where}: line {number} has a {text_field!r} field of type {kind}, not a string; {fix}")
    return record


def _jsonl_records(path: str, text_field: str, option: str, max_lines: int | None):
    """Yield the checked records of the first ``max_lines`` lines (all when None); blank lines are skipped."""
    where = f"{option}={path!r}"
    fix = f"give a JSON-lines file whose every line is a JSON object with a string {text_field!r} field"
    if os.path.isdir(path):  # a folder of shards is what the streaming dataset reads
        section = option.removeprefix("--").split(".")[0]
        raise ConfigError(f"{where} is a directory; a folder of shards is read by --{section}.dataset "
                          f"titan_ext_stream (parquet, JSON lines or arrow), or give one JSON-lines file")
    _require_file(path, where, fix)
    with open(path, "rb") as f:
        for number, raw in enumerate(itertools.islice(f, max_lines), start=1):
            if raw.strip():
                yield _jsonl_record(raw, number, text_field, where, fix)


def _require_records(count: int, path: str, text_field: str, option: str) -> None:
    """An empty dataset makes torchtitan's infinite data loader spin forever without a batch."""
    if count == 0:
        raise ConfigError(
            f"{option}={path!r} holds no records (no non-blank line); "
            f"give a JSON-lines file with at least one object with a string {text_field!r} field"
        )


def check_jsonl_dataset(
    path: str, text_field: str = "text", option: str = "--training.dataset_path", max_lines: int | None = 1000
) -> None:
    """Preflight a JSON-lines dataset: its first ``max_lines`` lines (None: all) must be records."""
    count = sum(1 for _ in _jsonl_records(path, text_field, option, max_lines))
    _require_records(count, path, text_field, option)


def load_jsonl_records(path: str, text_field: str = "text", option: str = "--training.dataset_path") -> list[dict]:
    """Every record of a JSON-lines dataset; the first bad line (or no line) is a ``ConfigError``."""
    records = list(_jsonl_records(path, text_field, option, None))
    _require_records(len(records), path, text_field, option)
    return records


# ---------------------------------------------------------------- HF config.json overrides

# Integer sizes and float ratios/epsilons that only make sense when positive.
_POSITIVE = (
    "hidden_size", "num_hidden_layers", "num_heads", "num_attention_heads", "num_kv_heads",
    "num_key_value_heads", "vocab_size", "intermediate_size", "head_dim", "max_position_embeddings",
    "conv_size", "expand_k", "expand_v", "hidden_ratio", "norm_eps", "rms_norm_eps",
)  # fmt: skip

# (part, whole, waived_by): ``part`` must divide ``whole`` unless ``waived_by`` is given.
_DIVIDES = (
    ("num_heads", "hidden_size", "head_dim"),
    ("num_attention_heads", "hidden_size", "head_dim"),
    ("num_kv_heads", "num_heads", None),
    ("num_key_value_heads", "num_attention_heads", None),
)

# Hub metadata that transformers keeps verbatim but that describes no architecture.
_HF_METADATA = {"auto_map"}


def _consumes(config_class, key: str, value) -> bool:
    """Whether the class reads ``key``: an older spelling (Llama's ``rope_theta``, ``torch_dtype``)
    is mapped onto another field and dropped, while an unknown key is kept verbatim in ``to_dict()``."""
    try:  # a copy: transformers writes into nested dicts it is given (Llama's rope_scaling gains rope_theta)
        return key not in config_class(**{key: copy.deepcopy(value)}).to_dict()
    except Exception:  # the class validated the key itself (and rejected this value): it knows it
        return True


def _check_keys(config: dict, config_class, source: str) -> None:
    """A misspelled key would be ignored silently (HF configs keep unknown keys as attributes)."""
    known = {*config_class().to_dict(), *config_class.attribute_map, *_HF_METADATA}
    for key, value in config.items():
        if key in known or _consumes(config_class, key, value):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        fix = f"rename it to {close[0]!r}" if close else "remove it"
        raise ConfigError(f"{source} has unknown key {key!r} ({config_class.__name__} does not read it); {fix}")


def _options(annotation) -> tuple:
    """The alternatives of ``X | Y`` / ``Optional[X]``, else just the annotation."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_instance(value, kind) -> bool:
    """JSON's view of a type: bool is not an int, an int is a valid float, None only for ``None``.

    A TypedDict is a dict; a ``Literal`` holds its values.
    """
    if typing.get_origin(kind) is typing.Literal:
        return value in typing.get_args(kind)
    kind = dict if typing.is_typeddict(kind) else typing.get_origin(kind) or kind
    if kind is typing.Any or value is None:
        return kind is typing.Any or kind is type(None)
    if isinstance(value, bool) or kind is bool:
        return isinstance(value, bool) and kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(kind, type) and isinstance(value, kind)


def field_types(config_class) -> dict[str, object]:
    """The annotated types of a config class's ``__init__`` arguments, where they resolve.

    Annotations are strings in some modeling files (``from __future__ import
    annotations``) and may name what the module never imports; those are skipped.
    """
    import torch

    namespace = {**vars(typing), "torch": torch, **vars(sys.modules[config_class.__module__])}
    resolved = {}
    for name, annotation in inspect.get_annotations(config_class.__init__).items():
        try:
            resolved[name] = eval(annotation, namespace) if isinstance(annotation, str) else annotation
        except Exception:  # an annotation naming what its module does not import: not checked
            continue
    return resolved


def _check_types(config: dict, config_class, source: str) -> None:
    """A wrong JSON type would surface deep in model construction (or silently, e.g. ``true`` as 1)."""
    for name, hint in field_types(config_class).items():
        if name not in config or name == "return":
            continue
        value, options = config[name], _options(hint)
        if not any(_is_instance(value, kind) for kind in options):
            needs = " | ".join("None" if k is type(None) else getattr(k, "__name__", str(k)) for k in options)
            raise ConfigError(
                f"{source}: {name}={value!r} has type {type(value).__name__}, {name} needs {needs}; "
                "fix the value in the file"
            )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_values(config: dict, source: str) -> None:
    """Sizes the model cannot be built with: non-positive, or heads that do not split the width."""
    for key in _POSITIVE:
        if _is_number(config.get(key)) and config[key] <= 0:
            raise ConfigError(f"{source}: {key}={config[key]!r} must be > 0; set a positive value")
    for part, whole, waived_by in _DIVIDES:
        a, b = config.get(part), config.get(whole)
        if waived_by and config.get(waived_by) is not None:
            continue
        if _is_number(a) and _is_number(b) and a > 0 and b % a:
            raise ConfigError(
                f"{source}: {whole}={b} is not divisible by {part}={a}; "
                f"pick a {part} that divides {whole}" + (f" or give {waived_by}" if waived_by else "")
            )


def check_hf_config_fields(config: dict, config_class, source: str) -> None:
    """Check an HF config.json that overrides a flavor: known keys, JSON types, buildable sizes.

    Divisibility is checked among the keys ``config`` holds; pass the flavor's
    architecture merged with the overrides to check the resulting model.
    """
    _check_keys(config, config_class, source)
    _check_types(config, config_class, source)
    _check_values(config, source)


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


def dataloader_resume_degree(job_config) -> int | None:
    """How many data-parallel ranks saved the dataloader positions this job resumes (from its own checkpoint
    folder, dataloader not excluded), or None."""
    checkpoint = job_config.checkpoint
    if "dataloader" in checkpoint.exclude_from_loading or not os.path.exists(
            os.path.join(job_config.job.dump_folder, checkpoint.folder)):
        return None
    found = checkpoint_to_load(job_config)
    return dcp_dataloader_ranks(found[0]) or None if found and found[1] == "dcp" else None


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


# ---------------------------------------------------------------- numbers and parallel degrees


# The degrees whose product must be the world size, in torchtitan's ParallelDims order.
_MESH = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "context_parallel_degree",
         "tensor_parallel_degree", "pipeline_parallel_degree")  # fmt: skip


def _degrees_at_least_one(parallelism) -> None:
    """torchtitan asserts these with a bare ``AssertionError`` while building the mesh."""
    for name in (*_MESH, "expert_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(parallelism, name)
        if name == "data_parallel_shard_degree" and value == -1:
            continue
        if value < 1:
            allowed = "-1 (the remaining ranks) or >= 1" if name == "data_parallel_shard_degree" else ">= 1"
            raise ConfigError(f"--parallelism.{name}={value} must be {allowed}; use 1 to turn it off")


def check_positive_numbers(job_config) -> None:
    """Zero or negative sizes make torchtitan divide by zero, build empty batches or skip training."""
    _degrees_at_least_one(job_config.parallelism)
    training = job_config.training
    for name in ("seq_len", "local_batch_size", "steps"):
        value = getattr(training, name)
        if value <= 0:
            raise ConfigError(f"--training.{name}={value} must be positive; set a positive integer")
    if training.global_batch_size == 0 or training.global_batch_size < -1:
        raise ConfigError(
            f"--training.global_batch_size={training.global_batch_size} is invalid; "
            "set a positive multiple of local batch x data-parallel degree, or -1 for exactly that"
        )


def _product_text(parallelism, names) -> str:
    """``--parallelism.a=2 x --parallelism.b=2``: the shard degree and the degrees that are not 1."""
    shown = [n for n in names if getattr(parallelism, n) != 1 or n == "data_parallel_shard_degree"]
    return " x ".join(f"--parallelism.{n}={getattr(parallelism, n)}" for n in shown)


def shard_degree(parallelism, world_size: int) -> int:
    """The FSDP degree the mesh gets: ``-1`` takes the ranks the other degrees leave."""
    others = [n for n in _MESH if n != "data_parallel_shard_degree"]
    rest = math.prod(getattr(parallelism, n) for n in others)
    shard = parallelism.data_parallel_shard_degree
    if shard == -1 and world_size % rest:
        raise ConfigError(
            f"{_product_text(parallelism, others)} = {rest} ranks does not divide the {world_size} ranks torchrun "
            f"started (WORLD_SIZE), so --parallelism.data_parallel_shard_degree=-1 has no whole value; "
            f"pick degrees whose product divides {world_size}"
        )
    if shard == -1:
        return world_size // rest
    if rest * shard != world_size:
        raise ConfigError(
            f"{_product_text(parallelism, _MESH)} = {rest * shard} ranks, but torchrun started {world_size} "
            f"(WORLD_SIZE); make the product {world_size}, e.g. --parallelism.data_parallel_shard_degree=-1 "
            "to use the rest"
        )
    return shard


def _check_expert_degrees(parallelism, shard: int) -> None:
    """torchtitan's expert mesh: etp is 1 or tp, and ep x etp splits dp_shard x cp x tp."""
    ep, etp, tp = (parallelism.expert_parallel_degree, parallelism.expert_tensor_parallel_degree,
                   parallelism.tensor_parallel_degree)  # fmt: skip
    if ep == 1:
        return
    if etp not in (1, tp):
        raise ConfigError(
            f"--parallelism.expert_tensor_parallel_degree={etp} must be 1 or "
            f"--parallelism.tensor_parallel_degree={tp} when --parallelism.expert_parallel_degree={ep}; set one"
        )
    dense = shard * parallelism.context_parallel_degree * tp
    if dense % (ep * etp):
        raise ConfigError(
            f"--parallelism.expert_parallel_degree={ep} x --parallelism.expert_tensor_parallel_degree={etp} "
            f"does not divide data_parallel_shard x context_parallel x tensor_parallel = {dense}; "
            f"pick expert degrees whose product divides {dense}"
        )


def _check_global_batch(training, data_parallel: int) -> None:
    """torchtitan asserts this only after building the model."""
    step = training.local_batch_size * data_parallel
    if training.global_batch_size > 0 and training.global_batch_size % step:
        raise ConfigError(
            f"--training.global_batch_size={training.global_batch_size} is not a multiple of "
            f"--training.local_batch_size={training.local_batch_size} x {data_parallel} data-parallel ranks "
            f"= {step}; set a multiple of {step}, or -1"
        )


def check_parallel_degrees(job_config, world_size: int) -> None:
    """The degrees torchtitan's ``ParallelDims`` accepts for ``world_size`` ranks, and a batch they split."""
    parallelism = job_config.parallelism
    _degrees_at_least_one(parallelism)
    shard = shard_degree(parallelism, world_size)
    _check_expert_degrees(parallelism, shard)
    _check_global_batch(job_config.training, parallelism.data_parallel_replicate_degree * shard)


# ---------------------------------------------------------------- registry names

AC_MODES = ("none", "full", "selective", "memory_budget")
COMPILE_COMPONENTS = ("model", "loss")
# Names users try for torchtitan's float8 converter.
_CONVERTER_ALIASES = {"float8": "quantize.linear.float8", "fp8": "quantize.linear.float8"}


def _check_choice(where: str, value: str, choices, noun: str, suggestion: str | None = None) -> None:
    """A name missing from a registry: say so, suggest the closest name, list them all."""
    choices = sorted(choices)
    if value in choices:
        return
    close = difflib.get_close_matches(value, choices, n=1)
    suggestion = suggestion or (close[0] if close else None)
    use = f"use {suggestion!r} (choices: {', '.join(choices)})" if suggestion else f"use one of {', '.join(choices)}"
    raise ConfigError(f"{where} is not a {noun}; {use}")


def _compile_backends() -> set[str]:
    import torch._dynamo

    return {*torch._dynamo.list_backends(exclude_tags=()), "inductor"}


def _converter_names() -> set[str]:
    """torchtitan's converter registry, filled by importing the modules that register them."""
    import torchtitan.components.quantization  # noqa: F401  (registers quantize.*)
    from torchtitan.protocols.model_converter import _registry_model_converter_cls

    return set(_registry_model_converter_cls)


def check_names(job_config) -> None:
    """Names torchtitan looks up late (a ``KeyError`` after model build) or never validates from a TOML."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    dataset = job_config.training.dataset
    _check_choice(f"--training.dataset={dataset!r}", dataset, DATASETS, "registered dataset")
    if job_config.validation.enable:
        dataset = job_config.validation.dataset
        _check_choice(f"--validation.dataset={dataset!r}", dataset, DATASETS, "registered dataset")
    mode = job_config.activation_checkpoint.mode
    _check_choice(f"--activation_checkpoint.mode={mode!r}", mode, AC_MODES, "mode")
    backend = job_config.compile.backend
    _check_choice(f"--compile.backend={backend!r}", backend, _compile_backends(), "torch.compile backend")
    for component in job_config.compile.components:
        _check_choice(f"--compile.components: {component!r}", component, COMPILE_COMPONENTS, "component")
    if job_config.model.converters:
        names = _converter_names()
        for name in job_config.model.converters:
            alias = _CONVERTER_ALIASES.get(name)
            _check_choice(f"--model.converters: {name!r}", name, names, "converter name", alias)
