"""docs/checkpoints-and-hf.md's continued-pretraining walkthrough, read from the page (``tests/walkthrough.py``).

Here: each plan command sizes the real checkpoint's config.json (written field for field, no download) as the page
shows, and plans the layout its torchrun command trains. The torchrun commands themselves run on tiny hub folders
in the integration matrix's ``walkthrough`` row.
"""

from __future__ import annotations

import json
import os

import pytest
import walkthrough
from test_real_configs import KIMI_LINEAR_48B_A3B, QWEN3_0_6B, QWEN3_30B_A3B

from titan_ext.errors import ConfigError

REAL_CONFIGS = {"Qwen3-0.6B": QWEN3_0_6B, "Qwen3-30B-A3B": QWEN3_30B_A3B, "Kimi-Linear-48B-A3B-Instruct": KIMI_LINEAR_48B_A3B}
MODELS = {model.repo.split("/")[1]: model for model in walkthrough.models()}


def test_the_page_walks_through_a_dense_model_qwen3_moe_with_ep_and_kimi_linear_on_8_gpus():
    assert list(MODELS) == list(REAL_CONFIGS)
    for model in MODELS.values():
        assert model.world == 8 and model.folder == f"checkpoints/{model.repo.split('/')[1]}"
        given = dict(walkthrough.flags(model.train, ()))
        assert given["--model.hf_assets_path"] == given["--titan_ext.hf_config"] == model.folder
        assert {"--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only",
                "--checkpoint.last_save_in_hf"} <= set(given)
    for name in ("Qwen3-30B-A3B", "Kimi-Linear-48B-A3B-Instruct"):
        assert dict(walkthrough.flags(MODELS[name].train, ()))["--parallelism.expert_parallel_degree"] == "8"


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_each_plan_command_plans_the_layout_its_torchrun_command_trains(name):
    model = MODELS[name]
    assert walkthrough.flags(model.plan, walkthrough.PLAN_ONLY) == walkthrough.flags(model.train, walkthrough.TRAIN_ONLY)
    assert dict(walkthrough.flags(model.plan, ()))["--world"] == str(model.world)


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_each_plan_output_shown_is_what_the_command_prints_today(name, tmp_path, capsys, monkeypatch):
    """Every line of the output block (the page shows rows of it) is a line the plan command prints for the real
    config.json: ~15-25 s each, meta and fake tensors only."""
    from titan_ext.plan import main

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(REAL_CONFIGS[name]))
    model = MODELS[name]
    monkeypatch.chdir(walkthrough.PAGE.parents[1])  # the page's paths are the repository's
    assert main(walkthrough.plan_argv(model, folder)) == 0
    printed = set(capsys.readouterr().out.splitlines())
    shown = [line for line in model.plan_output.splitlines() if line.strip()]
    assert shown and [line for line in shown if line not in printed] == []


def test_the_cpu_run_changes_only_the_folder_the_degrees_and_the_data():
    model = MODELS["Qwen3-30B-A3B"]
    argv = walkthrough.cpu_argv(model, "/tiny")
    given = dict(walkthrough.flags(argv, ()))
    assert given["--model.hf_assets_path"] == given["--titan_ext.hf_config"] == "/tiny"
    assert given["--parallelism.expert_parallel_degree"] == given["--parallelism.data_parallel_shard_degree"] == "2"
    assert "--training.dataset_path" not in given and "--training.dataset" not in given
    assert given["--job.config_file"] == str(walkthrough.PAGE.parents[1] / "train_configs" / "qwen3_moe_30B_A3B.toml")
    kept = [(flag, value) for flag, value in walkthrough.flags(model.train, ()) if not flag.startswith(
        ("--model.hf_assets_path", "--titan_ext.hf_config", "--parallelism.", "--training.dataset", "--job.config_file"))]
    assert [pair for pair in walkthrough.flags(argv, ()) if pair in kept] == kept


def test_kimis_folder_stops_in_one_line_naming_the_pages_command_which_makes_it_load(tmp_path, monkeypatch):
    """What Kimi's download meets: its tokenizer is in tiktoken's format, which torchtitan cannot read; the
    preflight line names the page's tokenizer_json command, and that command, run as the page shows it, writes the
    tokenizer.json the job loads."""
    import tiktoken_folder
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_ext.inputs.tokenizer import check_tokenizer_dir
    from titan_ext.tokenizer_json import main

    model = MODELS["Kimi-Linear-48B-A3B-Instruct"]
    assert [m.repo for m in MODELS.values() if m.tokenizer_json] == [model.repo] and model.tokenizer_json == [model.folder]
    monkeypatch.chdir(tmp_path)
    ranks = tiktoken_folder.train_ranks(tiktoken_folder.TRAINING_TEXT, merges=50)
    tiktoken_folder.write_folder(tmp_path / model.folder, ranks)
    with pytest.raises(ConfigError) as error:
        check_tokenizer_dir(model.folder, model.folder)
    line = str(error.value)
    assert "\n" not in line and line.startswith(f"--model.hf_assets_path={model.folder!r} holds no tokenizer.json")
    assert line.endswith(": " + " ".join(["python", "-m", "titan_ext.tokenizer_json", *model.tokenizer_json]))
    assert main(model.tokenizer_json) == 0  # as the page shows it, from the folder holding checkpoints/
    check_tokenizer_dir(model.folder, model.folder)
    tokenizer = HuggingFaceTokenizer(model.folder)
    assert tokenizer.encode("HelloWorld", add_bos=False, add_eos=False) == tiktoken_folder.tiktoken_encode("HelloWorld", ranks)


def test_the_loading_block_names_the_dense_export_of_the_page():
    code, path = walkthrough.load_example()
    dense = dict(walkthrough.flags(MODELS["Qwen3-0.6B"].train, ()))
    assert path == os.path.join(dense["--job.dump_folder"], "checkpoint", f"step-{dense['--training.steps']}")
    assert "from titan_ext.pretrained import from_pretrained" in code and "model = from_pretrained(export)" in code
