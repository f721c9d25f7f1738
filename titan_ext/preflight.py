"""Check a job's config against its model and world size before any model is built.

torchtitan would otherwise report these mistakes late (after meta init,
sharding or a checkpoint read) and deep in a stack trace. ``check_job`` runs
from ``HFModelArgs.update_from_config``, the first hook that sees both the
job config and the model's architecture; each failure is one line naming
the option, its value and the fix.
"""

from __future__ import annotations

from titan_ext.activation_checkpoint import validate_ac_config
from titan_ext.compile import model_compile_enabled, validate_compile_config
from titan_ext.nonfinite import nonfinite_policy
from titan_ext.tensor_parallel import check_async_tp, check_tp


def check_parallelism(model_args, job_config) -> None:
    parallelism = job_config.parallelism
    if parallelism.context_parallel_degree > 1:
        raise ValueError(
            f"--parallelism.context_parallel_degree={parallelism.context_parallel_degree} is not supported "
            "for titan_ext models; set it to 1"
        )
    if parallelism.tensor_parallel_degree > 1:
        check_async_tp(job_config)
        check_tp(model_args.to_hf_config(), parallelism.tensor_parallel_degree, job_config)


def check_initial_hf_checkpoint(model_args, job_config) -> None:
    checkpoint = job_config.checkpoint
    if checkpoint.enable and checkpoint.initial_load_in_hf and checkpoint.initial_load_path:
        from titan_ext.checkpoint import check_hf_config

        check_hf_config(model_args, checkpoint.initial_load_path)


def check_job(model_args, job_config) -> None:
    check_parallelism(model_args, job_config)
    validate_ac_config(job_config.activation_checkpoint, model_compile_enabled(job_config))
    validate_compile_config(job_config.compile)
    nonfinite_policy(job_config)
    check_initial_hf_checkpoint(model_args, job_config)
