"""Tensor parallel training through stock ``torchrun -m torchtitan.train`` (CPU, gloo).

Every comparison starts from one seed checkpoint in fp32 and holds losses and
gradient norms to a relative 1e-5 of the single-process run.
"""

import json

import pytest
import torch
from launch import assert_close, from_seed, seed_checkpoint, torchrun

from titan_ext.config import TitanExt
from titan_ext.train_specs import TRAIN_SPECS

STEPS = ("--training.steps", "5")
TP2 = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
RTOL = 1e-5

# train spec -> its debug TOML
SPECS = {"fla_gla": "debug_gla.toml", "hf_llama": "debug_llama.toml", "fla_transformer": "debug_transformer.toml"}
SP_FLAG = hasattr(TitanExt(), "disable_sequence_parallel")


def spec_param(name):
    missing = name not in TRAIN_SPECS
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"train spec {name!r} is not registered"))


# The Llama debug flavor ties its head to the embedding, which TP cannot shard both ways.
UNTIED = {"hf_llama": {"model_type": "llama", "tie_word_embeddings": False}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per spec: (flags every run of it takes, single-process run from one seed), built once."""
    cache = {}

    def get(spec):
        if spec not in cache:
            root = tmp_path_factory.mktemp(spec)
            flags = ()
            if spec in UNTIED:
                (root / "config.json").write_text(json.dumps(UNTIED[spec]))
                flags = ("--titan_ext.hf_config", str(root / "config.json"))
            seed = seed_checkpoint(SPECS[spec], root / "seed", *flags)
            flags = (*flags, *from_seed(seed))
            single = torchrun(SPECS[spec], root / "single", *flags, *STEPS,
                              "--parallelism.data_parallel_shard_degree", "1").check()
            cache[spec] = flags, single
        return cache[spec]

    return get


def assert_matches(run, single, what):
    assert_close(run.losses, single.losses, RTOL, f"{what} loss")
    assert_close(run.grad_norms, single.grad_norms, RTOL, f"{what} grad norm")
    print(f"\n{what}: losses {run.losses}\n  single-process {single.losses}")


@pytest.mark.parametrize("spec", [spec_param(s) for s in SPECS])
def test_tp2_matches_single_process(tmp_path, reference, spec):
    """Sequence parallel and loss parallel (both on by default)."""
    flags, single = reference(spec)
    run = torchrun(SPECS[spec], tmp_path, *flags, *STEPS, *TP2, nproc=2).check()
    assert "sequence_parallel=True, loss_parallel=True" in run.output
    assert_matches(run, single, f"{spec} TP2 (SP, loss parallel)")


@pytest.mark.skipif(not SP_FLAG, reason="[titan_ext] disable_sequence_parallel is not in titan_ext/config.py yet")
def test_fsdp2_x_tp2_without_sp_or_loss_parallel(tmp_path, reference):
    """2D: FSDP over TP's DTensor parameters. The reference is FSDP2 alone: data parallel 2 reads the same data."""
    flags, _ = reference("fla_gla")
    fsdp = ("--parallelism.data_parallel_shard_degree", "2")
    fsdp2 = torchrun(SPECS["fla_gla"], tmp_path / "fsdp2", *flags, *STEPS, *fsdp, nproc=2).check()
    run = torchrun(
        SPECS["fla_gla"], tmp_path / "fsdp2xtp2", *flags, *STEPS, *fsdp,
        "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.disable_loss_parallel", "--titan_ext.disable_sequence_parallel", nproc=4,
    ).check()
    assert "sequence_parallel=False, loss_parallel=False" in run.output and "Applied FSDP" in run.output
    assert_matches(run, fsdp2, "fla_gla FSDP2 x TP2 (no SP, no loss parallel) vs FSDP2")


def test_user_plan_from_custom_import_trains(tmp_path):
    """``tests/tp_extension_plan.py`` registers model type ``gla_ext`` and its plan from outside the package."""
    run = torchrun(
        SPECS["fla_gla"], tmp_path, *STEPS, *TP2,
        "--experimental.custom_import", "tp_extension_plan", "--model.name", "tp_ext_gla",
        nproc=2, env={"PYTHONPATH": "tests"},
    ).check()
    assert "Applied ExtGLATPPlan tensor parallelism" in run.output
    assert run.output.count("tp_extension_plan: ExtGLATPPlan block plan") == 2 * 2  # 2 ranks x 2 blocks
    assert len(run.losses) == 5 and run.losses[-1] < run.losses[0]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="Float8 TP all-gathers float8 tensors, which gloo cannot carry (RuntimeError: Invalid scalar type); "
    "needs NCCL",
)
def test_float8_tp_trains(tmp_path):
    run = torchrun(
        SPECS["fla_gla"], tmp_path, *STEPS, *TP2,
        "--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", nproc=2,
    ).check()
    assert "float8=True" in run.output
    assert len(run.losses) == 5 and run.losses[-1] < run.losses[0]
