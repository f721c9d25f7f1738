"""The train specs titan_ext registers with torchtitan: one per shipped architecture, and ``fla``/``hf`` for any model."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

from titan_ext.errors import config_boundary
from titan_ext.host.job import JobModelArgs
from titan_ext.models.architecture import LIBRARIES
from titan_ext.models.args import HFModelArgs
from titan_ext.models.gated_deltanet import gated_deltanet_flavors
from titan_ext.models.gla import gla_flavors
from titan_ext.models.kda import kda_flavors
from titan_ext.models.llama import llama_flavors
from titan_ext.models.transformer import transformer_flavors


class Flavors(Mapping[str, HFModelArgs]):
    """One spec's flavors; each lookup returns a fresh copy.

    torchtitan mutates the args it looks up (``update_from_config``), so a
    shared instance would carry one job's overrides into the next job built
    in the same process. Each copy plans its job when torchtitan hands it the
    config (``JobModelArgs``). An unknown flavor is reported by preflight,
    before torchtitan looks it up.
    """

    def __init__(self, flavors: dict[str, HFModelArgs]):
        self._flavors = flavors

    def __getitem__(self, flavor: str) -> JobModelArgs:
        return JobModelArgs.of(copy.deepcopy(self._flavors[flavor]))

    def __iter__(self) -> Iterator[str]:
        return iter(self._flavors)

    def __len__(self) -> int:
        return len(self._flavors)


def hf_train_spec(flavors: dict[str, HFModelArgs]):
    """torchtitan's components, with titan_ext's where torchtitan's assume its own models."""
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.protocols.train_spec import TrainSpec

    from titan_ext import data
    from titan_ext.checkpoints.hf import HFStateDictAdapter
    from titan_ext.host import metrics, nonfinite
    from titan_ext.host.validate import build_validator
    from titan_ext.models.adapter import build_model
    from titan_ext.models.moe.bias_router import with_expert_bias_update
    from titan_ext.parallel.parallelize import parallelize_hf_model
    from titan_ext.parallel.pipeline import pipeline_hf_model

    return TrainSpec(
        model_cls=build_model,
        model_args=Flavors(flavors),
        parallelize_fn=config_boundary(parallelize_hf_model),
        pipelining_fn=config_boundary(pipeline_hf_model),
        build_optimizers_fn=with_expert_bias_update(build_optimizers),
        build_lr_schedulers_fn=nonfinite.guard_optimizer_step(build_lr_schedulers),
        build_dataloader_fn=config_boundary(data.build_dataloader),
        build_tokenizer_fn=config_boundary(data.build_tokenizer),
        build_loss_fn=config_boundary(nonfinite.build_watched_loss),
        build_validator_fn=config_boundary(build_validator),
        build_metrics_processor_fn=config_boundary(metrics.build_metrics_processor),
        state_dict_adapter=HFStateDictAdapter,
    )


NAMED = {
    "fla_gla": gla_flavors,
    "fla_gated_deltanet": gated_deltanet_flavors,
    "fla_kda": kda_flavors,
    "fla_transformer": transformer_flavors,
    "hf_llama": llama_flavors,
}
"""Train-spec name (torchtitan's ``--model.name``) -> its flavors (``--titan_ext.hf_config`` may override their
fields); one spec per shipped architecture module. Keyed by the name a job picks, not by model type: what a
model type is lives in ``models.architecture._ARCHITECTURES``, its TP plan in ``model_plans.registry``."""

FROM_CONFIG = "from_config"
"""A generic spec's flavor whose architecture is a config.json (``[titan_ext] hf_config`` or the HF assets')."""


def generic_flavors(library: str) -> dict[str, HFModelArgs]:
    """Any model of ``library``: ``from_config`` (also under torchtitan's default flavor name,
    ``debugmodel``), and every shipped flavor of that library as ``<model_type>-<flavor>``."""
    blank = HFModelArgs(library=library)
    shortcuts = {
        f"{args.model_type}-{flavor}": args
        for flavors in NAMED.values() for flavor, args in flavors.items() if args.library == library
    }
    return {FROM_CONFIG: blank, "debugmodel": blank, **shortcuts}


FLAVORS = {**NAMED, **{name: generic_flavors(library) for name, library in LIBRARIES.items()}}
TRAIN_SPECS = {name: (lambda flavors=flavors: hf_train_spec(flavors)) for name, flavors in FLAVORS.items()}


def register_train_specs() -> None:
    """Once per process: a process that runs several jobs imports titan_ext once per job."""
    from torchtitan.protocols import train_spec

    for name, build in TRAIN_SPECS.items():
        if name not in train_spec._extra_train_specs:
            train_spec.register_train_spec(name, build())
