"""Which TP plan a model gets: plans registered per ``config.model_type`` (shipped or a user's), else the
model's own HF plan translated (``model_plans.hf_plan``)."""

from __future__ import annotations

from model_plans.base import TPPlan
from model_plans.hf_plan import hf_plan_class

_PLANS: dict[str, type[TPPlan]] = {}
"""``model_type`` -> its TP plan class, shipped or a user's (``register_tp_plan``). Apart from titan_ext's
per-type table (``titan_ext.models.architecture``): model_plans imports no titan_ext, a user's plan replaces
a shipped one, and a model type with no entry takes its own HF plan translated."""


def _shipped(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "model_plans"


def register_tp_plan(model_type: str):
    """Class decorator: ``@register_tp_plan("my_type")`` makes ``get_tp_plan`` find the class.

    A user's plan replaces a shipped one for the same model type (``plan_source``
    says so, and the job logs it); two user plans for one type are an error.
    """

    def register(cls: type[TPPlan]) -> type[TPPlan]:
        if not (isinstance(cls, type) and issubclass(cls, TPPlan)):
            raise TypeError(f"register_tp_plan({model_type!r}) needs a TPPlan subclass, got {cls!r}")
        current = _PLANS.get(model_type)
        if current is not None and current is not cls and not _shipped(current) and not _shipped(cls):
            raise ValueError(
                f"a TP plan for model_type {model_type!r} is already registered ({current.__module__}.{current.__qualname__}); "
                "register one plan per model_type"
            )
        if current is None or not _shipped(cls):  # a shipped plan never replaces a user's
            _PLANS[model_type] = cls
        return cls

    return register


def registered_model_types() -> list[str]:
    return sorted(_PLANS)


def get_tp_plan(model_type: str) -> type[TPPlan]:
    if model_type not in _PLANS:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r}; registered: {registered_model_types()}. "
            "Register one with @model_plans.register_tp_plan(model_type) in your custom_import module"
        )
    return _PLANS[model_type]


def plan_source(plan_cls: type[TPPlan]) -> str:
    """Where a plan comes from, for the job's log: shipped, the user's module, or the model's own HF plan."""
    if getattr(plan_cls, "translated_from_hf", False):
        return "translated from the model's own HF tensor-parallel plan"
    return "shipped with titan_ext" if _shipped(plan_cls) else f"registered by {plan_cls.__module__}"


def plan_for_model(model, other_mixers: dict[int, tuple[str, ...]] = {}, layers: str | None = None) -> type[TPPlan]:
    """The TP plan of a model (on any device, the meta device included), in this order: the plan
    registered for its ``config.model_type`` (a user's wins over a shipped one), else its HF
    ``base_model_tp_plan`` translated (``model_plans.hf_plan``; given the layer stack's path in the base
    model, ``layers``, also without one: every block module kept whole), else a one-line ``ValueError``."""
    model_type = model.config.model_type
    if model_type in _PLANS:
        return _PLANS[model_type]
    translated = hf_plan_class(model, other_mixers, layers)  # a hybrid's other mixers: their own entries
    if translated is None:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r}: none is registered (registered: "
            f"{registered_model_types()}) and its HF config has no base_model_tp_plan; register one with "
            "@model_plans.register_tp_plan(model_type) in your custom_import module"
        )
    return translated
