"""Bad configs end the job before any model is built, in one line naming the option and the fix.

Every class of bad input is checked in-process, through the same functions a
job runs (``preflight.check_job_config`` at the Trainer's import of
titan_ext, then the model args' ``update_from_config``). Real 2-rank
launches, started together, check what the user sees: the line once (rank
0), exit code 2 on every rank, no Python traceback from any rank, nothing
printed by the ranks after it, and the line again as the root cause at the end
of torchrun's failure summary (the worker's error file).
"""

import json
import subprocess
import sys

import pytest
import torch
from helpers import first_error
from launch import CONFIGS, REPO
from torch.distributed.checkpoint import save as dcp_save
from torchtitan.protocols.train_spec import get_train_spec

import titan_ext  # noqa: F401  (train specs)
from titan_ext.checkpoints.hf import checkpoint_config
from titan_ext.errors import ConfigError
from titan_ext.models.adapter import meta_model

GLA = ["--job.config_file", str(CONFIGS / "debug_gla.toml")]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def generic(spec: str, config: str) -> list[str]:
    """A generic spec (``fla``/``hf``) whose architecture is the config file ``{tmp}/config``."""
    return [*GLA, "--model.name", spec, "--titan_ext.hf_config", f"{{tmp}}/{config}"]
HF_LOAD = ["--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path"]
DCP_LOAD = ["--checkpoint.enable", "--checkpoint.initial_load_path"]


def write_inputs(tmp):
    """Files the cases point at ({tmp}/...)."""
    files = {
        "heads3.json": json.dumps({"num_heads": 3, "hidden_size": 96}),
        "unbuildable.json": json.dumps({"num_heads": 3}),  # fla: key dim 32 does not split into 3 heads
        "mlp101.json": json.dumps({"intermediate_size": 101}),
        "fused_chunk.json": json.dumps({"attn_mode": "fused_chunk"}),
        "short_conv.json": json.dumps({"use_short_conv": True, "conv_size": 4}),
        "vocab100.json": json.dumps({"vocab_size": 100}),
        "wrong_type.json": json.dumps({"hidden_size": "64"}),
        "impossible.json": json.dumps({"num_hidden_layers": 0}),
        "bad.json": "{oops",
        "empty.jsonl": "",
        "not_json.jsonl": '{"text": "fine"}\nnot json\n',
        "no_text.jsonl": '{"body": "x"}\n',
        "hf_mismatch/config.json": json.dumps(
            {"model_type": "gla", "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 2048}
        ),
        "hf_other_model/config.json": json.dumps({"model_type": "llama"}),
        "no_step/readme.txt": "nothing here",
        "no_model_type.json": json.dumps({"hidden_size": 64}),
        "qwen3_moe.json": (CONFIGS / "debug_qwen3_moe.json").read_text(),
        "unknown_type.json": json.dumps({"model_type": "gla_typo"}),
        "hgrn.json": json.dumps({"model_type": "hgrn", "hidden_size": 64, "num_heads": 4, "num_hidden_layers": 1}),
        "mamba2_unbuildable.json": json.dumps({"model_type": "mamba2", "hidden_size": 64, "num_heads": 4, "head_dim": 8}),
        "opt.json": json.dumps({"model_type": "opt", "hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 128,
                                "num_hidden_layers": 1, "vocab_size": 2048, "word_embed_proj_dim": 64}),
        "ac_fullish.toml": (CONFIGS / "debug_gla.toml").read_text().replace('mode = "none"', 'mode = "fullish"'),
        "pp_names.toml": (CONFIGS / "debug_gla.toml").read_text().replace(
            "[parallelism]\n", '[parallelism]\nmodule_fqns_per_model_part = [["tok_embeddings", "model.layers.0"], '
            '["model.layers.1", "model.norm", "lm_head"]]\n'),
    }
    for name, content in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(content)
    (tmp / "a_directory.jsonl").mkdir()
    (tmp / "late_bad").mkdir()  # 10 shards (5 per rank); the preflight's first look reads the first 8
    for n in range(10):
        lines = [json.dumps({"text": f"shard {n} document {i} " + "word " * 30}) for i in range(6)]
        if n == 9:
            lines[2] = '{"text": "cut off'
        (tmp / "late_bad" / f"part-{n}.jsonl").write_text("\n".join(lines) + "\n")
    debug_gla = checkpoint_config(get_train_spec("fla_gla").model_args["debugmodel"])
    for name, body in (("hf_corrupt", b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}"), ("hf_truncated", None)):
        debug_gla.save_pretrained(tmp / name)
        if body is None:  # a valid header promising 4 KiB of data, then the file ends
            header = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}).encode()
            body = len(header).to_bytes(8, "little") + header + b"\0" * 100
        (tmp / name / "model.safetensors").write_bytes(body)
    dcp_save({"lm_head.weight": torch.zeros(3, 3)}, checkpoint_id=str(tmp / "dcp_other_model"))
    debug_gla.save_pretrained(tmp / "hf_wrong_shape")  # the flavor's config.json over weights of another size
    from safetensors.torch import save_file

    save_file({"model.embeddings.weight": torch.zeros(1000, 64)}, tmp / "hf_wrong_shape" / "model.safetensors")
    # a run's own checkpoint, saved by 2 data-parallel ranks (their dataloader positions, as torchtitan keys them)
    model = {name: torch.zeros(p.shape) for name, p in meta_model(get_train_spec("fla_gla").model_args["debugmodel"]).named_parameters()}
    dataloader = {"dp_rank_0": b"x", "dp_rank_1": b"y", "world_size": 2}
    dcp_save({**model, "dataloader": dataloader}, checkpoint_id=str(tmp / "dp2_run" / "checkpoint" / "step-2"))
    # a run whose newest step lost the second half of its shard (a copy cut short, a full disk)
    for step in (2, 4):
        dcp_save(model, checkpoint_id=str(tmp / "damaged_step" / "checkpoint" / f"step-{step}"))
    shard = tmp / "damaged_step" / "checkpoint" / "step-4" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (tmp / "dcp_corrupt").mkdir()
    (tmp / "dcp_corrupt" / ".metadata").write_bytes(b"\x80\x04garbage")


