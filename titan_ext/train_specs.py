"""The train specs titan_ext registers with torchtitan, one per architecture."""

from __future__ import annotations

from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.validate import build_validator
from torchtitan.hf_datasets.text_datasets import build_text_dataloader
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from titan_ext.data import build_tokenizer
from titan_ext.metrics import build_metrics_processor
from titan_ext.models.gla import GLAForTitan, gla_flavors
from titan_ext.parallelize import parallelize_hf_model


def hf_train_spec(model_cls, flavors, state_dict_adapter=None) -> TrainSpec:
    return TrainSpec(
        model_cls=model_cls,
        model_args=flavors,
        parallelize_fn=parallelize_hf_model,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_text_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_validator_fn=build_validator,
        build_metrics_processor_fn=build_metrics_processor,
        state_dict_adapter=state_dict_adapter,
    )


TRAIN_SPECS = {
    "fla_gla": lambda: hf_train_spec(GLAForTitan, gla_flavors),
}


def register_train_specs() -> None:
    for name, build in TRAIN_SPECS.items():
        register_train_spec(name, build())
