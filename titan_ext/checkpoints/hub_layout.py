"""HF weights in the hub's own layout, in and out, through transformers' own checkpoint conversion.

transformers 5 loads a checkpoint through its model's conversion list (``conversion_mapping.py``): renamings, and
converters that build one model tensor from several checkpoint tensors (Qwen3-MoE's one tensor per expert ->
the fused ``mlp.experts.gate_up_proj``; Kimi Linear's q/k/v convolutions -> one ``conv1d``), and ``save_pretrained``
writes through their reverse. titan_ext models hold transformers' own modules, so their tensors are a converter's
targets:

- **import**: an ``ImportPlan`` says which hub tensors make each model tensor (transformers' ``rename_source_key``
  over the folder's keys, grouped as ``from_pretrained`` groups them). ``HubReader`` is torch's HF safetensors
  reader whose metadata names the model's tensors; asked for a box of one (a rank's shard under FSDP, TP or EP),
  it runs the converter's own operations over the hub tensors the box needs: for a stack of experts only the
  experts in the box, anything else whole and then cut. DCP loads every layout as from a checkpoint in the
  model's names; no rank holds more than one model tensor's sources at a time.
- **export**: torchtitan writes the model's names; ``to_hub_layout`` rewrites the folder on one rank, one
  safetensors file at a time, through transformers' ``revert_weight_conversion`` (what ``save_pretrained`` of a
  model built from its config writes), so one file's tensors are in memory at once.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan

from titan_ext import compat
from titan_ext.checkpoints.hf_files import safetensors_shapes

INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Converted:
    """A model tensor that a transformers converter makes from hub tensors."""

    converter: object
    """The converter (``WeightConverter``), as ``from_pretrained`` finds it for this tensor."""
    sources: tuple[tuple[str, tuple[str, ...]], ...]
    """(source pattern, the hub keys it matched, in transformers' order)."""

    def keys(self) -> tuple[str, ...]:
        return tuple(key for _, keys in self.sources for key in keys)

    def stacks_experts(self) -> bool:
        """Whether dim 0 of the target is the list of sources (experts) stacked, untouched by later operations:
        then a box of it needs only its own experts."""
        t = compat.transformers_weight_conversion()
        first, *rest = self.converter.operations
        return (isinstance(first, t.MergeModulelist) and first.dim == 0
                and all(isinstance(op, t.Concatenate) and op.dim > 0 for op in rest))


@dataclasses.dataclass(frozen=True)
class ImportPlan:
    """Where each model tensor comes from in a hub folder: one hub tensor (``renamed``), or a converter's
    (``converted``). Model tensors the folder does not hold are in neither."""

    renamed: dict[str, str]
    """Model key -> hub key (most often the same name)."""
    converted: dict[str, Converted]
    files: dict[str, str]
    """Hub key -> its safetensors file (a path)."""
    shapes: dict[str, tuple[int, ...]]
    """Hub key -> its shape (from the file's header)."""
    config: object
    """The model's HF config (some operations read it)."""

    def sources_of(self, key: str) -> tuple[str, ...]:
        return self.converted[key].keys() if key in self.converted else (self.renamed[key],)

    def missing(self, model_keys) -> list[str]:
        return [key for key in model_keys if key not in self.renamed and key not in self.converted]


def conversions(model) -> list:
    """The conversion list ``from_pretrained`` loads this model through (its legacy renamings included)."""
    return compat.transformers_weight_conversion().get_model_conversion_mapping(model)


def import_plan(model, folder: str) -> ImportPlan:
    """How the hub folder's tensors make ``model``'s (a meta model will do), as transformers'
    ``convert_and_load_state_dict_in_model`` pairs them."""
    t = compat.transformers_weight_conversion()
    transforms = conversions(model)
    renamings = [c for c in transforms if isinstance(c, t.WeightRenaming)]
    converters = [c for c in transforms if isinstance(c, t.WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    model_keys = {key: True for key in model.state_dict()}
    headers = safetensors_shapes(folder)
    files = {key: os.path.join(folder, file) for key, (file, _) in headers.items()}
    renamed, groups = {}, {}
    for key in sorted(files, key=t.dot_natural_key):
        target, pattern = t.rename_source_key(key, renamings, converters, model.base_model_prefix, model_keys)
        if target not in model_keys and key in model_keys:  # as transformers: a name the model holds as it is
            target, pattern = key, None
        if target not in model_keys:  # a tensor the model does not hold (e.g. a vision tower)
            continue
        if pattern is None:
            renamed[target] = key
        else:
            converter, sources = groups.setdefault(target, (by_pattern[pattern], {}))
            sources.setdefault(pattern, []).append(key)
    converted = {
        target: Converted(converter, tuple((p, tuple(sources[p])) for p in converter.source_patterns if p in sources))
        for target, (converter, sources) in groups.items()
    }
    return ImportPlan(renamed, converted, files, {key: tuple(shape) for key, (_, shape) in headers.items()}, model.config)


def converted_box(plan: ImportPlan, key: str, offsets, lengths) -> torch.Tensor:
    """The box ``offsets`` + ``lengths`` of model tensor ``key``, read from the hub tensors it is made of."""
    cut = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
    if key in plan.renamed:
        return _read_slice(plan, plan.renamed[key], cut)
    converted = plan.converted[key]
    sources = converted.sources
    if converted.stacks_experts():  # only the box's experts, then the box within them
        first, count = offsets[0], lengths[0]
        sources = tuple((pattern, keys[first:first + count]) for pattern, keys in sources)
        cut = (slice(0, count), *cut[1:])
    return _convert(plan, key, sources, lambda hub_key: _read_slice(plan, hub_key, ()))[cut]


def _convert(plan: ImportPlan, key: str, sources, read) -> torch.Tensor:
    """Model tensor ``key`` made by its converter's operations (a copy of it, as transformers makes one per
    target) from the hub tensors ``read`` gives."""
    converter = copy.deepcopy(plan.converted[key].converter)
    for pattern, keys in sources:
        for hub_key in keys:
            converter.add_tensor(key, hub_key, pattern, read(hub_key))
    made = converter.convert(key, config=plan.config)
    (tensor,) = made.values() if len(made) == 1 else (made[key],)
    return tensor


def _read_slice(plan: ImportPlan, hub_key: str, cut: tuple) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(plan.files[hub_key], framework="pt") as f:
        return f.get_slice(hub_key)[cut] if cut else f.get_tensor(hub_key)


class HubReader(HuggingFaceStorageReader):
    """torch's HF safetensors reader, in the model's names: each model tensor one chunk, read through the plan."""

    def __init__(self, path: str, plan: ImportPlan):
        super().__init__(path)
        self.plan = plan

    def read_metadata(self):
        metadata = super().read_metadata()
        for key, shape in target_shapes(self.plan).items():
            sources = self.plan.sources_of(key)
            if sources == (key,):  # the hub's name and layout: torch reads it
                continue
            zeros = torch.Size([0] * len(shape))
            metadata.state_dict_metadata[key] = TensorStorageMetadata(
                properties=metadata.state_dict_metadata[sources[0]].properties, size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=torch.Size(shape))])
            metadata.storage_data[MetadataIndex(fqn=key, offset=zeros)] = MAPPED
        return metadata

    def read_data(self, plan: LoadPlan, planner):
        mapped = [item for item in plan.items if self.storage_data[item.storage_index] is MAPPED]
        for item in mapped:
            box = converted_box(self.plan, item.storage_index.fqn, item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != box.size():
                raise AssertionError(f"{item.storage_index.fqn}: read {list(box.size())}, expected {list(target.size())}")
            target.copy_(box)
            planner.commit_tensor(item, target)
        rest = [item for item in plan.items if self.storage_data[item.storage_index] is not MAPPED]
        return super().read_data(dataclasses.replace(plan, items=rest), planner)


MAPPED = "titan_ext.checkpoints.hub_layout"
"""The storage entry of a model tensor that ``HubReader`` reads through its plan."""


def target_shapes(plan: ImportPlan) -> dict[str, tuple[int, ...]]:
    """Each model tensor's shape as the hub folder makes it, from the headers: a converter's operations run on
    meta tensors of its sources' shapes."""
    shapes = {}
    for key, hub_key in plan.renamed.items():
        shapes[key] = tuple(plan.shapes[hub_key])
    for key, converted in plan.converted.items():
        made = _convert(plan, key, converted.sources, lambda hub_key: torch.empty(plan.shapes[hub_key], device="meta"))
        shapes[key] = tuple(made.shape)
    return shapes


def model_index(plan: ImportPlan, hub_index: dict[str, int], model_keys) -> dict[str, int]:
    """torchtitan's ``fqn_to_index_mapping`` in the model's names: each model tensor goes to the file of its
    first hub source (a tensor the hub index lacks: the last file, never dropped by torch's consolidation)."""
    last = max(hub_index.values())
    return {key: hub_index.get(plan.sources_of(key)[0], last) if key in plan.renamed or key in plan.converted else last
            for key in model_keys}


def to_hub_layout(model, folder: str) -> None:
    """Rewrite an export in the model's names as ``save_pretrained`` lays it out, file by file: torchtitan puts
    every tensor of one hub tensor's group in one file (``model_index``), so each file converts alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    revert = compat.transformers_weight_conversion().revert_weight_conversion
    files = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    weight_map, total = {}, 0
    for name in files:
        path = os.path.join(folder, name)
        with safe_open(path, framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        tensors = {key: value.contiguous() for key, value in revert(model, tensors).items()}
        save_file(tensors, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(value.numel() * value.element_size() for value in tensors.values())
    if len(files) > 1 or os.path.isfile(os.path.join(folder, INDEX)):
        with open(os.path.join(folder, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)

