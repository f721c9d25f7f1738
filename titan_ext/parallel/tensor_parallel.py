"""Tensor parallelism from torchtitan's job config: the plan class and its options, checked, then applied.

``parallelize_hf_model`` calls ``apply_tp_from_plan`` first (before AC,
compile and FSDP), as torchtitan orders them. The plans themselves live in
``model_plans``; this module maps job-config options onto them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch.nn as nn

from titan_ext.errors import ConfigError
from titan_ext.job_plan import TPChoice

logger = logging.getLogger()


def sequence_parallel_enabled(job_config) -> bool:
    """``[titan_ext] disable_sequence_parallel`` (torchtitan has no flag for it); on by default."""
    return not getattr(getattr(job_config, "titan_ext", None), "disable_sequence_parallel", False)


def float8_tp_enabled(job_config) -> bool:
    """torchao's Float8 TP styles all-gather in float8 with one scale per tensor: tensorwise recipes only."""
    from titan_ext.parallel.float8 import CONVERTER

    if CONVERTER not in job_config.model.converters:
        return False
    return job_config.quantize.linear.float8.recipe_name in (None, "tensorwise")


def tp_plan_class(model: nn.Module, degree: int) -> type:
    """The TP plan class of a model (titan_ext's, or any transformers or fla causal LM, on any device).

    A plan registered for its model type (``model_plans.register_tp_plan``: a user's) or its HF plan translated
    (``model_plans.plan_for_model``) covers the layers of the architecture's own mixer; an fla model without a
    registered plan takes fla's block names from its structure. Every other layer's token mixers take their
    own entries (``Mixer.tp_entries``: a hybrid's, an unknown mixer's kept whole)."""
    from model_plans import TPPlan, plan_for_model, registered_model_types, with_layer_mixers

    from titan_ext.models.architecture import library_of

    arch, structure = _arch_and_structure(model)
    library = library_of(type(model.config))
    by_structure = library == "fla" and model.config.model_type not in registered_model_types()
    own = None if by_structure else arch.mixer
    others, paths = {}, {}
    for index, mixer in enumerate(structure.mixers):
        parts = [part for part in mixer.parts if part.mixes_tokens and (own is None or type(part) is not own)]
        for part in parts:
            if part.tp_entries(TPPlan()) is None:
                raise ConfigError(
                    f"--parallelism.tensor_parallel_degree={degree}: layer {index}'s token mixer {part.path!r} "
                    f"({part.name}) has no tensor-parallel plan in titan_ext; set the degree to 1"
                )
            if reason := part.tensor_parallel_blocker(degree):
                raise ConfigError(f"--parallelism.tensor_parallel_degree={degree}: layer {index}'s token mixer "
                                  f"{part.path!r} ({part.name}): {reason}")
        if parts:
            others[index] = MixerEntries(tuple(parts))
            paths[index] = tuple(part.path for part in parts)
    if by_structure:
        plan_cls = _fla_plan_class(structure.embeddings, structure.layers, structure.final_norm, structure.head,
                                   *_fla_block_parts(model.get_submodule(structure.layers)))
    else:
        layers = None
        if library == "transformers":  # without an HF plan: every block module but its mixers kept whole
            base = model.base_model_prefix if model.base_model is not model else ""
            layers = structure.layers.removeprefix(f"{base}.") if base else structure.layers
        plan_cls = plan_for_model(model, paths, layers)
    return with_layer_mixers(plan_cls, others)


def _arch_and_structure(model: nn.Module) -> tuple:
    """(architecture, structure): a titan_ext model's own, else found from the model (a plain HF model's)."""
    if hasattr(model, "arch"):
        return model.arch, model.structure
    from titan_ext.models.architecture import architecture_of
    from titan_ext.models.structure import structure_of

    return architecture_of(type(model.config)), structure_of(model)


@dataclass(frozen=True)
class MixerEntries:
    """The TP entries of a layer's token mixers, for a plan (``TPPlan.layer_mixers``): equal for equal mixers, so
    the plan class found twice for one model is one class (the job plan compares equal)."""

    parts: tuple

    def __call__(self, plan) -> dict:
        return {path: style for part in self.parts for path, style in part.tp_entries(plan).items()}


