"""HF checkpoints in and out of torchtitan: ``--checkpoint.initial_load_in_hf`` / ``last_save_in_hf``.

titan_ext models keep HF's parameter names, so the state-dict mapping is the
identity except for tied embeddings: HF's safetensors hold the shared tensor
once, under the input embedding's name.

Before the model is built, ``titan_ext.preflight`` checks the directory's
``config.json`` against the flavor (``check_hf_config``). Saving adds the ``config.json`` that torchtitan never writes:
the adapter never learns the output directory, so ``install_hf_config_export()`` wraps
``CheckpointManager.dcp_save``, the one place that knows both the directory
and that it is an HF save, and rank 0 writes the config after the tensors.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_ext.models.hf_adapter import HFModelArgs

# Fields that change neither the parameters nor the math: a checkpoint may differ in them.
_NOT_ARCHITECTURE = {"initializer_range", "attn_mode", "fuse_norm", "fuse_swiglu"}


def checkpoint_config(model_args: HFModelArgs):
    """The HF config a checkpoint records: the architecture without training-only overrides."""
    return model_args.hf_config_class(**model_args.architecture())


class HFStateDictAdapter(StateDictAdapter):
    """Identity mapping between a titan_ext model and its HF checkpoint, minus tied duplicates."""

    def __init__(self, model_args: HFModelArgs, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.model_args = model_args

    def _tied_key(self) -> str | None:
        # Every HF causal LM names its output head ``lm_head``.
        return "lm_head.weight" if self.model_args.tie_word_embeddings else None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        tied = self._tied_key()
        return {k: v for k, v in state_dict.items() if k != tied}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        # The head shares the embedding's tensor, so loading the embedding loads both.
        return dict(hf_state_dict)

    def hf_config(self):
        return checkpoint_config(self.model_args)

    def save_hf_config(self, directory: str) -> None:
        self.hf_config().save_pretrained(directory)


def check_hf_config(model_args: HFModelArgs, path: str) -> None:
    """Fail in one line when the HF directory's architecture differs from the flavor's."""
    source = f"--checkpoint.initial_load_path={path!r}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{source} has no config.json; point it at an HF model directory (config.json + safetensors)")
    theirs = model_args.hf_config_class.from_pretrained(path).to_dict()
    ours = checkpoint_config(model_args).to_dict()
    if theirs.get("model_type") != ours["model_type"]:
        raise ValueError(
            f"{source} holds a {theirs.get('model_type')!r} model, not {ours['model_type']!r}; "
            "pick the train spec (--model.name) for that architecture"
        )
    fields = sorted(set(model_args.architecture()) - _NOT_ARCHITECTURE)
    diffs = [f"{k}={ours.get(k)!r} (flavor) vs {theirs.get(k)!r} (checkpoint)" for k in fields if ours.get(k) != theirs.get(k)]
    if diffs:
        raise ValueError(
            f"{source}: config.json does not match --model.flavor: {'; '.join(diffs)}; "
            "pick the matching flavor or pass --titan_ext.hf_config with that config.json"
        )


def install_hf_config_export() -> None:
    """Make HF saves through a titan_ext adapter write ``config.json`` (idempotent)."""
    original = CheckpointManager.dcp_save
    if getattr(original, "_titan_ext_writes_config", False):
        return

    @functools.wraps(original)
    def dcp_save(self, state_dict, checkpoint_id, *args, to_hf: bool = False, **kwargs):
        result = original(self, state_dict, checkpoint_id, *args, to_hf=to_hf, **kwargs)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if to_hf and rank0 and isinstance(self.sd_adapter, HFStateDictAdapter):
            self.sd_adapter.save_hf_config(checkpoint_id)
        return result

    dcp_save._titan_ext_writes_config = True
    CheckpointManager.dcp_save = dcp_save