# name -> (CLI arguments, world size, expected message)
CASES = {
    # names
    "unknown model name": ([*GLA, "--model.name", "fla_glx"], 1,
                           "--model.name='fla_glx' is not a registered train spec; did you mean 'fla_gla'"),
    "unknown flavor": ([*GLA, "--model.flavor", "huge"], 1, "--model.flavor='huge' is not a flavor of fla_gla"),
    "wrong-case flavor": ([*GLA, "--model.flavor", "DebugModel"], 1, "; did you mean 'debugmodel'?"),
    "unknown dataset": ([*GLA, "--training.dataset", "c5"], 1, "--training.dataset"),
    # (the CLI flag is checked by tyro; a TOML value is not)
    "unknown ac mode": (["--job.config_file", "{tmp}/ac_fullish.toml"], 1, "--activation_checkpoint.mode"),
    "unknown compile backend": ([*GLA, "--compile.enable", "--compile.backend", "inductr"], 1, "--compile.backend"),
    "unknown converter": ([*GLA, "--model.converters", "float8"], 1, "use 'quantize.linear.float8'"),
    "bad nonfinite policy": ([*GLA, "--titan_ext.nonfinite_loss", "ignore"], 1, "--titan_ext.nonfinite_loss='ignore'"),
    "bad bad_records policy": ([*GLA, "--titan_ext.bad_records", "drop"], 1, "--titan_ext.bad_records='drop' is not one of"),
    # numbers and degrees
    "zero seq_len": ([*GLA, "--training.seq_len", "0"], 1, "--training.seq_len"),
    "negative batch": ([*GLA, "--training.local_batch_size", "-2"], 1, "--training.local_batch_size"),
    "zero steps": ([*GLA, "--training.steps", "0"], 1, "--training.steps"),
    "zero tp degree": ([*GLA, "--parallelism.tensor_parallel_degree", "0"], 1, "--parallelism.tensor_parallel_degree"),
    "degrees vs world size": ([*GLA, "--parallelism.data_parallel_shard_degree", "2", *TP2[:2]], 2, "WORLD_SIZE"),
    # parallelism titan_ext cannot do
    # pipeline parallelism
    "pp stages exceed the blocks": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
         "--parallelism.pipeline_parallel_first_stage_less_layers", "0",
         "--parallelism.pipeline_parallel_last_stage_less_layers", "0"], 2, "cannot split 2 blocks into 4 stages",
    ),
    "pp layers per stage do not divide": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_layers_per_stage", "4"], 2, "do not divide over",
    ),
    "pp stages per rank the schedule cannot run": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_layers_per_stage", "1"], 2, "runs exactly 1 stage per rank",
    ),
    "pp microbatches do not divide the batch": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_microbatch_size", "3"], 2, "--training.local_batch_size=4 is not divisible",
    ),
    "pp schedule that does not exist": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_schedule", "2F2B"], 2, "--parallelism.pipeline_parallel_schedule='2F2B'",
    ),
    "pp dualpipev with fewer microbatches than stages": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--training.local_batch_size", "2",
         "--parallelism.no-pipeline_parallel_expert_parallel_overlap"], 2, "needs a microbatch per stage",
    ),
    "pp dualpipev overlap without an accelerator": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_schedule", "DualPipeV"], 2, "needs an accelerator's streams",
    ),
    "pp stage names that are not the model's": (
        ["--job.config_file", "{tmp}/pp_names.toml", *PP2], 2, "names 'tok_embeddings', which is not a part of this model",
    ),
    "ddp with pp": ([*GLA, *PP2, "--parallelism.data_parallel_replicate_degree", "2"], 4,
                    "DDP (--parallelism.data_parallel_replicate_degree=2) cannot combine with --parallelism.pipeline_parallel_degree=2"),
    "validation batch other than training's under pp": (
        [*GLA, *PP2, "--validation.enable", "--validation.dataset", "titan_ext_tiny", "--validation.local_batch_size", "3"],
        2, "--validation.local_batch_size=3 and --validation.seq_len=2048 must equal training's",
    ),
    "validation with a v-shaped pp schedule": (
        [*GLA, *PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--validation.enable",
         "--validation.dataset", "titan_ext_tiny", "--validation.local_batch_size", "4", "--validation.seq_len", "128"],
        2, "--validation.enable with --parallelism.pipeline_parallel_schedule='ZBVZeroBubble'",
    ),
    "validation windows that cp cannot split": (
        [*GLA, *CP2, "--validation.enable", "--validation.dataset", "titan_ext_tiny", "--validation.seq_len", "90"], 2,
        "--validation.seq_len=90 does not split into 4 equal pieces",
    ),
    "validation without document boundaries under document masking": (
        [*GLA, "--titan_ext.document_mask", "--validation.enable"], 1,
        "which --validation.dataset='c4_validation' does not emit",
    ),
    "validation stream without a path": (
        [*GLA, "--validation.enable", "--validation.dataset", "titan_ext_stream"], 1, "--validation.dataset_path is empty",
    ),
    "context parallel pieces shorter than a convolution's halo": (
        [*GLA, *CP2, "--titan_ext.hf_config", "{tmp}/short_conv.json", "--training.seq_len", "8"], 2,
        "pieces of 2 tokens, shorter than the 3 earlier inputs",
    ),
    "context parallel with a token-reordering balancer": (
        [*GLA, *CP2, "--parallelism.context_parallel_load_balancer", "ptrr"], 2, "context_parallel_load_balancer='ptrr'"
    ),
    "context parallel pieces do not split seq_len": ([*GLA, *CP2, "--training.seq_len", "126"], 2, "4 equal pieces"),
    "ddp with tp": (
        [*GLA, *TP2, "--parallelism.data_parallel_replicate_degree", "2"], 4, "DDP (--parallelism.data_parallel_replicate_degree)"
    ),
    "async tp without compiling the model": (
        [*GLA, *TP2, "--parallelism.enable_async_tensor_parallel", "--compile.enable", "--compile.components", "loss"],
        2, "--parallelism.enable_async_tensor_parallel needs the model compiled",
    ),
    "tp does not divide heads": ([*GLA, *TP2, "--titan_ext.hf_config", "{tmp}/heads3.json"], 2, "num_heads=3 is not divisible"),
    "tp does not divide mlp width": (
        [*GLA, *TP2, "--titan_ext.hf_config", "{tmp}/mlp101.json"], 2, "mlp.gate_proj.out_features=101 is not divisible"
    ),
    "config the library cannot build": (
        [*GLA, "--titan_ext.hf_config", "{tmp}/unbuildable.json"], 1, "GLAForCausalLM cannot be built from this config"
    ),
    "seq_len not divisible under sp": ([*GLA, *TP2, "--training.seq_len", "127"], 2, "--training.seq_len=127 is not divisible"),
    # the generic specs: any fla model (--model.name fla), any transformers causal LM (hf)
    "generic spec without a config": ([*GLA, "--model.name", "fla"], 1, "takes the architecture from a config.json"),
    "config without model_type": (generic("fla", "no_model_type.json"), 1, "has no model_type"),
    "unknown model_type": (
        generic("fla", "unknown_type.json"), 1, "model_type 'gla_typo' is not a model type fla registers"
    ),
    "fla model under the hf spec": (generic("hf", "hf_mismatch"), 1, "is a fla model; train it with --model.name='fla'"),
    "fla model without a portable kernel on cpu": (
        generic("fla", "hgrn.json"), 1, "fla's Triton kernel fla.ops.hgrn"
    ),
    "fla model its library cannot build": (
        generic("fla", "mamba2_unbuildable.json"), 1, "Mamba2ForCausalLM cannot be built from this config"
    ),
    # mixture of experts: what titan_ext cannot split is refused, never ignored
    "ep on a dense model": ([*GLA, "--parallelism.expert_parallel_degree", "2"], 2, "this model has no experts"),
    "ep that does not divide the experts": (
        [*generic("hf", "qwen3_moe.json"), "--parallelism.expert_parallel_degree", "3",
         "--parallelism.data_parallel_shard_degree", "3"], 3, "--parallelism.expert_parallel_degree=3 does not divide the model's 8 experts",
    ),
    "etp without ep": (
        [*GLA, *TP2, "--parallelism.expert_tensor_parallel_degree", "2"], 2,
        "--parallelism.expert_tensor_parallel_degree=2 needs --parallelism.expert_parallel_degree > 1",
    ),
    # [titan_ext] hf_config
    "hf_config path missing": ([*GLA, "--titan_ext.hf_config", "{tmp}/nowhere.json"], 1, "no such file"),
    "hf_config not json": ([*GLA, "--titan_ext.hf_config", "{tmp}/bad.json"], 1, "is not valid JSON"),
    "hf_config wrong type": ([*GLA, "--titan_ext.hf_config", "{tmp}/wrong_type.json"], 1, "hidden_size"),
    "hf_config impossible value": ([*GLA, "--titan_ext.hf_config", "{tmp}/impossible.json"], 1, "num_hidden_layers"),
    # data files
    "dataset path missing": ([*GLA, "--training.dataset_path", "{tmp}/missing.jsonl"], 1, "missing.jsonl"),
    "dataset path empty": ([*GLA, "--training.dataset_path", "{tmp}/empty.jsonl"], 1, "empty.jsonl"),
    "dataset not json lines": ([*GLA, "--training.dataset_path", "{tmp}/not_json.jsonl"], 1, "line 2"),
    "dataset without text field": ([*GLA, "--training.dataset_path", "{tmp}/no_text.jsonl"], 1, "'text'"),
    "dataset path is a directory": (
        [*GLA, "--training.dataset_path", "{tmp}/a_directory.jsonl"], 1, "is a directory; a folder of shards is read by "
        "--training.dataset titan_ext_stream"),
    # document masking where the boundaries cannot reach the model, or the model cannot honour them
    "document mask on a dataset without boundaries": (
        [*GLA, "--titan_ext.document_mask", "--training.dataset", "c4_test"], 1, "--titan_ext.document_mask needs"
    ),
    "document mask for torchtitan's own model": (
        [*GLA, "--titan_ext.document_mask", "--model.name", "llama3", "--model.flavor", "debugmodel"], 1,
        "--titan_ext.document_mask applies to titan_ext's models, not --model.name='llama3'",
    ),
    "document mask with a gla mode that ignores it": (
        [*GLA, "--titan_ext.document_mask", "--titan_ext.hf_config", "{tmp}/fused_chunk.json"], 1,
        "GLA's attn_mode 'fused_chunk' takes no cu_seqlens",
    ),
    # checkpoints
    "hf checkpoint config mismatch": (
        [*GLA, *HF_LOAD, "{tmp}/hf_mismatch"], 1, "config.json does not match --model.flavor: hidden_size=64 (flavor) vs 128"
    ),
    "hf checkpoint of another model": ([*GLA, *HF_LOAD, "{tmp}/hf_other_model"], 1, "hf_other_model"),
    "resume on another number of data-parallel ranks": (
        [*GLA, "--checkpoint.enable", "--job.dump_folder", "{tmp}/dp2_run"], 1,
        "was saved by 2 data-parallel ranks, this job has 1: --training.dataset='titan_ext_tiny' cannot re-split",
    ),
    "hf checkpoint shapes not its config's": (
        [*GLA, *HF_LOAD, "{tmp}/hf_wrong_shape"], 1,
        "holds 'model.embeddings.weight' of shape [1000, 64], this model needs [2048, 64]",
    ),
    "vocabulary smaller than the tokenizer's": (
        [*GLA, "--titan_ext.hf_config", "{tmp}/vocab100.json"], 1, "vocab100.json') is smaller than the tokenizer's 621 ids",
    ),
    "hf safetensors corrupt": ([*GLA, *HF_LOAD, "{tmp}/hf_corrupt"], 1, "model.safetensors"),
    "hf safetensors truncated": ([*GLA, *HF_LOAD, "{tmp}/hf_truncated"], 1, "model.safetensors"),
    "dcp checkpoint of another model": ([*GLA, *DCP_LOAD, "{tmp}/dcp_other_model"], 1, "another model or flavor"),
    "dcp metadata corrupt": ([*GLA, *DCP_LOAD, "{tmp}/dcp_corrupt"], 1, "dcp_corrupt"),
    "folder with no readable step": ([*GLA, *DCP_LOAD, "{tmp}/no_step"], 1, "no_step"),
    # Float8
    "float8 without a float8 gpu or emulation": (
        [*GLA, "--model.converters", "quantize.linear.float8"], 1, "needs a CUDA GPU with compute capability >= 8.9"
    ),
}



