"""The census (``python -m titan_ext.census``): every transformers and fla causal-LM model type through titan_ext.

The whole census runs once (``census`` marks it: ``pytest -m census``; about two minutes on the 2-core CI
machine, within its 3-minute budget), as CI runs it: a process of its own, whose table ``docs/models.md`` must
equal. The other tests check what it trains: which model types are decoder-only text models, and the tiny
config derived for each.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_ext.census import cells, columns, configs, matrix, model_types, table

REPO = Path(__file__).resolve().parents[1]
MODELS_MD = REPO / "docs" / "models.md"
CENSUS_LIMIT_S = 600
"""Far above the census's budget (3 minutes): a limit for a hang, not the budget."""

XFAIL_WHILE_TITAN_EXT_FAILS = False
"""While titan_ext still dies on some model types (a ``TRACEBACK`` or ``TIMEOUT`` cell), the zero-traceback
test is an expected failure naming them; set False (strict) once none is left."""


@pytest.fixture(scope="module")
def census_table(tmp_path_factory) -> str:
    """The census's Markdown, from one run of the command (in a process of its own: the census's process must
    not have imported fla, which this test process may have)."""
    out = tmp_path_factory.mktemp("census") / "models.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    begin = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "titan_ext.census", "--out", str(out)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=CENSUS_LIMIT_S)
    assert run.returncode == 0, run.stderr[-4000:]
    print(f"census: {time.monotonic() - begin:.1f} s; {run.stderr.strip().splitlines()[-1]}")
    return out.read_text()


