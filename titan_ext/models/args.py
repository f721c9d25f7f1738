"""Model args for HF causal LMs: a flavor is an instance; nothing heavy is imported until a model is built."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar

from torchtitan.protocols.model import BaseModelArgs

from titan_ext import inputs, job
from titan_ext.errors import ConfigError, config_boundary
from titan_ext.host_patches import resolve


def load_hf_config_json(path: str) -> dict[str, Any]:
    """Read an HF ``config.json`` (or the one inside a directory), with one-line errors."""
    option = f"--titan_ext.hf_config={path!r}"
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{option}: no such file; point it at an HF config.json or the directory holding one")
    try:
        with open(path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{option} is not valid JSON ({e}); fix or replace the file") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{option} holds no JSON object; expected an HF config.json")
    return config


@dataclasses.dataclass
class HFModelArgs(BaseModelArgs):
    """Architecture fields of one HF config class, named exactly as in that config.

    Subclasses give the config and model classes (import paths), the model
    type, their fields and the token mixer's FLOPs; everything else is shared.
    """

    model_type: ClassVar[str]
    hf_config: ClassVar[str]
    """Import path of the HF config class, e.g. ``"fla.models:GLAConfig"``."""
    hf_model: ClassVar[str]
    """Import path of the HF causal-LM class."""

    packed_layout: ClassVar[str] = "cu_seqlens"
    """How the model takes packed documents (``titan_ext.documents``): fla's
    ``cu_seqlens`` over one flattened row, or transformers' ``position_ids``."""

    cp_kernels: ClassVar[tuple[tuple[str, str], ...]] = ()
    """Context parallelism (``titan_ext.context_parallel``) for a recurrent mixer: the kernels it
    calls by global name, each with the name of its decay argument."""
    cp_attention: ClassVar[str] = ""
    """Context parallelism for softmax attention over all-gathered keys and values: ``"transformers"``
    (through the attention registry its modeling file reads) or ``"fla"`` (fla's ``Attention``)."""

    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @property
    def hf_config_class(self) -> type:
        return resolve(self.hf_config)

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
            raise ConfigError(
                f"{source}: model_type {model_type!r} does not match this train spec's {self.model_type!r}; "
                "pick the train spec (--model.name) for that architecture"
            )
        inputs.check_hf_config_fields(config, self.hf_config_class, type(self), source)
        # Read it through the HF config class, which maps older spellings onto
        # today's fields (e.g. Llama's rope_theta/rope_scaling -> rope_parameters).
        given = self.hf_config_class(**config).to_dict()
        defaults = self.hf_config_class().to_dict()
        for field in dataclasses.fields(self):
            key = field.name
            if key in given and (key in config or given[key] != defaults.get(key)):
                setattr(self, key, given[key])

    @config_boundary
    def update_from_config(self, job_config, **kwargs) -> None:
        """Apply ``[titan_ext] hf_config``, then plan the job (checks included).

        torchtitan calls this right before building the model: the last
        moment a bad config can fail cheaply.
        """
        path = getattr(getattr(job_config, "titan_ext", None), "hf_config", "")
        if path:
            self.update_from_hf_config(load_hf_config_json(path), f"--titan_ext.hf_config={path!r}")
        job.plan_job(self, job_config)

    def document_mask_blocker(self) -> str | None:
        """Why this model cannot keep packed documents apart (a one-line reason and fix), or None."""
        return None

    def context_parallel_blocker(self) -> str | None:
        """Why this model cannot split sequences across ranks (a one-line reason and fix), or None."""
        if not (self.cp_kernels or self.cp_attention):
            return f"titan_ext has no context-parallel path for {self.model_type!r} models yet; set it to 1"
        return None

    def mixer_flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token of the token mixer beyond its projections."""
        raise NotImplementedError

    def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
        """Parameters, and training FLOPs per token: 6 per matmul weight plus the mixer's term.

        Embedding lookups are not matmuls, so the input embedding is left out
        of the 6N term (unless it is tied to the output head, which is one).
        """
        nparams = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight.numel()
        matmul_params = nparams if self.tie_word_embeddings else nparams - embedding
        return nparams, 6 * matmul_params + self.mixer_flops_per_token(seq_len)