@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_configs")
    write_inputs(folder)
    return folder


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_naming_it(tmp, name, monkeypatch):
    argv, world, expected = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    message = first_error([arg.replace("{tmp}", str(tmp)) for arg in argv], world)
    assert expected in message, f"{name}: got {message!r}"
    assert "\n" not in message and ";" in message, f"{name}: not one line with a fix: {message!r}"


def test_a_good_config_passes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert first_error(GLA, 1) == ""


@pytest.mark.parametrize("config, world", [("debug_qwen3_moe.toml", 2), ("qwen3_moe_30B_A3B.toml", 16),
                                           ("debug_kimi_linear.toml", 2), ("kimi_linear.toml", 8)])
def test_shipped_moe_configs_pass(monkeypatch, config, world):
    """The MoE TOMLs (the GPU one at its 16 ranks, with EP8): every check a job runs, the model on the meta device."""
    monkeypatch.chdir(REPO)  # their hf_config paths are the repository's
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert first_error(["--job.config_file", str(CONFIGS / config)], world) == ""


# ---- what the user sees: two real launches -------------------------------------------------------

LAUNCHES = {
    # found when the Trainer imports titan_ext, before any process group exists
    "at import": (
        ["--parallelism.data_parallel_shard_degree", "4"],
        "titan_ext: --parallelism.data_parallel_shard_degree=4",
    ),
    # a damaged step to resume from, found at import too
    "damaged step": (
        ["--checkpoint.enable"],
        "titan_ext: --checkpoint.folder='{tmp}/damaged_step/checkpoint': step-4 is damaged: __0_0.distcp is "
        "truncated (",
    ),
    # found once the model args see the config, after the process group exists
    "at model args": ([*TP2, "--titan_ext.hf_config", "{tmp}/heads3.json"], "titan_ext: num_heads=3 is not divisible"),
    # met during training: a broken JSON line past the preflight's first look (rank 1's last shard)
    "at a step": (["--training.dataset", "titan_ext_stream", "--training.dataset_path", "{tmp}/late_bad",
                   "--titan_ext.shuffle_buffer", "0"],
                  "titan_ext: --training.dataset_path: {tmp}/late_bad/part-9.jsonl line 3 is not JSON"),
}


