"""Float8 via torchtitan's quantize.linear.float8 converter: default filters, errors, an emulated run."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch.nn as nn
from launch import torchrun
from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.config.job_config import Compile, Float8Linear

import titan_ext  # noqa: F401
from titan_ext.float8 import CONVERTER, configure_float8
from titan_ext.models.gla import GLAForTitan, gla_flavors


def job(converters=(CONVERTER,), emulate=True, filter_fqns=(), compile_enable=False):
    return SimpleNamespace(
        model=SimpleNamespace(converters=list(converters)),
        quantize=SimpleNamespace(linear=SimpleNamespace(
            float8=Float8Linear(emulate=emulate, filter_fqns=list(filter_fqns)))),
        compile=Compile(enable=compile_enable),
    )


def test_default_filters_applied_when_none_given():
    config = job()
    configure_float8(config, "gla")
    assert config.quantize.linear.float8.filter_fqns == ["gk_proj", "lm_head"]
    config = job()
    configure_float8(config, "llama")
    assert config.quantize.linear.float8.filter_fqns == ["lm_head"]


def test_user_filters_are_kept():
    config = job(filter_fqns=["o_proj"])
    configure_float8(config, "gla")
    assert config.quantize.linear.float8.filter_fqns == ["o_proj"]


def test_no_float8_no_change():
    config = job(converters=())
    configure_float8(config, "gla")
    assert config.quantize.linear.float8.filter_fqns == []


@pytest.mark.parametrize("name", ["float8", "fp8"])
def test_wrong_converter_name_names_the_right_one(name):
    with pytest.raises(ValueError, match=rf"--model.converters: '{name}' is not a converter name; use 'quantize.linear.float8'"):
        configure_float8(job(converters=[name]), "gla")


def test_no_float8_gpu_without_emulate_is_one_line_error():
    with pytest.raises(ValueError) as info:
        configure_float8(job(emulate=False), "gla")
    message = str(info.value)
    assert "compute capability >= 8.9" in message and "--quantize.linear.float8.emulate" in message
    assert "\n" not in message


def test_emulate_with_compile_is_one_line_error():
    with pytest.raises(ValueError, match="--quantize.linear.float8.emulate does not work with a compiled model"):
        configure_float8(job(compile_enable=True), "gla")


def test_torchtitan_converter_with_defaults_keeps_filtered_linears():
    config = job()
    configure_float8(config, "gla")
    model = GLAForTitan(copy.deepcopy(gla_flavors["debugmodel"]))
    Float8LinearConverter(config, SimpleNamespace(dp_shard_enabled=False)).convert(model)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = {n for n, k in kinds.items() if k == "Linear"}
    assert kept == {n for n in kinds if "gk_proj" in n or n == "lm_head"}, kinds
    assert any(k == "Float8Linear" for k in kinds.values())


def test_emulated_float8_run_trains(tmp_path):
    run = torchrun(
        "debug_gla.toml", tmp_path, "--debug.seed", "0", "--training.steps", "6",
        "--model.converters", CONVERTER, "--quantize.linear.float8.emulate",
        "--model.print_after_conversion",
    ).check()
    assert "Swapped to Float8Linear" in run.output
    assert run.output.count("Float8Linear(") > 0
    assert len(run.losses) == 6 and run.losses[-1] < run.losses[0], run.losses
    head = [line for line in run.output.splitlines() if "(lm_head):" in line or "(0): Linear(" in line]
    assert "Float8: no --quantize.linear.float8.filter_fqns given" in run.output
    assert head and all("Float8Linear" not in line for line in head), head
