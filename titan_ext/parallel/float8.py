"""Float8 training through torchtitan's ``quantize.linear.float8`` converter, set up for HF layouts.

torchtitan's converter swaps every ``nn.Linear`` whose dims are divisible by
16 unless its FQN contains a ``filter_fqns`` entry. When the user gives no
filters, titan_ext keeps a few linears of each architecture in high
precision (``Architecture.float8_high_precision``): the job plan records them and
``keep_high_precision`` turns those modules back into plain ``nn.Linear``
right after the converter ran (on the meta device, before anything is
sharded), so the job config is never rewritten.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from titan_ext.errors import ConfigError
from titan_ext.job_plan import Float8Choice

logger = logging.getLogger()

CONVERTER = "quantize.linear.float8"

def check_float8(job_config) -> None:
    """Hardware and compile constraints, in one line each (torchtitan fails late and obscurely)."""
    from torchtitan.tools.utils import has_cuda_capability

    from titan_ext.parallel.compile import model_compile_enabled

    if CONVERTER not in job_config.model.converters:
        return
    float8_config = job_config.quantize.linear.float8
    if float8_config.emulate:
        if model_compile_enabled(job_config):
            raise ConfigError(
                "--quantize.linear.float8.emulate does not work with a compiled model; "
                "drop --compile.enable (or 'model' from --compile.components) or the emulate flag"
            )
        return
    if not has_cuda_capability(8, 9):
        raise ConfigError(
            f"--model.converters {CONVERTER} needs a CUDA GPU with compute capability >= 8.9 (H100, L40S, ...); "
            "set --quantize.linear.float8.emulate to test it elsewhere"
        )


def float8_choice(job_config, defaults: tuple[str, ...]) -> Float8Choice | None:
    """``defaults``: the architecture's high-precision linears, used when the job names no filters."""
    if CONVERTER not in job_config.model.converters:
        return None
    given = tuple(job_config.quantize.linear.float8.filter_fqns)
    if given:
        return Float8Choice(filter_fqns=given, high_precision=())
    return Float8Choice(filter_fqns=defaults, high_precision=defaults)


def keep_high_precision(model: nn.Module, fqn_parts: tuple[str, ...]) -> list[str]:
    """Turn converted linears whose FQN contains one of ``fqn_parts`` back into ``nn.Linear``; returns their FQNs."""
    from torchao.float8.float8_linear import Float8Linear

    restored = []
    for fqn, module in list(model.named_modules()):
        if isinstance(module, Float8Linear) and any(part in fqn for part in fqn_parts):
            parent_fqn, _, name = fqn.rpartition(".")
            model.get_submodule(parent_fqn).register_module(name, _plain_linear(module))
            restored.append(fqn)
    if restored:
        logger.info(
            f"Float8: no --quantize.linear.float8.filter_fqns given; kept {list(fqn_parts)} in high precision "
            f"({len(restored)} linears)"
        )
    return restored


def _plain_linear(module: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` owning the same parameters (unwrapping torchao's float8 all-gather weight, if any)."""
    weight = module.weight
    inner = getattr(weight, "_tensor", None)
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    linear.weight = weight if inner is None else nn.Parameter(inner, requires_grad=weight.requires_grad)
    if module.bias is not None:
        linear.bias = module.bias
    return linear