@pytest.fixture(scope="module")
def launches(tmp):
    procs = {}
    for name, (flags, _) in LAUNCHES.items():
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "torchtitan.train", *GLA, "--job.dump_folder", str(tmp / name.replace(" ", "_")),
            *(flag.replace("{tmp}", str(tmp)) for flag in flags),
        ]
        procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return {"tmp": tmp, **{name: (proc.communicate(timeout=600)[0], proc.returncode) for name, proc in procs.items()}}


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_the_user_sees_one_line_and_no_traceback(launches, name):
    output, code = launches[name]
    expected = LAUNCHES[name][1].replace("{tmp}", str(launches["tmp"]))
    lines = output.splitlines()
    hits = [i for i, line in enumerate(lines) if expected in line]
    hits = [i for i in hits if " - ERROR - " in lines[i]]  # the log's line (torchrun's summary repeats it)
    assert code != 0 and len(hits) == 1, f"{name}: exit {code}, line found {len(hits)}x\n{output[-4000:]}"
    assert "exitcode  : 2" in output, output[-3000:]
    # Nothing after it but the other rank's earlier progress (ranks are not in step before the
    # check: "Starting job" may come late) and torchrun's summary: no second error, no warning.
    after = lines[hits[0] + 1:]
    assert not any(" - ERROR - " in line or " - WARNING - " in line or line.startswith("[rank") for line in after), (
        "\n".join(after[:20]))
    # The only traceback is torchrun's own (its ChildFailedError summary), not a rank's.
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    assert all("torch/distributed/run.py" in "\n".join(lines[i:i + 12]) for i in tracebacks), output[-4000:]
    # ... whose root cause, the last thing printed, is the line (the worker's error file), not a link.
    root = lines[lines.index("Root Cause (first observed failure):"):]
    assert root[-2].startswith(f"  traceback : {expected}") and set(root[-1]) == {"="}, "\n".join(root)


