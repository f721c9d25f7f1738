"""Float8 training through torchtitan's ``quantize.linear.float8`` converter, set up for HF layouts.

``configure_float8(job_config, model_type)`` runs from the model args'
``update_from_config``: after the job config is final and before torchtitan
builds its converters (train.py: ``update_from_config`` -> model on meta ->
``build_model_converters`` -> ``parallelize_fn``). It turns the converter's
late or obscure failures into one-line errors and, when the user gave no
``filter_fqns``, fills in defaults for the architecture (the converter skips
every ``nn.Linear`` whose FQN contains an entry).
"""

from __future__ import annotations

from torchtitan.tools.logging import logger
from torchtitan.tools.utils import has_cuda_capability

from titan_ext.compile import model_compile_enabled

CONVERTER = "quantize.linear.float8"

# Linears that float8 would slow down or hurt: GLA's low-rank gate (``gk_proj.0``/``.1``,
# rank 16: too little work to pay for the casts) and the output head (precision of the logits).
DEFAULT_FILTER_FQNS: dict[str, list[str]] = {"gla": ["gk_proj", "lm_head"]}
FALLBACK_FILTER_FQNS = ["lm_head"]


def default_filter_fqns(model_type: str) -> list[str]:
    return list(DEFAULT_FILTER_FQNS.get(model_type, FALLBACK_FILTER_FQNS))


def check_converter_names(converters: list[str]) -> None:
    """torchtitan looks names up in a dict and fails with a bare ``KeyError: 'float8'``."""
    for name in converters:
        if name in ("float8", "fp8", "linear.float8"):
            raise ValueError(f"--model.converters: {name!r} is not a converter name; use {CONVERTER!r}")


def check_hardware(float8_config, compile_enabled: bool) -> None:
    if float8_config.emulate:
        if compile_enabled:
            raise ValueError(
                "--quantize.linear.float8.emulate does not work with a compiled model; "
                "drop --compile.enable (or 'model' from --compile.components) or the emulate flag"
            )
        return
    if not has_cuda_capability(8, 9):
        raise ValueError(
            f"--model.converters {CONVERTER} needs a CUDA GPU with compute capability >= 8.9 (H100, L40S, ...); "
            "set --quantize.linear.float8.emulate to test it elsewhere"
        )


def configure_float8(job_config, model_type: str) -> None:
    """Validate the Float8 setup and apply default filters; does nothing without Float8."""
    converters = list(job_config.model.converters)
    check_converter_names(converters)
    if CONVERTER not in converters:
        return
    float8_config = job_config.quantize.linear.float8
    check_hardware(float8_config, model_compile_enabled(job_config))
    if not float8_config.filter_fqns:
        float8_config.filter_fqns = default_filter_fqns(model_type)
        logger.info(
            f"Float8: no --quantize.linear.float8.filter_fqns given; keeping {float8_config.filter_fqns} "
            "in high precision"
        )
