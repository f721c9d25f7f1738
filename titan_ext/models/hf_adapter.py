"""torchtitan's model contract over a Hugging Face causal LM class.

An adapted model keeps the HF parameter names (so HF checkpoints load with an
identity mapping) and adds what torchtitan's trainer calls: construction from
a model-args dataclass on the meta device, ``init_weights`` after
``to_empty``, and ``forward(tokens) -> logits``. Labels are never passed to
the HF forward: torchtitan's labels are already shifted, and its loss is a
sum over tokens that the trainer normalizes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torchtitan.protocols.model import BaseModelArgs

from titan_ext.float8 import configure_float8
from titan_ext.preflight import check_job


def load_hf_config_json(path: str) -> dict[str, Any]:
    """Read an HF ``config.json`` (or the one inside a directory), with one-line errors."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"--titan_ext.hf_config={path!r}: no such file; "
            "point it at an HF config.json or the directory holding one"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--titan_ext.hf_config={path!r} is not valid JSON ({e}); fix or replace the file") from None
    if not isinstance(config, dict):
        raise ValueError(f"--titan_ext.hf_config={path!r} holds no JSON object; expected an HF config.json")
    return config


@dataclasses.dataclass
class HFModelArgs(BaseModelArgs):
    """Architecture fields of one HF config class; a flavor is an instance.

    Subclasses declare the fields (named exactly as in the HF config), the
    config class, and the token-mixer FLOPs; everything else is shared.
    """

    hf_config_class: ClassVar[type]

    # Fields every HF config passes through unchanged.
    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @property
    def model_type(self) -> str:
        return self.hf_config_class.model_type

    def architecture(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_enforced"}

    def hf_config_overrides(self) -> dict[str, Any]:
        """Config fields forced by training under torchtitan (e.g. no fused loss in the model)."""
        return {}

    def to_hf_config(self):
        return self.hf_config_class(**self.architecture(), **self.hf_config_overrides())

    def update_from_hf_config(self, config: dict[str, Any], source: str) -> None:
        model_type = config.get("model_type")
        if model_type is not None and model_type != self.model_type:
            raise ValueError(
                f"{source}: model_type {model_type!r} does not match this train spec's {self.model_type!r}; "
                "pick the train spec for that architecture"
            )
        # Read it through the HF config class, which maps older spellings onto
        # today's fields (e.g. Llama's rope_theta/rope_scaling -> rope_parameters).
        given = self.hf_config_class(**config).to_dict()
        defaults = self.hf_config_class().to_dict()
        for field in dataclasses.fields(self):
            key = field.name
            if key in given and (key in config or given[key] != defaults.get(key)):
                setattr(self, key, given[key])

    def update_from_config(self, job_config, **kwargs) -> None:
        """Apply ``[titan_ext] hf_config``, then check the job against the result.

        torchtitan calls this right before building the model, so it is where
        a bad config fails: early, and in one line.
        """
        section = getattr(job_config, "titan_ext", None)
        if section is not None and section.hf_config:
            path = section.hf_config
            self.update_from_hf_config(load_hf_config_json(path), f"--titan_ext.hf_config={path!r}")
        configure_float8(job_config, self.model_type)
        check_job(self, job_config)

    def mixer_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the token mixer beyond its projections."""
        raise NotImplementedError

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters, and training FLOPs per token: 6 per matmul weight plus the mixer's term.

        Embedding lookups are not matmuls, so the input embedding is left out
        of the 6N term (unless it is tied to the output head, which is one).
        """
        nparams = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight.numel()
        matmul_params = nparams if self.tie_word_embeddings else nparams - embedding
        return nparams, 6 * matmul_params + self.mixer_flops_per_token(seq_len)


class TitanCausalLM:
    """Mixin placed before an HF ``*ForCausalLM`` class in the bases.

    ``class GLAForTitan(TitanCausalLM, GLAForCausalLM)`` yields a module
    with the HF layout and torchtitan's contract.
    """

    def __init__(self, model_args: HFModelArgs):
        super().__init__(model_args.to_hf_config())
        self.model_args = model_args

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=tokens, use_cache=False, return_dict=True).last_hidden_state
        return self.lm_head(hidden)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and buffer in place (also on DTensor shards).

        HF's own initializer skips modules it marks as initialized; torchtitan
        calls this after ``to_empty``, when every tensor holds garbage, so each
        module's ``_init_weights`` runs unconditionally.
        """
        for module in self.modules():
            self._init_weights(module)
        if self.config.tie_word_embeddings:
            self.tie_weights()
        if buffer_device is not None:
            move_buffers(self, buffer_device)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Put every buffer (e.g. rotary ``inv_freq``) on ``device``: with CPU offload, parameters
    stay on the CPU while buffers must sit where the forward runs."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))
