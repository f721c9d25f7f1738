"""Model args: an HF config as data. A flavor is an instance; nothing heavy is imported until a model is built."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import os
from typing import Any

from torchtitan.protocols.model import BaseModelArgs

from titan_ext.errors import ConfigError, config_boundary
from titan_ext.inputs import hf_config
from titan_ext.models.architecture import Architecture, architecture_of, causal_lm_classes, library_of
from titan_ext.models.structure import Structure, structure_of

logger = logging.getLogger()

HF_CONFIG_OPTION = "--titan_ext.hf_config"


def load_hf_config_json(path: str, option: str = HF_CONFIG_OPTION) -> dict[str, Any]:
    """Read an HF ``config.json`` (or the one inside a directory), with one-line errors."""
    option = f"{option}={path!r}"
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{option} is a directory without config.json; point it at an HF config.json or "
                              "the model directory holding one")
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


BOOKKEEPING = {
    "_name_or_path", "architectures", "auto_map", "chunk_size_feed_forward", "dtype", "id2label",
    "is_encoder_decoder", "label2id", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict", "torch_dtype", "transformers_version", "use_cache", "quantization_config",
}
"""Keys every HF config carries that describe no architecture (``quantization_config``: how a checkpoint's weights
were stored; titan_ext trains, and exports, full-precision weights)."""


def architecture_fields(config_class: type, given: dict[str, Any]) -> dict[str, Any]:
    """The architecture ``given`` (a config.json) sets, read through its config class.

    The class maps older spellings onto today's fields (e.g. Llama's
    rope_theta/rope_scaling -> rope_parameters); a field is kept when the file
    names it or the mapping changed it from the class default.
    """
    read = config_class(**copy.deepcopy(given)).to_dict()
    defaults = config_class().to_dict()
    return {
        key: value for key, value in read.items()
        if key not in BOOKKEEPING and (key in given or value != defaults.get(key))
    }


@dataclasses.dataclass
class HFModelArgs(BaseModelArgs):
    """One model: the library whose Auto classes build it, and its HF config fields.

    ``config`` holds ``model_type`` and the fields that differ from the config
    class's defaults. A generic spec's blank flavor has an empty ``config``
    until ``[titan_ext] hf_config`` (or the HF assets' config.json) fills it.
    """

    library: str = "fla"
    """``fla`` or ``transformers``: the library whose Auto classes the train spec looks ``model_type`` up in (a
    model type of the other one is refused: ``causal_lm_classes``); whether a model is fla's is ``library_of``."""
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    kernel_path: str = ""
    """The kernels an fla model runs (``titan_ext.kernels``): set from the job's plan; empty outside a job
    (fla's on CUDA, portable elsewhere)."""

    def __setattr__(self, name: str, value) -> None:
        # ``args.num_heads = 2`` would set an attribute nothing reads
        if name not in {field.name for field in dataclasses.fields(self)}:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}; set config[{name!r}] instead")
        super().__setattr__(name, value)

    @property
    def kernels_to_bind(self) -> str:
        """The kernel path a model built from these args runs: the job plan's, else (outside a job)
        ``kernels.default_path``."""
        from titan_ext import kernels

        return self.kernel_path or kernels.default_path()

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def classes(self, source: str = "--model.flavor") -> tuple[type, type]:
        """(HF config class, HF causal-LM class)."""
        return causal_lm_classes(self.model_type, self.library, source)

    @property
    def hf_config_class(self) -> type:
        return self.classes()[0]

    @property
    def hf_model_class(self) -> type:
        return self.classes()[1]

    @property
    def arch(self) -> Architecture:
        return architecture_of(self.hf_config_class)

    def architecture(self) -> dict[str, Any]:
        """The config fields a checkpoint records (no training-only overrides)."""
        return {key: copy.deepcopy(value) for key, value in self.config.items() if key != "model_type"}

    def checkpoint_config(self):
        """The HF config a checkpoint records: the architecture without training-only overrides."""
        return self.hf_config_class(**self.architecture())

    def to_hf_config(self):
        """The config the model is built from: the architecture and what training forces (over what a
        checkpoint's config.json says, e.g. GLA-340M's ``fuse_cross_entropy``)."""
        return self.hf_config_class(**{**self.architecture(), **self.arch.config_overrides(self.hf_model_class)})

    def update_from_hf_config(self, given: dict[str, Any], source: str) -> None:
        """Take the architecture of a config.json: it sets the model type of a blank flavor, and overrides
        a named flavor's fields (whose model type it must match)."""
        model_type = given.get("model_type")
        if self.model_type and model_type is not None and model_type != self.model_type:
            raise ConfigError(
                f"{source}: model_type {model_type!r} does not match this flavor's {self.model_type!r}; "
                "pick the train spec and flavor for that architecture (e.g. --model.name='fla' or 'hf', which "
                "take any model type)"
            )
        if not self.model_type and not model_type:
            raise ConfigError(f"{source} has no model_type; an HF config.json names its architecture there")
        config_class, _ = causal_lm_classes(self.model_type or model_type, self.library, source)
        hf_config.check_hf_config_fields(given, config_class, source)
        fields = architecture_fields(config_class, {k: v for k, v in given.items() if k != "model_type"})
        self.config = {**self.config, "model_type": self.model_type or model_type, **fields}

    @config_boundary
    def update_from_config(self, job_config, **kwargs) -> None:
        """torchtitan's hook: ``read_job_config``, a bad config ending the job in one line. In a titan_ext
        job the train specs' args also plan the job here (``titan_ext.host.job.JobModelArgs``)."""
        self.read_job_config(job_config)

    def read_job_config(self, job_config) -> None:
        """Apply ``[titan_ext] hf_config`` (or, for a blank flavor, the HF assets' config.json)."""
        path = getattr(getattr(job_config, "titan_ext", None), "hf_config", "")
        if path:
            self.update_from_hf_config(load_hf_config_json(path), f"{HF_CONFIG_OPTION}={path!r}")
        elif not self.model_type:
            assets = job_config.model.hf_assets_path
            if not (assets and os.path.isfile(os.path.join(assets, "config.json"))):
                raise ConfigError(
                    f"--model.name={job_config.model.name!r} takes the architecture from a config.json; set "
                    f"{HF_CONFIG_OPTION} (a config.json or HF directory) or --model.hf_assets_path to a directory "
                    "holding one, or pick a named --model.flavor"
                )
            option = "--model.hf_assets_path"
            self.update_from_hf_config(load_hf_config_json(assets, option), f"{option}={assets!r}")
        self.classes()  # an unknown model type is one line here

    def build_context(self):
        """``kernels.host_patches.BUILD`` while an fla model is constructed (fla's Attention, in the transformer and
        in hybrids, refuses to be built without flash-attn)."""
        if library_of(self.hf_config_class) == "fla":
            from titan_ext.kernels.host_patches import building

            return building()
        return contextlib.nullcontext()

    def structure(self) -> Structure:
        """Where the model these args build keeps its parts, and each layer's token mixer (``models.structure``),
        read from the model built on the meta device (once per architecture)."""
        return _structure(self.library, json.dumps(self.config, sort_keys=True))

    def layer_mixers(self) -> tuple:
        """Each layer's token mixer (``titan_ext.models.mixers``), by index."""
        return self.structure().mixers

    def document_mask_blocker(self) -> str | None:
        return self.structure().document_mask_blocker(self.to_hf_config())

    def context_parallel_blocker(self) -> str | None:
        return self.structure().context_parallel_blocker(self.to_hf_config())

    def ring_attention_blocker(self) -> str | None:
        return self.structure().ring_attention_blocker(self.to_hf_config())

    def mixer_flops_per_token(self, seq_len: int) -> int:
        return self.structure().mixer_flops_per_token(self.to_hf_config(), seq_len)[0]

    def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
        """Parameters, and training FLOPs per token: 6 per matmul weight plus the mixer's term.

        Embedding lookups are not matmuls, so the input embedding is left out
        of the 6N term (unless it is tied to the output head, which is one).
        A token runs ``top_k`` of a MoE layer's experts: the others' weights are left out too.
        """
        nparams = sum(p.numel() for p in model.parameters())
        embedding = model.get_input_embeddings().weight.numel()
        matmul_params = nparams if model.structure.tied else nparams - embedding
        matmul_params -= idle_expert_params(model)
        mixer, uncounted = model.structure.mixer_flops_per_token(model.config, seq_len)
        if uncounted:
            logger.warning(
                f"titan_ext: no FLOP count beyond their weights for the token mixers of layers {uncounted} "
                f"({model.mixers[uncounted[0]].name}); MFU counts 6 FLOPs per matmul weight there"
            )
        return nparams, 6 * matmul_params + mixer


@functools.lru_cache(maxsize=16)
def _structure(library: str, config: str) -> Structure:
    import torch

    args = HFModelArgs(library=library, config=json.loads(config))
    with args.build_context(), torch.device("meta"):
        return structure_of(args.hf_model_class(args.to_hf_config()))


def idle_expert_params(model) -> int:
    """Expert weights a token does not use: of a MoE block's ``experts`` (stacked ``[E, ...]`` weights, beside
    a router ``gate`` that picks ``top_k``), all but ``top_k / E`` of them."""
    idle = 0
    for block in model.modules():
        gate = getattr(block, "gate", None)
        if hasattr(block, "experts") and hasattr(gate, "top_k"):
            weights = sum(p.numel() for p in block.experts.parameters())
            idle += weights - weights * gate.top_k // gate.num_experts
    return idle


def fla_model(model_type: str, **fields) -> HFModelArgs:
    """A flavor of an fla model."""
    return HFModelArgs(library="fla", config={"model_type": model_type, **fields})


def transformers_model(model_type: str, **fields) -> HFModelArgs:
    """A flavor of a transformers model."""
    return HFModelArgs(library="transformers", config={"model_type": model_type, **fields})