def _fla_block_parts(blocks: nn.Module) -> tuple[tuple[str, ...], bool]:
    """(the residual norms every block holds, whether every block holds fla's ``mlp``): fla's transformer-style
    blocks hold ``attn_norm``, ``mlp_norm`` and ``mlp``, its Mamba blocks one ``norm`` and no FFN."""
    from titan_ext.models.mixers import is_norm

    children = [dict(block.named_children()) for block in blocks.children()]
    norms = set.intersection(*({name for name, child in each.items()
                                if next(child.parameters(), None) is not None and is_norm(child)} for each in children))
    return tuple(sorted(norms)), all("mlp" in each for each in children)


@functools.cache
def _fla_plan_class(embeddings: str | None, layers: str, final_norm: str | None, head: str | None,
                    block_norms: tuple[str, ...], feed_forward: bool) -> type:
    """fla's block names, where the model keeps its parts (an fla model type without a registered plan)."""
    from model_plans import TPPlan

    def block_plan(self, index=None):
        norms = {name: self.norm() for name in block_norms}
        return {**norms, **self.mixer_plan(index), **(self.mlp_plan() if feed_forward else {})}

    return type("FlaTPPlan", (TPPlan,), {"__module__": __name__, "embeddings": embeddings, "layers": layers,
                                          "final_norm": final_norm, "lm_head": head, "block_plan": block_plan})


def tp_choice(model: nn.Module, job_config) -> TPChoice | None:
    """The job's TP: the plan found for ``model`` (on the meta device) and its options, checked against the model
    (a registered plan whose entries the model has, sizes it can split) before anything is built."""
    from model_plans import TPOptions, validate_tp

    from titan_ext.data import sections

    p = job_config.parallelism
    if p.tensor_parallel_degree <= 1:
        return None
    try:
        choice = TPChoice(
            degree=p.tensor_parallel_degree,
            plan_cls=tp_plan_class(model, p.tensor_parallel_degree),
            sequence_parallel=sequence_parallel_enabled(job_config),
            loss_parallel=not p.disable_loss_parallel,
            float8=float8_tp_enabled(job_config),
            async_tp=p.enable_async_tensor_parallel,
            expert_parallel=p.expert_parallel_degree > 1,
        )
        plan = choice.plan_cls(TPOptions(sequence_parallel=choice.sequence_parallel,
                                         expert_parallel=choice.expert_parallel))
        for section in sections(job_config):  # validation windows are split as training's are
            validate_tp(model, plan, choice.degree, getattr(job_config, section).seq_len, f"--{section}.seq_len")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return choice


def apply_tp_from_plan(model: nn.Module, tp_mesh, choice, head_in_loss: bool = False) -> None:
    """Shard ``model`` over the TP mesh with the plan class the job plan chose (``head_in_loss``: the chunked
    loss runs the head, on its vocabulary-sharded weight)."""
    from model_plans import TPOptions, apply_tp, enable_async_tp, plan_source

    options = TPOptions(sequence_parallel=choice.sequence_parallel, loss_parallel=choice.loss_parallel, float8=choice.float8,
                        head_in_loss=head_in_loss, expert_parallel=choice.expert_parallel)
    plan = choice.plan_cls(options)
    apply_tp(model, tp_mesh, plan)
    if choice.async_tp:
        enable_async_tp(tp_mesh)
    logger.info(
        f"Applied {type(plan).__name__} ({plan_source(choice.plan_cls)}, for model_type "
        f"{model.config.model_type!r}) tensor parallelism (degree {choice.degree}): "
        f"sequence_parallel={options.sequence_parallel}, loss_parallel={options.loss_parallel}, "
        f"float8={options.float8}, async={choice.async_tp}, head_in_loss={head_in_loss}"
        + "".join(f"; layer {index}: {', '.join(f'{part.path} ({part.name})' for part in entries.parts)} by its own "
                  "entries" for index, entries in plan.layer_mixers)
        + "".join(f"; {path} kept whole on every rank" for path, entry in getattr(plan, "entries", ())
                  if getattr(entry, "role", "") == "replicated")
    )
