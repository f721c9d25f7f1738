"""Float8 via torchtitan's quantize.linear.float8 converter: checks, the plan's filters, and high-precision linears."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from helpers import job_config
from torchao.float8.float8_linear import Float8Linear as Float8LinearModule
from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.config.job_config import Compile, Float8Linear

from titan_ext.errors import ConfigError
from titan_ext.job_plan import Float8Choice
from titan_ext.models.adapter import build_model
from titan_ext.models.architecture import TransformersArchitecture
from titan_ext.models.gla import GLA, gla_flavors
from titan_ext.parallel.float8 import CONVERTER, check_float8, float8_choice, keep_high_precision


def job(converters=(CONVERTER,), emulate=True, filter_fqns=(), compile_enable=False):
    return SimpleNamespace(
        model=SimpleNamespace(converters=list(converters)),
        quantize=SimpleNamespace(linear=SimpleNamespace(
            float8=Float8Linear(emulate=emulate, filter_fqns=list(filter_fqns)))),
        compile=Compile(enable=compile_enable),
    )


# ---- checks --------------------------------------------------------------------------------------


def test_checks_pass_without_float8_or_with_emulate():
    check_float8(job(converters=(), emulate=False, compile_enable=True))
    check_float8(job(emulate=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a float8 GPU")
def test_no_float8_gpu_without_emulate_is_one_line_error():
    with pytest.raises(ConfigError) as info:
        check_float8(job(emulate=False))
    message = str(info.value)
    assert "compute capability >= 8.9" in message and "--quantize.linear.float8.emulate" in message
    assert "\n" not in message


def test_emulate_with_compile_is_one_line_error():
    with pytest.raises(ConfigError, match="--quantize.linear.float8.emulate does not work with a compiled model"):
        check_float8(job(compile_enable=True))


# ---- the plan's choice ------------------------------------------------------------------------------


def test_default_filters_per_architecture_without_rewriting_the_config():
    config = job()
    assert float8_choice(config, GLA.float8_high_precision) == Float8Choice(("gk_proj", "lm_head"), ("gk_proj", "lm_head"))
    assert float8_choice(config, TransformersArchitecture.float8_high_precision) == Float8Choice(("lm_head",), ("lm_head",))
    assert config.quantize.linear.float8.filter_fqns == []  # the job config is left as the user gave it


def test_user_filters_are_kept_and_nothing_is_restored():
    assert float8_choice(job(filter_fqns=["o_proj"]), GLA.float8_high_precision) == Float8Choice(("o_proj",), ())


def test_no_float8_no_choice():
    assert float8_choice(job(converters=()), GLA.float8_high_precision) is None


# ---- torchtitan's converter, then keep_high_precision ---------------------------------------------


def converted_debug_gla(device: str):
    """A debug GLA after torchtitan's converter ran with no filters (every 16-divisible linear converted)."""
    config = job_config("--model.converters", CONVERTER, "--quantize.linear.float8.emulate")
    assert config.quantize.linear.float8.filter_fqns == []
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(copy.deepcopy(gla_flavors["debugmodel"]))
    Float8LinearConverter(config, SimpleNamespace(dp_shard_enabled=False)).convert(model)
    return model


def linear_kinds(model):
    return {name: type(m) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_keep_high_precision_restores_exactly_the_filtered_linears(device):
    model = converted_debug_gla(device)
    assert all(kind is Float8LinearModule for kind in linear_kinds(model).values())
    parameters = {name: p for name, p in model.named_parameters()}

    restored = keep_high_precision(model, ("gk_proj", "lm_head"))
    kinds = linear_kinds(model)
    expected = {n for n in kinds if "gk_proj" in n or n == "lm_head"}
    assert set(restored) == expected and len(expected) == 5  # gk_proj.0/.1 in 2 layers, lm_head
    assert {n for n, kind in kinds.items() if kind is nn.Linear} == expected
    assert {n for n, kind in kinds.items() if kind is Float8LinearModule} == set(kinds) - expected
    # the same parameters, under the same names (checkpoints and optimizers see no change)
    assert {name: p for name, p in model.named_parameters()}.keys() == parameters.keys()
    assert all(p is parameters[name] for name, p in model.named_parameters())
    assert keep_high_precision(model, ("gk_proj", "lm_head")) == []  # nothing left to restore


def test_converted_model_trains_emulated_on_cpu():
    model = converted_debug_gla("cpu")
    keep_high_precision(model, ("gk_proj", "lm_head"))
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (2, 32, 2048) and torch.isfinite(logits).all()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    assert 5.0 < loss.item() < 10.0  # ~ln(2048) at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
