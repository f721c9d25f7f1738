"""Bad configs stop the job before any model is built, exit non-zero, and say what to change.

Every case is a real ``torchrun -m torchtitan.train`` launch. They are
started together (each spends its time importing) and checked one test
per case.
"""

import json
import subprocess
import sys

import pytest
from launch import CONFIGS, REPO

# Printed by the trainer once the model is built on the meta device; a fast failure never gets there.
MODEL_BUILT = "Model fla_gla debugmodel size"


GLA = ["--job.config_file", str(CONFIGS / "debug_gla.toml")]
TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]

# Files each case may point at, written into the test's folder ({tmp}).
FILES = {
    "heads3.json": json.dumps({"num_heads": 3}),
    "mlp101.json": json.dumps({"intermediate_size": 101}),
    "bad.json": "{oops",
    "hf_mismatch/config.json": json.dumps(
        {"model_type": "gla", "hidden_size": 128, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 2048}
    ),
    "no_config_module.toml": (CONFIGS / "debug_gla.toml").read_text().replace(
        'custom_config_module = "titan_ext.config"', ""
    ) + '\n[titan_ext]\nnonfinite_loss = "skip"\n',
}

# name -> (processes, CLI arguments, expected message)
CASES = {
    "unknown model name": (
        1, [*GLA, "--model.name", "fla_glx"], "--model.name='fla_glx' is not a registered train spec; choose one of ["
    ),
    "unknown flavor": (
        1, [*GLA, "--model.flavor", "huge"],
        "--model.flavor='huge' is not a flavor of fla_gla; choose one of ['1.3B', '340M', '7B', 'debugmodel']",
    ),
    "tp does not divide heads": (
        2, [*GLA, *TP2, "--titan_ext.hf_config", "{tmp}/heads3.json"],
        "num_heads=3 is not divisible by --parallelism.tensor_parallel_degree=2",
    ),
    "tp does not divide mlp width": (
        2, [*GLA, *TP2, "--titan_ext.hf_config", "{tmp}/mlp101.json"],
        "intermediate_size=101 is not divisible by --parallelism.tensor_parallel_degree=2",
    ),
    "seq_len not divisible under sp": (
        2, [*GLA, *TP2, "--training.seq_len", "127"],
        "--training.seq_len=127 is not divisible by --parallelism.tensor_parallel_degree=2",
    ),
    "async tp without compile": (
        2, [*GLA, *TP2, "--parallelism.enable_async_tensor_parallel"],
        "--parallelism.enable_async_tensor_parallel needs torch.compile",
    ),
    # torchtitan parses the TOML before titan_ext is imported; its own message names the section.
    "titan_ext section without custom_config_module": (
        1, ["--job.config_file", "{tmp}/no_config_module.toml"],
        "Invalid field names in <class 'torchtitan.config.job_config.JobConfig'> data: {'titan_ext'}",
    ),
    "hf_config path missing": (
        1, [*GLA, "--titan_ext.hf_config", "{tmp}/nowhere.json"], "nowhere.json': no such file; point it at an HF config.json"
    ),
    "hf_config not json": (1, [*GLA, "--titan_ext.hf_config", "{tmp}/bad.json"], "bad.json' is not valid JSON"),
    "hf checkpoint config mismatch": (
        1,
        [*GLA, "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", "{tmp}/hf_mismatch"],
        "config.json does not match --model.flavor: hidden_size=64 (flavor) vs 128 (checkpoint)",
    ),
    "float8 without a float8 gpu or emulation": (
        1, [*GLA, "--model.converters", "quantize.linear.float8"],
        "--model.converters quantize.linear.float8 needs a CUDA GPU with compute capability >= 8.9",
    ),
    "float8 under torchtitan's unregistered name": (
        1, [*GLA, "--model.converters", "float8"], "--model.converters: 'float8' is not a converter name; use 'quantize.linear.float8'"
    ),
    "dataset path missing": (
        1, [*GLA, "--training.dataset_path", "{tmp}/missing.jsonl"], "missing.jsonl': no such file; give a JSON-lines file"
    ),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_configs")
    for name, content in FILES.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(content)
    procs = {}
    for name, (nproc, args, expected) in CASES.items():
        args = [arg.replace("{tmp}", str(tmp)) for arg in args]
        dump = tmp / name.replace(" ", "_")
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "torchtitan.train", *args, "--job.dump_folder", str(dump),
        ]
        procs[name] = (subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), expected)
    results = {}
    for name, (proc, expected) in procs.items():
        output, _ = proc.communicate(timeout=900)
        results[name] = (proc.returncode, output, expected)
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_bad_config_fails_fast_with_one_clear_line(outcomes, name):
    returncode, output, expected = outcomes[name]
    assert returncode != 0, f"{name}: the job did not fail\n{output[-3000:]}"
    lines = [line for line in output.splitlines() if expected in line]
    assert lines, f"{name}: expected message not found: {expected!r}\n{output[-4000:]}"
    assert MODEL_BUILT not in output, f"{name}: failed only after building the model"