@pytest.mark.parametrize("rank,prefix", [("0", "titan_ext: "), ("1", "titan_ext (rank 1 only): ")])
def test_exit_with_logs_once_on_rank_0_and_other_ranks_wait_for_it(monkeypatch, caplog, rank, prefix):
    """Other ranks sleep first (torchrun stops them once rank 0 has printed and left); only a rank
    that rank 0 never outlives, e.g. one whose own file is bad, prints its own line."""
    from titan_ext import errors

    slept = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    with pytest.raises(SystemExit) as exit_info:
        errors.exit_with(ConfigError("--x=1 is bad; use 2"))
    assert exit_info.value.code == errors.EXIT_CODE
    assert [r.getMessage() for r in caplog.records] == [f"{prefix}--x=1 is bad; use 2"]
    assert slept == ([] if rank == "0" else [errors.OTHER_RANKS_WAIT_S])


def test_exit_with_hands_torchrun_the_line_as_the_root_cause(monkeypatch, tmp_path):
    """torchrun's failure summary shows what the worker's error file holds, read by torch's own code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_ext import errors

    path = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(SystemExit):
        errors.exit_with(ConfigError("--x=1 is bad; use 2"))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=errors.EXIT_CODE, error_file=str(path))
    summary = ChildFailedError("torchtitan.train", {0: failure}).format_msg().splitlines()
    assert summary[-2] == "  traceback : titan_ext: --x=1 is bad; use 2", "\n".join(summary)


def test_the_way_out_of_a_changed_data_parallel_degree_passes(tmp, monkeypatch):
    """What the message offers: resume without the dataloader's positions."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [*GLA, "--checkpoint.enable", "--job.dump_folder", f"{tmp}/dp2_run", "--checkpoint.exclude_from_loading", "dataloader"]
    assert first_error(argv, 1) == ""
