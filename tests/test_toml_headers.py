"""Every figure in a shipped TOML's header is its model's or its job's, read from the model the TOML builds.

A header's figures are said in the phrases of ``FACTS``; any other standalone figure fails (a name such as
``340M`` or ``Qwen3-30B-A3B`` is not a figure). The layouts a header says train cite integration-matrix rows,
checked by ``tests/test_docs.py`` (``test_a_shipped_tomls_header_names_matrix_rows_that_train_its_model``).
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.name for p in (REPO / "train_configs").glob("*.toml"))


@dataclass(frozen=True)
class Model:
    """What a TOML builds and runs, as its header may state it."""

    config: object
    """The model's HF config (every field, defaults included)."""
    layers: int
    parameters: int
    routed_expert_parameters: int
    job: object
    world: int
    """The header command's ranks (``--nnodes`` x ``--nproc_per_node``)."""


def header(config: str) -> str:
    lines = (REPO / "train_configs" / config).read_text().splitlines()
    return "\n".join(line[1:] for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def header_world(text: str) -> int:
    words = shlex.split(next(line for line in text.splitlines() if line.strip().startswith("torchrun")))
    value = {w.split("=")[0]: (w.split("=")[1] if "=" in w else words[i + 1]) for i, w in enumerate(words)
             if w.startswith("--nnodes") or w.startswith("--nproc_per_node")}
    return int(value.get("--nnodes", 1)) * int(value["--nproc_per_node"])


@cache
def model_of(config: str) -> Model:
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    import titan_ext  # noqa: F401  (train specs)
    from titan_ext.models.adapter import meta_model

    job = ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / config)])
    args = copy.deepcopy(get_train_spec(job.model.name).model_args[job.model.flavor])
    args.read_job_config(job)
    model = meta_model(args)
    named = dict(model.named_parameters())
    routed = sum(p.numel() for name, p in named.items() if ".experts." in name and "shared" not in name)
    return Model(model.config, len(model.model.layers), sum(p.numel() for p in named.values()), routed, job,
                 header_world(header(config)))


def experts(c) -> int:
    return getattr(c, "num_experts", None) or c.n_routed_experts


def per_token(c) -> int:
    return getattr(c, "num_experts_per_tok", None) or c.num_experts_per_token


def mixer_pattern(c) -> list[str]:
    """Each layer's kind: "linear" or "full" (transformers' ``layer_types``, or Kimi's KDA layer list)."""
    if getattr(c, "layer_types", None):
        return ["linear" if kind == "linear_attention" else "full" for kind in c.layer_types]
    linear = c.linear_attn_config["kda_layers"]  # 1-based
    return ["linear" if i + 1 in linear else "full" for i in range(c.num_hidden_layers)]


def billions_or_millions(count: float, stated: str, unit: str) -> bool:
    scale = {"M": 1e6, "B": 1e9}[unit]
    digits = len(stated.partition(".")[2])
    return f"{count / scale:.{digits}f}" == stated


FACTS: list[tuple[str, object]] = [
    (r"(\d+) layers", lambda m, x: x.layers == int(m[1])),
    (r"(\d+) experts", lambda m, x: experts(x.config) == int(m[1])),
    (r"(\d+) per token", lambda m, x: per_token(x.config) == int(m[1])),
    (r"([\d.]+)([MB]) parameters", lambda m, x: billions_or_millions(x.parameters, m[1], m[2])),
    (r"([\d.]+)B active", lambda m, x: billions_or_millions(
        x.parameters - x.routed_expert_parameters * (1 - per_token(x.config) / experts(x.config)), m[1], "B")),
    (r"(?:hidden|width) (\d+)", lambda m, x: x.config.hidden_size == int(m[1])),
    (r"(\d+) heads of (\d+)", lambda m, x: (x.config.num_heads, x.config.head_dim) == (int(m[1]), int(m[2]))),
    (r"kv_lora_rank (\d+)", lambda m, x: x.config.kv_lora_rank == int(m[1])),
    (r"[Aa]ttention at layers ([\d, and]+)",
     lambda m, x: x.config.attn["layers"] == [int(n) for n in re.findall(r"\d+", m[1])]),
    (r"(\d+) (?:KDA|Gated DeltaNet)(?: layers,)? (?:to 1|then) (?:MLA|gated attention)",
     lambda m, x: mixer_pattern(x.config) == (["linear"] * int(m[1]) + ["full"]) * (x.layers // (int(m[1]) + 1))),
    (r"on (\d+) CPU cores|over the (\d+) GPUs", lambda m, x: x.world == int(m[1] or m[2])),
    (r"(\d+) nodes of (\d+) GPUs", lambda m, x: x.world == int(m[1]) * int(m[2])),
    (r"split (\d+) ways", lambda m, x: x.job.parallelism.expert_parallel_degree == int(m[1])),
    (r"([\d.]+) GiB of fp32 weights, gradients and AdamW state\s+per GPU, of (\d+) GB",
     lambda m, x: f"{x.parameters * 16 / x.world / 2**30:.1f}" == m[1] and float(m[1]) * 2**30 < int(m[2]) * 1e9),
]
"""(phrase, whether the model and job say so): the phrases a header states figures in."""

NAME = re.compile(r"[\w./-]*[A-Za-z_][\w./-]*")
"""A word with a letter in it: a name (``340M``, ``Qwen3.5``, ``qwen3_30b_a3b.json``), not a figure."""
COMMAND = re.compile(r"^\s+torchrun .*$", re.M)


@pytest.mark.parametrize("config", CONFIGS)
def test_each_figure_of_a_tomls_header_is_its_models(config):
    text = COMMAND.sub("", header(config))
    model = model_of(config)
    wrong = []
    for phrase, holds in FACTS:
        for match in re.finditer(phrase, text):
            if not holds(match, model):
                wrong.append(match[0])
        text = re.sub(phrase, " ", text)
    left = re.findall(r"\d[\d.,]*", NAME.sub(" ", text))
    assert not wrong, f"{config}: its header says {wrong}, which its model does not"
    assert not left, f"{config}: figures no phrase of FACTS states (so no test checks them): {left}"


def test_a_wrong_figure_fails():
    model = model_of("debug_qwen3_moe.toml")
    phrase, holds = next((p, h) for p, h in FACTS if p == r"(\d+) experts")
    assert holds(re.search(phrase, "8 experts"), model) and not holds(re.search(phrase, "16 experts"), model)
