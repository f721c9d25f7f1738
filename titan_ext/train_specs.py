"""The train specs titan_ext registers with torchtitan, one per architecture."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator, Mapping

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.validate import build_validator
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
import torchtitan.protocols.train_spec as train_spec_module
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from titan_ext.checkpoint import HFStateDictAdapter, install_hf_config_export
from titan_ext.data import build_tokenizer
from titan_ext.metrics import build_metrics_processor
from titan_ext.models.gla import GLAForTitan, gla_flavors
from titan_ext.models.hf_adapter import HFModelArgs
from titan_ext.models.llama import LlamaForTitan, llama_flavors
from titan_ext.models.transformer import TransformerForTitan, transformer_flavors
from titan_ext.nonfinite import guard_optimizer_step, watch_loss
from titan_ext.parallelize import parallelize_hf_model


class Flavors(Mapping[str, HFModelArgs]):
    """One spec's flavors; each lookup returns a fresh copy.

    torchtitan mutates the args it looks up (``update_from_config``), so a
    shared instance would carry one job's overrides into the next job built
    in the same process. An unknown flavor fails naming the valid ones.
    """

    def __init__(self, spec_name: str, flavors: dict[str, HFModelArgs]):
        self.spec_name = spec_name
        self._flavors = flavors

    def __getitem__(self, flavor: str) -> HFModelArgs:
        if flavor not in self._flavors:
            raise ValueError(
                f"--model.flavor={flavor!r} is not a flavor of {self.spec_name}; choose one of {sorted(self._flavors)}"
            )
        return copy.deepcopy(self._flavors[flavor])

    def __iter__(self) -> Iterator[str]:
        return iter(self._flavors)

    def __len__(self) -> int:
        return len(self._flavors)


def hf_train_spec(name: str, model_cls, flavors, state_dict_adapter=None) -> TrainSpec:
    return TrainSpec(
        model_cls=model_cls,
        model_args=Flavors(name, flavors),
        parallelize_fn=parallelize_hf_model,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=guard_optimizer_step(build_lr_schedulers),
        build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=watch_loss(build_cross_entropy_loss),
        build_validator_fn=build_validator,
        build_metrics_processor_fn=build_metrics_processor,
        state_dict_adapter=state_dict_adapter,
    )


TRAIN_SPECS = {
    "fla_gla": lambda: hf_train_spec("fla_gla", GLAForTitan, gla_flavors, HFStateDictAdapter),
    "fla_transformer": lambda: hf_train_spec(
        "fla_transformer", TransformerForTitan, transformer_flavors, HFStateDictAdapter
    ),
    "hf_llama": lambda: hf_train_spec("hf_llama", LlamaForTitan, llama_flavors, HFStateDictAdapter),
}


def list_train_specs_on_unknown_name() -> None:
    """Make torchtitan's "TrainSpec X is not registered" name the option and the valid names."""
    original = train_spec_module.get_train_spec
    if getattr(original, "_titan_ext_lists_names", False):
        return

    @functools.wraps(original)
    def get_train_spec(name: str) -> TrainSpec:
        try:
            return original(name)
        except ValueError:
            from torchtitan.experiments import _supported_experiments
            from torchtitan.models import _supported_models

            names = sorted({*train_spec_module._extra_train_specs, *_supported_models, *_supported_experiments})
            raise ValueError(f"--model.name={name!r} is not a registered train spec; choose one of {names}") from None

    get_train_spec._titan_ext_lists_names = True
    train_spec_module.get_train_spec = get_train_spec


def register_train_specs() -> None:
    install_hf_config_export()  # torchtitan's HF saves lack config.json
    list_train_specs_on_unknown_name()
    for name, build in TRAIN_SPECS.items():
        register_train_spec(name, build())