def table_rows(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """``{(section, model type): {column: cell}}`` of the census's tables."""
    rows, section, columns = {}, "", []
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| model type |"):
            columns = [c.strip() for c in line.strip("|").split(" | ")]
        elif line.startswith("| `") and section:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
            rows[(section, cells[0].strip("`"))] = dict(zip(columns, cells))
    return rows


@pytest.mark.census
def test_census_has_no_tracebacks_or_timeouts(census_table):
    rows = table_rows(census_table)
    assert len(rows) > 100, "no census rows read"
    failing = sorted(f"{section}/{model_type} ({column})" for (section, model_type), cells in rows.items()
                     for column, cell in cells.items() if cell.startswith(("TRACEBACK", "TIMEOUT")))
    if failing and XFAIL_WHILE_TITAN_EXT_FAILS:
        types = sorted({f.split(" ")[0] for f in failing})
        pytest.xfail(f"titan_ext still dies on {len(types)} model types: {', '.join(types)}")
    assert not failing, failing


@pytest.mark.census
def test_census_ends_with_its_summary_lines(census_table):
    lines = census_table.rstrip("\n").splitlines()
    rows = table_rows(census_table)
    for line, section in ((lines[-1], "transformers"), (lines[-2], "fla")):
        match = re.fullmatch(rf"{'fla: ' if section == 'fla' else ''}(\d+) of (\d+) model types train", line)
        assert match, line
        kept = [cells for (s, _), cells in rows.items() if s == section]
        assert int(match[2]) == len(kept) and int(match[1]) == sum(c["one process"] == "ok" for c in kept), line


@pytest.mark.census
def test_docs_models_md_is_the_census(census_table):
    assert MODELS_MD.read_text() == census_table, \
        "docs/models.md is stale: regenerate it with python -m titan_ext.census --out docs/models.md"


# ---- what the census trains -------------------------------------------------------------------------

def test_the_filter_keeps_decoder_only_text_models():
    assert "BERT-style encoder" in model_types.left_out_reason("bert")
    assert model_types.left_out_reason("bart").startswith("encoder-decoder")
    assert model_types.left_out_reason("llama") is None
    assert "`qwen3_5_text` is censused" in model_types.left_out_reason("qwen3_5")
    assert "image/audio" in model_types.left_out_reason("git")
    kept = [t for t in model_types.causal_lm_types() if model_types.left_out_reason(t) is None]
    assert 120 <= len(kept) < len(model_types.causal_lm_types())


def test_every_kept_types_tiny_config_builds_small_on_the_meta_device():
    failures, sizes = [], {}
    for model_type in model_types.causal_lm_types():
        if model_types.left_out_reason(model_type):
            continue
        try:
            model, sizes[model_type] = configs.check_tiny(model_type)
            layers = model_types.layer_stack(model)
            assert layers is not None and 2 <= len(layers) <= 6, f"{len(layers or [])} layers"
        except Exception as error:  # noqa: BLE001  (collect them all)
            failures.append(f"{model_type}: {type(error).__name__}: {error}"[:300])
    assert not failures, failures
    assert max(sizes.values()) < configs.MAX_PARAMS, max(sizes.items(), key=lambda kv: kv[1])


def test_every_fla_types_tiny_config_builds_small_on_the_meta_device():
    from titan_ext.models.architecture import fla_model_types

    failures = []
    for model_type in fla_model_types():
        try:
            _, size = configs.check_tiny(model_type, "fla")
            assert size < configs.MAX_PARAMS, size
        except ImportError as error:  # fla's MLA layer needs flash-attn even to be built
            assert "flash" in str(error).lower(), error
        except Exception as error:  # noqa: BLE001
            failures.append(f"{model_type}: {type(error).__name__}: {error}"[:300])
    assert not failures, failures


def test_every_kept_types_tiny_config_trains_in_plain_transformers():
    """A step of transformers' own model on the CPU, no titan_ext: a census cell that fails is titan_ext's,
    not the tiny config's. (Modeling files that call fla's Triton kernels when fla is installed fail here
    with Triton's "0 active drivers": titan_ext's portable kernels are what runs them on the CPU.)"""
    import copy

    import torch

    failures = []
    for model_type in model_types.causal_lm_types():
        if model_types.left_out_reason(model_type):
            continue
        config_class, model_class = model_types.transformers_classes(model_type)
        fields = copy.deepcopy(configs.tiny_config(model_type))
        fields.pop("model_type")
        torch.manual_seed(0)
        try:
            model = model_class(config_class(**fields))
            tokens = torch.randint(0, configs.VOCAB, (2, 64))
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            assert torch.isfinite(loss), loss
        except RuntimeError as error:
            if "active drivers" not in str(error):
                failures.append(f"{model_type}: {error}"[:300])
        except Exception as error:  # noqa: BLE001
            failures.append(f"{model_type}: {type(error).__name__}: {error}"[:300])
    assert not failures, failures


def test_a_tiny_config_is_the_shared_sizes_and_keeps_every_kind_of_layer():
    llama = configs.tiny_config("llama")
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["num_attention_heads"],
            llama["num_key_value_heads"], llama["head_dim"], llama["intermediate_size"], llama["vocab_size"]) \
        == (64, 2, 4, 2, 16, 64, 2048)
    qwen3_next = configs.tiny_config("qwen3_next")
    assert qwen3_next["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]  # the family's pattern
    assert (qwen3_next["num_experts"], qwen3_next["num_experts_per_tok"]) == (4, 2)
    gemma3 = configs.tiny_config("gemma3_text")
    assert set(gemma3["layer_types"]) == {"sliding_attention", "full_attention"} and len(gemma3["layer_types"]) == 4
    deepseek = configs.tiny_config("deepseek_v3")
    assert (deepseek["kv_lora_rank"], deepseek["qk_rope_head_dim"], deepseek["qk_nope_head_dim"]) == (16, 8, 8)
    assert all(v == 0.0 for k, v in configs.tiny_config("gpt2").items() if "pdrop" in k)


def test_mixer_runs_are_compressed():
    assert cells.compress_mixers(["gla", "gla", "fla attention", "fla attention"]) == "gla x2, fla attention x2"
    assert cells.compress_mixers(["a", "b", "a"]) == "a, b, a"
    assert cells.compress_mixers(None) == "—"


def test_a_layout_stands_for_its_flags():
    assert cells.flags(columns.LAYOUTS["TP"][0]) == [
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    assert cells.flags(columns.LAYOUTS["documents"][0]) == ["--titan_ext.document_mask"]


def test_the_readme_quotes_the_census():
    """README's figures are docs/models.md's summary lines (which test_docs_models_md_is_the_census keeps true)."""
    *_, fla_line, last = MODELS_MD.read_text().rstrip("\n").splitlines()
    transformers = re.fullmatch(r"(\d+ of \d+) model types train", last)
    fla = re.fullmatch(r"fla: (\d+ of \d+) model types train", fla_line)
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"{transformers[1]} transformers types and {fla[1]} fla types train" in readme


def test_the_multi_rank_runs_are_the_matrixs():
    """docs/models.md's runs section (one model per mixer kind) is what the integration matrix's rows are now:
    a row added, dropped or renamed there makes it stale, without running the census."""
    section = matrix.runs_section(matrix.matrix_runs())
    text = MODELS_MD.read_text()
    assert section and "\n".join(section) in text, "docs/models.md is stale: python -m titan_ext.census --out docs/models.md"
    assert "| transformers' mamba2 | transformers `nemotron_h` (`hf_nemotron_h`) | `hf_nemotron_h/fsdp2` | " \
           "`hf_nemotron_h/tp2` | `hf_nemotron_h/cp2` |" in "\n".join(section)


def test_a_planned_cell_of_a_matrix_model_names_its_row():
    """Only ``plans`` becomes the matrix's row: a refusal, ``n/a`` and the other model types stay as planned."""
    runs = {"kind": (("transformers", "llama", "hf_llama"), {"TP": "hf_llama/tp2", "CP": "hf_llama/cp2"})}
    cells = {("transformers", "llama"): {"TP": "plans", "CP": "refused: why", "EP": "n/a"},
             ("transformers", "qwen3"): {"TP": "plans"}}
    assert matrix.with_runs(cells, runs) == {
        ("transformers", "llama"): {"TP": "ran: `hf_llama/tp2`", "CP": "refused: why", "EP": "n/a"},
        ("transformers", "qwen3"): {"TP": "plans"}}


def test_check_names_the_lines_a_stale_file_differs_in(tmp_path):
    """``--check``: nothing for the file this run renders, the changed lines for a stale or missing one."""
    path = tmp_path / "models.md"
    path.write_text("# title\nold row\n")
    assert table.stale_lines(str(path), "# title\nold row\n") == []
    assert [line for line in table.stale_lines(str(path), "# title\nnew row\n") if line[:1] in "+-"][-2:] == [
        "-old row", "+new row"]
    assert "+# title" in table.stale_lines(str(tmp_path / "absent.md"), "# title\n")
    assert table.stale_lines(str(path), "# title\nold row") == [f"{path} differs"]  # only its last newline
