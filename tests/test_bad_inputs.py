"""Every bad input ends in one ``ConfigError`` line naming the input and the fix; good inputs pass.

In-process and fast: real torchtitan job configs (parsed from
``train_configs/debug_gla.toml``), real HF config classes, DCP folders written
with ``torch.distributed.checkpoint.save`` and hand-made safetensors files.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from titan_ext.checkpoints import dcp_steps, hf_files
from titan_ext.errors import ConfigError
from titan_ext.inputs import degrees, hf_config, jsonl, names

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _parsed():
    from torchtitan.config import ConfigManager

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        return ConfigManager().parse_args(["--job.config_file", "train_configs/debug_gla.toml"])
    finally:
        os.chdir(cwd)


def job(fields: dict | None = None, dump: Path | None = None):
    """A real job config (debug_gla.toml, parsed once) with ``{"section.name": value}`` set, as a TOML would."""
    config = copy.deepcopy(_parsed())
    for path, value in {**(fields or {}), **({"job.dump_folder": str(dump)} if dump else {})}.items():
        section, name = path.split(".")
        setattr(getattr(config, section), name, value)
    return config


def fails(call, *phrases: str) -> str:
    """Run ``call``; it must raise one single-line ``ConfigError`` holding every phrase."""
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in {message!r}"
    assert ";" in message, f"no fix after a semicolon: {message!r}"
    return message


# ---------------------------------------------------------------- JSON-lines datasets

GOOD_JSONL = '{"text": "a"}\n\n{"text": "b", "id": 2}\n'
BAD_JSONL = {
    "missing": (None, "no such file"),
    "directory": ("<dir>", "is a directory"),
    "empty": ("\n  \n", "holds no records"),
    "not json": ('{"text": "a"}\n{"text": "b"}\n{oops\n', "line 3 is not JSON"),
    "not an object": ('{"text": "a"}\n["text"]\n', "line 2 is a JSON list, not an object"),
    "no text field": ('{"text": "a"}\n{"txt": "b"}\n', "line 2 has no 'text' field"),
    "text not a string": ('{"text": 5}\n', "line 1 has a 'text' field of type int, not a string"),
    "not utf-8": (b'{"text": "a"}\n\xff\xfe\x00garbage\n', "line 2 is not JSON"),
    "parquet": (b"PAR1\x15\x04", "is a parquet file; it is read by --training.dataset titan_ext_stream"),
    "gzip": (b"\x1f\x8b\x08\x00", "is gzip-compressed; decompress it"),
    "pretty-printed json": ('{\n  "text": "a"\n}\n', "holds one JSON document over many lines, not JSON lines"),
    "json array": ('[\n  {"text": "a"}\n]\n', "holds one JSON document over many lines, not JSON lines"),
}


def write_jsonl(tmp_path: Path, content) -> str:
    path = tmp_path / "data.jsonl"
    if content == "<dir>":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    return str(path)


@pytest.mark.parametrize("check", [jsonl.check_jsonl_dataset, jsonl.load_jsonl_records])
@pytest.mark.parametrize("case", list(BAD_JSONL))
def test_bad_jsonl_dataset(tmp_path, check, case):
    content, phrase = BAD_JSONL[case]
    path = write_jsonl(tmp_path, content)
    fails(lambda: check(path), f"--training.dataset_path={path!r}", phrase)


def test_jsonl_custom_field_and_option(tmp_path):
    path = write_jsonl(tmp_path, '{"text": "a"}\n')
    fails(lambda: jsonl.check_jsonl_dataset(path, "body", "--validation.dataset_path"),
          "--validation.dataset_path=", "line 1 has no 'body' field")  # fmt: skip


def test_jsonl_preflight_reads_max_lines_only(tmp_path):
    path = write_jsonl(tmp_path, '{"text": "a"}\n' * 3 + "{oops\n")
    jsonl.check_jsonl_dataset(path, max_lines=3)
    fails(lambda: jsonl.check_jsonl_dataset(path, max_lines=None), "line 4 is not JSON")
    fails(lambda: jsonl.load_jsonl_records(path), "line 4 is not JSON")


def test_good_jsonl_dataset(tmp_path):
    path = write_jsonl(tmp_path, GOOD_JSONL)
    jsonl.check_jsonl_dataset(path)
    assert jsonl.load_jsonl_records(path) == [{"text": "a"}, {"text": "b", "id": 2}]


# ---------------------------------------------------------------- HF config.json overrides


@pytest.fixture(scope="module")
def gla_config():
    from fla.models import GLAConfig

    return GLAConfig


@pytest.fixture(scope="module")
def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig


SOURCE = "--titan_ext.hf_config='/p/config.json'"
BAD_GLA = {
    "bool for int": ({"num_heads": True}, "num_heads=True has type bool", "needs int"),
    "float for int": ({"hidden_size": 64.0}, "hidden_size=64.0 has type float", "needs int"),
    "string for int": ({"vocab_size": "2048"}, "vocab_size='2048' has type str", "needs int"),
    "None for int": ({"num_heads": None}, "num_heads=None has type NoneType", "needs int"),
    "int for bool": ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 has type int", "needs bool"),
    "str for optional int": ({"num_kv_heads": "2"}, "num_kv_heads='2'", "needs int | None"),
    "zero layers": ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be > 0"),
    "negative vocab": ({"vocab_size": -5}, "vocab_size=-5 must be > 0"),
    "zero ratio": ({"expand_k": 0}, "expand_k=0 must be > 0"),
    "negative eps": ({"norm_eps": -1e-6}, "norm_eps=-1e-06 must be > 0"),
    "heads do not split width": ({"hidden_size": 64, "num_heads": 3}, "hidden_size=64 is not divisible by num_heads=3"),
    "kv heads do not split heads": ({"num_heads": 4, "num_kv_heads": 3}, "num_heads=4 is not divisible by num_kv_heads=3"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_GLA))
def test_bad_hf_config_gla(gla_config, case):
    config, *phrases = BAD_GLA[case]
    fails(lambda: hf_config.check_hf_config_fields(config, gla_config, SOURCE), SOURCE, *phrases)


BAD_LLAMA = {
    "kv heads": ({"num_attention_heads": 8, "num_key_value_heads": 3}, "num_attention_heads=8 is not divisible by num_key_value_heads=3"),
    "heads without head_dim": ({"hidden_size": 100, "num_attention_heads": 8}, "hidden_size=100 is not divisible", "or give head_dim"),
    "negative eps": ({"rms_norm_eps": 0.0}, "rms_norm_eps=0.0 must be > 0"),
    "list for dict": ({"rope_parameters": [1]}, "rope_parameters=[1] has type list", "| dict"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_LLAMA))
def test_bad_hf_config_llama(llama_config, case):
    config, *phrases = BAD_LLAMA[case]
    fails(lambda: hf_config.check_hf_config_fields(config, llama_config, SOURCE), SOURCE, *phrases)


def test_good_hf_configs(gla_config, llama_config):
    gla = {"model_type": "gla", "architectures": ["GLAForCausalLM"], "torch_dtype": "bfloat16",
           "transformers_version": "4.45.0", "hidden_size": 64, "num_heads": 4, "num_kv_heads": None,
           "expand_k": 1, "norm_eps": 1e-6, "feature_map": None, "auto_map": {"AutoConfig": "x.Y"}}  # fmt: skip
    hf_config.check_hf_config_fields(gla, gla_config, SOURCE)
    # Llama-3.2-1B's config.json: older spellings rope_theta/rope_scaling (mapped to rope_parameters), head_dim set.
    llama = {"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "pretraining_tp": 1,
             "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
             "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "attn_implementation": "sdpa"}  # fmt: skip
    hf_config.check_hf_config_fields(llama, llama_config, SOURCE)
    # head_dim waives heads | hidden_size (Llama-3.2-3B: 3072 / 24 heads of 128).
    hf_config.check_hf_config_fields({"hidden_size": 100, "num_attention_heads": 8, "head_dim": 16},
                                  llama_config, SOURCE)  # fmt: skip


def test_keys_nothing_reads_are_one_warning_line_never_an_error(gla_config, caplog):
    """A typo is among them (the model takes the default): named, with every other such key, in one line."""
    import logging

    with caplog.at_level(logging.WARNING):
        hf_config.check_hf_config_fields({"num_hiden_layers": 3, "hidden_size": 64, "fuse_norms": True},
                                         gla_config, SOURCE)
    lines = [r.getMessage() for r in caplog.records if SOURCE in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"titan_ext: {SOURCE}: GLAConfig"), lines
    assert "'num_hiden_layers', 'fuse_norms'; ignored" in lines[0] and "hidden_size" not in lines[0]


def test_typed_dict_fields_from_typing_and_typing_extensions(gla_config):
    """fla's hybrid ``attn`` is a ``typing_extensions.TypedDict`` (or a list of them): a dict (or list) is
    valid, anything else is one line; a ``typing.TypedDict`` is recognised the same way."""
    import typing

    import typing_extensions

    hf_config.check_hf_config_fields({"attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2}}, gla_config, SOURCE)
    hf_config.check_hf_config_fields({"attn": [{"layers": [1], "num_heads": 4}]}, gla_config, SOURCE)
    fails(lambda: hf_config.check_hf_config_fields({"attn": "1,3"}, gla_config, SOURCE), SOURCE,
          "attn='1,3' has type str", "needs AttentionSpec | list | None")
    for TypedDict in (typing.TypedDict, typing_extensions.TypedDict):
        Spec = TypedDict("Spec", {"layers": list})
        assert hf_config._is_instance({"layers": [0]}, Spec) and not hf_config._is_instance([0], Spec)


def test_a_json_list_is_a_tuple_field():
    """JSON has no tuples: fla's Mamba2 config.json holds ``A_init_range`` (``tuple[float, float]``) as a list, as
    ``save_pretrained`` writes it; a string there is still refused."""
    from fla.models import Mamba2Config

    hf_config.check_hf_config_fields({"A_init_range": [1, 16], "dt_limit": [0.0, 0.05]}, Mamba2Config, SOURCE)
    fails(lambda: hf_config.check_hf_config_fields({"A_init_range": "1,16"}, Mamba2Config, SOURCE), SOURCE,
          "A_init_range='1,16' has type str", "needs tuple")


# ---------------------------------------------------------------- HF safetensors directories


def hf_dir(tmp_path: Path) -> Path:
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gla"}))
    save_file({"a": torch.zeros(64, 64), "b": torch.ones(8)}, str(path / "model.safetensors"))
    return path


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_HF_DIRS = {
    "missing": (lambda p: p.rename(p.parent / "gone"), "is not a directory"),
    "a file": (lambda p: shutil.rmtree(p) or p.write_text("x"), "is not a directory"),
    "no config.json": (lambda p: (p / "config.json").unlink(), "has no config.json"),
    "config not json": (lambda p: (p / "config.json").write_text("{oops"), "config.json is not valid JSON"),
    "config not object": (lambda p: (p / "config.json").write_text("[1]"), "config.json holds no JSON object"),
    "no safetensors": (lambda p: (p / "model.safetensors").unlink(), "holds no *.safetensors file"),
    "garbage file": (lambda p: (p / "model.safetensors").write_bytes(os.urandom(300)), "model.safetensors has no readable safetensors header"),
    "tiny file": (lambda p: (p / "model.safetensors").write_bytes(b"abc"), "has no readable safetensors header"),
    "header not json": (lambda p: (p / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops"), "has no readable safetensors header"),
    "cut in half": (lambda p: cut_in_half(p / "model.safetensors"), "model.safetensors is truncated"),
    "zero-length": (lambda p: (p / "model.safetensors").write_bytes(b""), "model.safetensors has no readable safetensors header"),
    "stray bytes": (lambda p: (p / "model.safetensors").open("ab").write(b"xyz"), "model.safetensors has 3 stray bytes"),
    "missing shard": (lambda p: (p / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}})),
        "names model-00002-of-00002.safetensors, which is missing"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_HF_DIRS))
def test_bad_hf_checkpoint_dir(tmp_path, case):
    damage, phrase = BAD_HF_DIRS[case]
    path = hf_dir(tmp_path)
    damage(path)
    fails(lambda: hf_files.check_hf_checkpoint_dir(str(path)), f"--checkpoint.initial_load_path={str(path)!r}", phrase)


def test_truncation_caught_by_header_only(tmp_path):
    """Cutting just the last byte is caught too (the header still parses)."""
    path = hf_dir(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-1])
    fails(lambda: hf_files.check_hf_checkpoint_dir(str(path), "--model.hf_assets_path"), "--model.hf_assets_path=",
          f"({len(data) - 1} of {len(data)} bytes)")  # fmt: skip


def test_good_hf_checkpoint_dir(tmp_path):
    path = hf_dir(tmp_path)
    save_file({"c": torch.zeros(3)}, str(path / "model-2.safetensors"))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model.safetensors", "c": "model-2.safetensors"}})
    )
    hf_files.check_hf_checkpoint_dir(str(path))


# ---------------------------------------------------------------- torch DCP checkpoints

# As torchtitan writes them: plain parameter FQNs next to optimizer/lr_scheduler/dataloader/train_state entries.
EXPECTED = {"model.embeddings.weight": (32, 8), "model.layers.0.attn.q_proj.weight": (4, 8), "lm_head.weight": (32, 8)}


def save_dcp(path: Path, shapes: dict[str, tuple[int, ...]]) -> str:
    state = {key: torch.zeros(shape) for key, shape in shapes.items()}
    state["optimizer"] = {"state": {"lm_head.weight": {"exp_avg": torch.zeros(2)}}}
    state["train_state"] = {"step": 10}
    with warnings.catch_warnings():  # no process group: DCP warns that it saves as a single process
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return str(path)


def break_metadata(path: Path, how: str) -> None:
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes({"cut": data[: len(data) // 2], "garbage": b"not a pickle", "empty": b""}[how])


OPTION = "--checkpoint.initial_load_path"
WHERE = f"{OPTION}='the/step'"
BAD_DCP = {
    "other model": ({"model.embed_tokens.weight": (32, 8), "lm_head.weight": (32, 8),
                     "model.layers.0.self_attn.q_proj.weight": (4, 8)},
                    "written by another model or flavor: no 'model.embed_tokens.weight' (and 1 more)"),
    "train_state is no tensor": ({**EXPECTED, "train_state.step": ()}, "no 'train_state.step'"),
    "other flavor": ({**EXPECTED, "lm_head.weight": (64, 8)},
                     "holds 'lm_head.weight' of shape [32, 8], this model needs [64, 8]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_DCP))
def test_dcp_checkpoint_of_another_model(tmp_path, case):
    expected, phrase = BAD_DCP[case]
    path = save_dcp(tmp_path / "step-10", EXPECTED)
    message = fails(lambda: dcp_steps.check_dcp_checkpoint(path, expected, WHERE), WHERE, phrase)
    assert "--model.name/--model.flavor" in message


def test_good_dcp_checkpoint(tmp_path):
    path = save_dcp(tmp_path / "step-10", {**EXPECTED, "extra.weight": (2,)})
    dcp_steps.check_dcp_checkpoint(path, EXPECTED, WHERE)
    dcp_steps.check_dcp_checkpoint(path, {"lm_head.weight": (32, 8)}, WHERE)


def shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


# Each damage as a disk or a killed copy leaves it, to a step saved by DCP alone (no titan_ext manifest: checked
# by its files' sizes against .metadata). tests/test_damaged_checkpoints.py damages FSDP2 and PP2 saves with one.
DAMAGED_DCP = {
    "missing folder": (lambda p: shutil.rmtree(p), "no such folder"),
    "no .metadata": (lambda p: (p / ".metadata").unlink(), "no .metadata: an unfinished save"),
    "truncated .metadata": (lambda p: break_metadata(p, "cut"), ".metadata is unreadable (UnpicklingError)"),
    "garbage .metadata": (lambda p: break_metadata(p, "garbage"), ".metadata is unreadable"),
    "empty .metadata": (lambda p: break_metadata(p, "empty"), ".metadata is unreadable (EOFError)"),
    "truncated shard": (lambda p: cut_in_half(shard(p)), "__0_0.distcp is truncated ("),
    "zero-length shard": (lambda p: shard(p).write_bytes(b""), "__0_0.distcp is truncated (0 of "),
    "missing shard": (lambda p: shard(p).unlink(), "__0_0.distcp is missing"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DAMAGED_DCP))
def test_a_damaged_dcp_step_is_one_line_naming_the_file(tmp_path, case):
    damage, phrase = DAMAGED_DCP[case]
    path = tmp_path / "step-10"
    save_dcp(path, EXPECTED)
    damage(path)
    fails(lambda: dcp_steps.check_dcp_step(str(path), WHERE, "the fix"), f"{WHERE}: {phrase}", "; the fix")


def test_a_titan_ext_save_finds_bytes_changed_within_a_file(tmp_path):
    """With titan_ext's save (its manifest, written before DCP's .metadata) a flipped byte is found; DCP alone
    records no checksum, so the same step saved without it passes its size check."""
    from titan_ext import patching
    from titan_ext.checkpoints import host_patches as checkpoint_patches

    with patching.scoped(checkpoint_patches.CHECKPOINT_MANIFEST):
        path = Path(save_dcp(tmp_path / "titan_ext" / "step-10", EXPECTED))
    plain = Path(save_dcp(tmp_path / "dcp" / "step-10", EXPECTED))
    assert (path / dcp_steps.MANIFEST).is_file() and not (plain / dcp_steps.MANIFEST).exists()
    assert dcp_steps.step_damage(str(path)) is None
    for step in (path, plain):
        data = bytearray(shard(step).read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard(step).write_bytes(bytes(data))
    assert dcp_steps.step_damage(str(path)) == "__0_0.distcp does not match its checksum (bytes changed since the save)"
    assert dcp_steps.step_damage(str(plain)) is None


def test_each_rank_reads_the_checksums_of_its_share_of_the_files(tmp_path, monkeypatch):
    """Rank r of N sums every N-th file: the job reads its checkpoint once in all; sizes every rank checks."""
    from titan_ext import patching
    from titan_ext.checkpoints import host_patches as checkpoint_patches

    with patching.scoped(checkpoint_patches.CHECKPOINT_MANIFEST):
        path = Path(save_dcp(tmp_path / "step-10", EXPECTED))
    data = bytearray(shard(path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard(path).write_bytes(bytes(data))
    files = sorted(dcp_steps._read_manifest(str(path)))
    monkeypatch.setenv("WORLD_SIZE", str(len(files) + 1))
    monkeypatch.setenv("RANK", str(len(files)))  # a rank whose share is empty
    assert dcp_steps.step_damage(str(path)) is None
    monkeypatch.setenv("RANK", str(files.index(shard(path).name)))
    assert dcp_steps.step_damage(str(path)) == f"{shard(path).name} does not match its checksum (bytes changed since the save)"


# ---------------------------------------------------------------- which checkpoint torchtitan loads


def make_steps(dump: Path, complete=(), partial=()) -> Path:
    folder = dump / "checkpoint"
    for step in complete:
        save_dcp(folder / f"step-{step}", {"w": (2,)})
    for step in partial:
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / "__0_0.distcp").write_bytes(b"partial")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_checkpoint_to_load(tmp_path):
    dump = tmp_path / "run"
    initial = save_dcp(tmp_path / "seed" / "step-0", {"w": (2,)})
    hf = str(hf_dir(tmp_path))
    on = {"checkpoint.enable": True}
    assert dcp_steps.checkpoint_to_load(job(dump=dump)) is None  # checkpointing off
    assert dcp_steps.checkpoint_to_load(job(on, dump)) is None  # nothing yet
    assert dcp_steps.checkpoint_to_load(job({**on, "checkpoint.initial_load_path": initial}, dump)) == (initial, "dcp")
    hf_fields = {**on, "checkpoint.initial_load_in_hf": True, "checkpoint.initial_load_path": hf}
    assert dcp_steps.checkpoint_to_load(job(hf_fields, dump)) == (hf, "hf")
    assert dcp_steps.checkpoint_to_load(job({**on, "checkpoint.initial_load_in_hf": True}, dump)) == (
        "titan_ext/assets/tiny", "hf")  # fmt: skip
    seed = {**on, "checkpoint.create_seed_checkpoint": True, "checkpoint.initial_load_path": str(tmp_path / "no")}
    assert dcp_steps.checkpoint_to_load(job(seed, dump)) is None  # a seed run saves, loads nothing
    folder = make_steps(dump, complete=(5, 10), partial=(15,))
    latest = job({**on, "checkpoint.initial_load_path": initial}, dump)
    assert dcp_steps.checkpoint_to_load(latest) == (str(folder / "step-10"), "dcp")  # step-15 is unfinished
    assert dcp_steps.checkpoint_to_load(job({**on, "checkpoint.load_step": 5}, dump)) == (str(folder / "step-5"), "dcp")


def test_checkpoint_folder_with_only_partial_steps_loads_nothing(tmp_path):
    """torchtitan 0.2.2: once the folder exists, initial_load_path is ignored; no finished step = fresh start."""
    dump = tmp_path / "run"
    make_steps(dump, partial=(5,))
    initial = save_dcp(tmp_path / "seed" / "step-0", {"w": (2,)})
    config = job({"checkpoint.enable": True, "checkpoint.initial_load_path": initial}, dump)
    assert dcp_steps.checkpoint_to_load(config) is None


def test_a_step_folder_passed_over_is_named_in_one_warning(tmp_path, caplog):
    """An empty step folder as the only step (and an unfinished save): training starts from step 1, and says why."""
    from titan_ext.host import preflight

    dump = tmp_path / "run"
    make_steps(dump, partial=(5,))
    (dump / "checkpoint" / "step-7").mkdir()
    with caplog.at_level("WARNING"):
        preflight._check_steps_to_resume(job({"checkpoint.enable": True}, dump))
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"titan_ext: --checkpoint.folder={str(dump / 'checkpoint')!r}: passed over step-7 (unfinished: no .metadata), "
        "step-5 (unfinished: no .metadata); training starts from step 1"]


def test_dataloader_to_load_follows_torchtitans_rule(tmp_path):
    """torchtitan restores the dataloader only from a full load: never from step-0 (a seed checkpoint, loaded
    model-only), an initial checkpoint with initial_load_model_only, or with the dataloader excluded."""
    dump = tmp_path / "run"
    initial = save_dcp(tmp_path / "elsewhere" / "step-3", {"w": (2,)})
    on = {"checkpoint.enable": True}
    assert dcp_steps.dataloader_to_load(job({**on, "checkpoint.initial_load_path": initial}, dump)) is None
    full_initial = {**on, "checkpoint.initial_load_path": initial, "checkpoint.initial_load_model_only": False}
    assert dcp_steps.dataloader_to_load(job(full_initial, dump)) == initial
    folder = make_steps(dump, complete=(0,))
    assert dcp_steps.dataloader_to_load(job(on, dump)) is None  # the seed: torchtitan's model_only = step == 0
    make_steps(dump, complete=(4,))
    assert dcp_steps.dataloader_to_load(job(on, dump)) == str(folder / "step-4")
    assert dcp_steps.dataloader_to_load(job({**on, "checkpoint.load_step": 0}, dump)) is None
    assert dcp_steps.dataloader_to_load(job({**on, "checkpoint.exclude_from_loading": ["dataloader"]}, dump)) is None


def test_a_seed_saved_by_one_rank_is_no_data_position_to_re_split(tmp_path):
    """What StreamDataloader re-splits and the degree check compares: nothing for step-0, the ranks' for later."""
    folder = tmp_path / "run" / "checkpoint"
    for step, ranks in ((0, 1), (4, 2)):
        dataloader = {**{f"dp_rank_{r}": b"x" for r in range(ranks)}, "world_size": ranks}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.zeros(2), "dataloader": dataloader}, checkpoint_id=str(folder / f"step-{step}"))
    on = {"checkpoint.enable": True}
    assert dcp_steps.dataloader_resume_degree(job({**on, "checkpoint.load_step": 0}, tmp_path / "run")) is None
    assert dcp_steps.dcp_dataloader_ranks(str(folder / "step-0")) == 1  # saved, but torchtitan never loads it
    assert dcp_steps.dataloader_resume_degree(job(on, tmp_path / "run")) == 2


