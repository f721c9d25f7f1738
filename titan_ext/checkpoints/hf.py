"""HF checkpoints in and out of torchtitan: ``--checkpoint.initial_load_in_hf`` / ``last_save_in_hf``.

titan_ext models keep transformers' (or fla's) parameter names and layout, so torchtitan's state dict goes over
in the model's names; the hub's own layout (one tensor per expert, ...) is read and written through transformers'
checkpoint conversion (``titan_ext.checkpoints.hub_layout``): on import by the safetensors reader, on export by rewriting the
folder when the job closes. A tied head's weight is in neither side's state dict (HF's safetensors and titan_ext's
models both hold the shared tensor once, under the input embedding's name; ``titan_ext.models.adapter``).

Before the model is built, ``titan_ext.host.preflight`` checks a checkpoint to be
loaded against the model (``check_hf_config``; DCP shapes against a meta model). After
an HF save, torchtitan's folder holds only the weights (and its per-rank
``sharded/`` parts): ``finish_hf_export`` makes it a self-contained HF
directory in the hub's layout (``config.json``, the tokenizer files, no ``sharded/``) when the
job closes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_ext.checkpoints import hub_layout, strided
from titan_ext.errors import ConfigError
from titan_ext.models.args import BOOKKEEPING

# Fields that change neither the parameters nor the math: a checkpoint may differ in them.
_NOT_ARCHITECTURE = {"initializer_range", "attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy",
                     "fuse_linear_cross_entropy", "bos_token_id", "eos_token_id", "pad_token_id"}


def checkpoint_config(model_args):
    """The HF config a checkpoint records: the architecture without training-only overrides."""
    return model_args.checkpoint_config()


class HFStateDictAdapter(StateDictAdapter):
    """torchtitan's state dict in the model's names; HF folders in the hub's layout (``titan_ext.checkpoints.hub_layout``)."""

    def __init__(self, model_args, hf_assets_path: str | None):
        from titan_ext.inputs.assets import resolve_asset_path

        path = resolve_asset_path(hf_assets_path or "")
        # torchtitan warns when the assets lack a safetensors index; without one it writes a single file anyway.
        has_index = bool(path) and os.path.isfile(os.path.join(path, hub_layout.INDEX))
        super().__init__(model_args, path if has_index else None)
        self.model_args = model_args
        if self.fqn_to_index_mapping:  # the assets' index names hub tensors: each model tensor goes to its sources' file
            plan = hub_layout.import_plan(self.meta_model, path)
            self.fqn_to_index_mapping = hub_layout.model_index(plan, self.fqn_to_index_mapping,
                                                                self.meta_model.state_dict())

    @functools.cached_property
    def meta_model(self):
        from titan_ext.models.adapter import meta_model

        return meta_model(self.model_args)

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        return hub_layout.HubReader(path, hub_layout.import_plan(self.meta_model, path))

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # experts split over TP (a strided layout) go over as one box per rank (titan_ext.checkpoints.strided)
        self.strided = {key: value for key, value in state_dict.items() if strided.is_strided(value)}
        return {key: strided.one_box(value) if key in self.strided else value
                for key, value in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        # A tied head shares the embedding's tensor, so loading the embedding loads both.
        exported = getattr(self, "strided", {})
        return {key: strided.laid_out_as(value, exported[key]) if key in exported else value
                for key, value in hf_state_dict.items()}

    def hf_config(self):
        return checkpoint_config(self.model_args)


def check_hf_config(model_args, path: str) -> None:
    """Fail in one line when the HF directory's architecture differs from the flavor's."""
    source = f"--checkpoint.initial_load_path={path!r}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{source} has no config.json; point it at an HF model directory (config.json + safetensors)")
    theirs = model_args.hf_config_class.from_pretrained(path).to_dict()
    ours = checkpoint_config(model_args).to_dict()
    if theirs.get("model_type") != ours["model_type"]:
        raise ConfigError(
            f"{source} holds a {theirs.get('model_type')!r} model, not {ours['model_type']!r}; "
            "pick the train spec (--model.name) for that architecture"
        )
    fields = sorted(set(ours) - BOOKKEEPING - _NOT_ARCHITECTURE)
    diffs = [f"{k}={ours.get(k)!r} (flavor) vs {theirs.get(k)!r} (checkpoint)" for k in fields if ours.get(k) != theirs.get(k)]
    if diffs:
        raise ConfigError(
            f"{source}: config.json does not match --model.flavor: {'; '.join(diffs)}; "
            "pick the matching flavor or pass --titan_ext.hf_config with that config.json"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "tiktoken.model")


def tokenizer_files(hf_assets_path: str) -> list[str]:
    """The tokenizer files of an assets folder an export carries: ``TOKENIZER_FILES`` and the Python modules its
    ``tokenizer_config.json``'s ``auto_map`` names (Kimi's ``tokenization_kimi.py``): with an ``auto_map``,
    transformers' ``AutoTokenizer`` loads the tokenizer from them, as from the hub folder."""
    names = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_assets_path, name))]
    try:
        with open(os.path.join(hf_assets_path, "tokenizer_config.json")) as f:
            auto_map = json.load(f).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return names
    for entry in auto_map.values():
        for reference in entry if isinstance(entry, list) else [entry]:
            module = f"{reference.split('.')[0]}.py" if isinstance(reference, str) and "." in reference else None
            if module and module not in names and os.path.isfile(os.path.join(hf_assets_path, module)):
                names.append(module)
    return names


def last_hf_save(checkpoint_dir: str) -> str | None:
    """The newest ``step-N`` folder holding consolidated safetensors, or None."""
    steps = []
    for name in os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []:
        folder = os.path.join(checkpoint_dir, name)
        if re.fullmatch(r"step-\d+", name) and any(f.endswith(".safetensors") for f in os.listdir(folder)):
            steps.append((int(name.split("-")[1]), folder))
    return max(steps)[1] if steps else None


def finish_hf_export(model_args, checkpoint_dir: str, hf_assets_path: str) -> str | None:
    """Make the last HF save a self-contained HF directory: config.json, tokenizer files, no ``sharded/``."""
    folder = last_hf_save(checkpoint_dir)
    if folder is None:
        return None
    from titan_ext.models.adapter import meta_model

    hub_layout.to_hub_layout(meta_model(model_args), folder)
    checkpoint_config(model_args).save_pretrained(folder)
    for name in tokenizer_files(hf_assets_path) if hf_assets_path else []:
        shutil.copy(os.path.join(hf_assets_path, name), folder)
    shutil.rmtree(os.path.join(folder, "sharded"), ignore_errors=True)
    return folder