BAD_LOADS = {
    "load_step not saved": (dict(complete=(5,), partial=(10,)), {"checkpoint.load_step": 10},
                            "--checkpoint.load_step=10: no readable step-10 in", "(complete steps: [5])"),
    "load_step without folder": (None, {"checkpoint.load_step": 5}, "--checkpoint.load_step=5 but", "does not exist"),
    "initial path missing": (None, {"checkpoint.initial_load_path": "{tmp}/nowhere"},
                             "--checkpoint.initial_load_path=", "/nowhere': no such folder; point it at a whole DCP"),
    "initial path without .metadata": (None, {"checkpoint.initial_load_path": "{tmp}"},
                                       "no .metadata: an unfinished save; point it at a whole DCP step folder"),
    "damaged newest step": (dict(complete=(5, 10)), {}, "--checkpoint.folder=", "step-10 is damaged: .metadata is "
                            "unreadable (UnpicklingError); resume from an older step with --checkpoint.load_step 5 "
                            "(steps with every file at full size: 5), or set --titan_ext.damaged_checkpoint skip"),
    "damaged only step": (dict(complete=(10,)), {}, "step-10 is damaged: .metadata is unreadable",
                          "no older step is whole: move"),
    "damaged step asked for": (dict(complete=(5, 10)), {"checkpoint.load_step": 10},
                               "--checkpoint.load_step=10: step-10 in", ".metadata is unreadable (UnpicklingError); "
                               "pick another step"),
    "unknown policy": (dict(complete=(5,)), {"titan_ext.damaged_checkpoint": "resume"},
                       "--titan_ext.damaged_checkpoint='resume' is not one of ('stop', 'skip')"),
    "hf without model_only": (None, {"checkpoint.initial_load_in_hf": True, "checkpoint.initial_load_model_only": False},
                              "--checkpoint.initial_load_in_hf loads only the model", "initial_load_model_only"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_bad_checkpoint_to_load(tmp_path, case):
    steps, fields, *phrases = BAD_LOADS[case]
    dump = tmp_path / "run"
    if steps:
        make_steps(dump, **steps)
    if "damaged" in case:
        break_metadata(dump / "checkpoint" / "step-10", "cut")
    fields = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in fields.items()}
    config = job({"checkpoint.enable": True, **fields}, dump)
    fails(lambda: dcp_steps.checkpoint_to_load(config), *phrases)


# ---------------------------------------------------------------- numbers and parallel degrees

BAD_NUMBERS = {
    "seq_len": ({"training.seq_len": 0}, "--training.seq_len=0 must be positive"),
    "local batch": ({"training.local_batch_size": -2}, "--training.local_batch_size=-2 must be positive"),
    "steps": ({"training.steps": 0}, "--training.steps=0 must be positive"),
    "global batch 0": ({"training.global_batch_size": 0}, "--training.global_batch_size=0 is invalid"),
    "global batch -3": ({"training.global_batch_size": -3}, "--training.global_batch_size=-3 is invalid"),
    "tp 0": ({"parallelism.tensor_parallel_degree": 0}, "--parallelism.tensor_parallel_degree=0 must be >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_NUMBERS))
def test_bad_positive_numbers(case):
    fields, phrase = BAD_NUMBERS[case]
    config = job(fields)
    fails(lambda: degrees.check_positive_numbers(config), phrase)


def test_good_positive_numbers():
    degrees.check_positive_numbers(job())
    degrees.check_positive_numbers(job({"training.global_batch_size": 16}))


def degree_values(**values) -> dict:
    return {f"parallelism.{name}_degree": value for name, value in values.items()}


BAD_DEGREES = {
    "tp 0": (2, degree_values(tensor_parallel=0), "--parallelism.tensor_parallel_degree=0 must be >= 1"),
    "pp -1": (2, degree_values(pipeline_parallel=-1), "--parallelism.pipeline_parallel_degree=-1 must be >= 1"),
    "cp 0": (2, degree_values(context_parallel=0), "context_parallel_degree=0 must be >= 1"),
    "ep 0": (2, degree_values(expert_parallel=0), "expert_parallel_degree=0 must be >= 1"),
    "etp 0": (2, degree_values(expert_tensor_parallel=0), "expert_tensor_parallel_degree=0 must be >= 1"),
    "replicate 0": (2, degree_values(data_parallel_replicate=0), "data_parallel_replicate_degree=0 must be >= 1"),
    "shard -2": (2, degree_values(data_parallel_shard=-2), "data_parallel_shard_degree=-2 must be -1 (the remaining ranks) or >= 1"),
    "product too big": (2, degree_values(data_parallel_shard=2, tensor_parallel=2),
                        "--parallelism.data_parallel_shard_degree=2 x --parallelism.tensor_parallel_degree=2 = 4 ranks, "
                        "but torchrun started 2 (WORLD_SIZE)"),
    "product too small": (4, degree_values(data_parallel_shard=1),
                          "--parallelism.data_parallel_shard_degree=1 = 1 ranks, but torchrun started 4"),
    "rest does not divide": (6, degree_values(tensor_parallel=4),
                             "--parallelism.tensor_parallel_degree=4 = 4 ranks does not divide the 6 ranks"),
    "others exceed world": (2, degree_values(tensor_parallel=4), "does not divide the 2 ranks"),
    "etp neither 1 nor tp": (8, degree_values(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=4),
                             "--parallelism.expert_tensor_parallel_degree=4 must be 1 or --parallelism.tensor_parallel_degree=2"),
    "ep does not split": (2, degree_values(expert_parallel=4),
                          "--parallelism.expert_parallel_degree=4 x --parallelism.expert_tensor_parallel_degree=1 does not divide"),
    "ep does not split cp": (3, degree_values(context_parallel=3, expert_parallel=2),  # torchtitan's ep in dp_shard x cp
                             "does not divide data_parallel_shard x context_parallel x tensor_parallel = 3"),
    "global batch": (2, {"training.global_batch_size": 12},
                     "--training.global_batch_size=12 is not a multiple of --training.local_batch_size=4 x 2 data-parallel ranks = 8"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_DEGREES))
def test_bad_parallel_degrees(case):
    world_size, fields, phrase = BAD_DEGREES[case]
    config = job(fields)
    fails(lambda: degrees.check_parallel_degrees(config, world_size), phrase)


def test_good_parallel_degrees():
    degrees.check_parallel_degrees(job(), 2)  # shard -1 takes both ranks
    degrees.check_parallel_degrees(job(degree_values(tensor_parallel=2, data_parallel_shard=1)), 2)
    degrees.check_parallel_degrees(job({**degree_values(tensor_parallel=2), "training.global_batch_size": 24}), 6)
    degrees.check_parallel_degrees(job(degree_values(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2)), 8)
    degrees.check_parallel_degrees(job(degree_values(context_parallel=2, expert_parallel=2)), 2)  # EP over the CP ranks


# ---------------------------------------------------------------- registry names

# TOML values reach torchtitan unvalidated (its CLI checks only some, e.g. the AC mode).
BAD_NAMES = {
    "dataset": ({"training.dataset": "c5"}, "--training.dataset='c5' is not a registered dataset",
                "use one of c4, c4_test, c4_validation"),
    "validation dataset": ({"validation.enable": True, "validation.dataset": "c4_valid"},
                           "--validation.dataset='c4_valid' is not a registered dataset", "use 'c4_validation'"),
    "ac mode": ({"activation_checkpoint.mode": "fullx"}, "--activation_checkpoint.mode='fullx' is not a mode", "use 'full'"),
    "compile backend": ({"compile.backend": "inductr"}, "--compile.backend='inductr' is not a torch.compile backend",
                        "use 'inductor'"),
    "compile component": ({"compile.components": ["model", "los"]}, "--compile.components: 'los' is not a component",
                          "use 'loss'"),
    "converter float8": ({"model.converters": ["float8"]}, "--model.converters: 'float8' is not a converter name",
                         "use 'quantize.linear.float8'"),
    "converter fp8": ({"model.converters": ["fp8"]}, "'fp8' is not a converter name", "use 'quantize.linear.float8'"),
    "converter typo": ({"model.converters": ["quantize.linear.mxx"]}, "'quantize.linear.mxx'", "use 'quantize.linear.mx'"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_bad_names(case):
    fields, *phrases = BAD_NAMES[case]
    config = job({"training.dataset": "c4_test", **fields})
    fails(lambda: names.check_names(config), *phrases)


def test_good_names():
    config = job({"training.dataset": "c4_test", "model.converters": ["quantize.linear.float8"],
                  "compile.backend": "aot_eager", "activation_checkpoint.mode": "selective",
                  "validation.enable": True, "validation.dataset": "c4_validation"})  # fmt: skip
    names.check_names(config)


def test_did_you_mean_puts_case_and_titan_ext_first():
    own, theirs = {"fla", "fla_gla", "hf_llama"}, {"llama3", "llama4", "qwen3"}
    assert names.did_you_mean("fla_glx", own, theirs)[:1] == ["fla_gla"]
    assert names.did_you_mean("llama", own, theirs)[0] == "hf_llama"  # titan_ext's before torchtitan's
    assert names.did_you_mean("DebugModel", {"debugmodel", "340M"}) == ["debugmodel"]
    message = fails(lambda: (_ for _ in ()).throw(names.unknown_name(
        "--model.name='fla_glx'", "fla_glx", "a registered train spec", {"titan_ext": own, "torchtitan": theirs},
        {"vlm"}, "torchtitan experiments")), "did you mean 'fla_gla'", "(titan_ext: fla, fla_gla, hf_llama; "
        "torchtitan: llama3, llama4, qwen3; and 1 torchtitan experiments)")
    assert message.startswith("--model.name='fla_glx' is not a registered train spec; did you mean 'fla_gla'")


# ---------------------------------------------------------------- tokenizer assets

BAD_TOKENIZER_DIRS = {
    "empty folder": ({}, "holds no tokenizer.json (nor vocab.json/vocab.txt; it holds nothing)"),
    "config only": ({"tokenizer_config.json": "{}"}, "holds no tokenizer.json (nor vocab.json/vocab.txt; it holds "
                                                     "tokenizer_config.json); copy the model's tokenizer.json"),
    "tiktoken's format": ({"tiktoken.model": "", "tokenizer_config.json": "{}"}, "holds no tokenizer.json but a "
                          "tokenizer in tiktoken's format (tiktoken.model); write its tokenizer.json: python -m "
                          "titan_ext.tokenizer_json /"),
    "broken tokenizer.json": ({"tokenizer.json": '{"version": "1.0", '}, "tokenizer.json cannot be loaded (",
                              "download it again"),
    "zero-byte tokenizer.json": ({"tokenizer.json": ""}, "tokenizer.json cannot be loaded (EOF while parsing"),
    "not a tokenizer": ({"tokenizer.json": '{"a": 1}'}, "tokenizer.json cannot be loaded ("),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_TOKENIZER_DIRS))
def test_bad_tokenizer_dir(tmp_path, case):
    from titan_ext.inputs import tokenizer

    files, *phrases = BAD_TOKENIZER_DIRS[case]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    fails(lambda: tokenizer.check_tokenizer_dir(str(tmp_path), str(tmp_path)), "--model.hf_assets_path=", *phrases)


BAD_TIKTOKEN_FOLDERS = {
    "no tiktoken.model": ({"tiktoken.model": None}, "holds no tiktoken.model; point it at a hub folder"),
    "a line not base64": ({"tiktoken.model": "IQ== 0\nnot-base64! 1\n"},
                          "tiktoken.model:2: 'not-base64! 1' is not 'base64(token bytes) rank'"),
    "ranks with a hole": ({"tiktoken.model": "IQ== 0\nIg== 2\n"}, "its ranks are not 0..1, each once"),
    "no pat_str": ({"tokenization_kimi.py": "x = 1\n"}, "needs one pat_str assignment", "found none in its *.py files"),
    "two pat_str": ({"other.py": "pat_str = 'a'\n"}, "found 2 different ones in ['other.py', 'tokenization_kimi.py']"),
    "a Python file that is not Python": ({"tokenization_kimi.py": "pat_str = (\n"}, "tokenization_kimi.py is not Python ("),
    "pat_str computed": ({"tokenization_kimi.py": "pat_str = make()\n"}, "pat_str in ['tokenization_kimi.py'] is not "
                                                                         "built of string literals"),
    "no tokenizer_config.json": ({"tokenizer_config.json": None}, "no tokenizer_config.json (its special tokens)"),
    "a special id among the ranks": ({"tokenizer_config.json": '{"added_tokens_decoder": {"3": {"content": "[X]"}}}'},
                                     "added_tokens_decoder gives ids [3] that tiktoken.model's ranks hold"),
    "a special token that is a BPE token": ({"tokenizer_config.json": '{"added_tokens_decoder": {"256": {"content": "!"}}}'},
                                            "special tokens ['!'] are also BPE tokens of tiktoken.model"),
    "tokenizer_config.json not JSON": ({"tokenizer_config.json": "{"}, "tokenizer_config.json is not JSON ("),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_TIKTOKEN_FOLDERS))
def test_bad_tiktoken_folder(tmp_path, case):
    """``python -m titan_ext.tokenizer_json``: one line, and nothing written."""
    import tiktoken_folder

    from titan_ext.tokenizer_json import write_tokenizer_json

    tiktoken_folder.write_folder(tmp_path, tiktoken_folder.train_ranks("", merges=0))  # the 256 bytes
    files, *phrases = BAD_TIKTOKEN_FOLDERS[case]
    for name, text in files.items():
        (tmp_path / name).unlink() if text is None else (tmp_path / name).write_text(text)
    fails(lambda: write_tokenizer_json(str(tmp_path)), *phrases)
    assert not (tmp_path / "tokenizer.json").exists()


def test_tokenizer_dir_checked_before_any_model(tmp_path):
    """Through the job's first checks (and the tokenizer builder): a file, and a folder without a tokenizer."""
    from titan_ext import data
    from titan_ext.host import preflight

    tokenizer_json = str(REPO / "titan_ext" / "assets" / "tiny" / "tokenizer.json")
    fails(lambda: preflight.check_job_config(job({"model.hf_assets_path": tokenizer_json}), 1),
          "is a file; point it at the directory holding tokenizer.json")
    fails(lambda: data.build_tokenizer(job({"model.hf_assets_path": str(tmp_path)})), "holds no tokenizer.json")
    preflight.check_job_config(job(), 1)  # the shipped tokenizer


def test_hf_config_directory_without_config_json(tmp_path):
    from titan_ext.models.args import load_hf_config_json

    fails(lambda: load_hf_config_json(str(tmp_path)), "is a directory without config.json; point it at")
