"""One titan_ext job: the config checked once, every decision made once, in a frozen ``JobPlan``.

Two moments of torchtitan's ``Trainer.__init__`` belong to titan_ext:

1. ``on_trainer_import``: torchtitan imports titan_ext (``custom_import``)
   before it picks a device. The job-wide checks run here (numbers, degrees
   against the world size, names, data files) and CPU mode is decided, so a
   mistake ends the job before any process group or model exists.
2. ``decide_job_plan``: torchtitan hands titan_ext's model args the job config
   (``update_from_config``). The model-specific checks run and the
   ``JobPlan`` is built: TP, CP, AC, compile, Float8, FSDP/DDP, kernels, the
   non-finite policy, HF export. Every ``apply_*`` reads the plan; nothing is
   written back into the job config.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from titan_ext import compat, cpu_mode, data, patching
from titan_ext.checkpoints import dcp_steps, host_patches as checkpoint_patches
from titan_ext.data import documents
from titan_ext.errors import ConfigError, config_boundary, exit_with, rank
from titan_ext.host import cpu_patches, interrupt, job_patches, nonfinite, preflight, progress
from titan_ext.inputs import assets, degrees
from titan_ext.job_plan import CompileChoice, DataParallelChoice, JobPlan
from titan_ext.kernels import host_patches as kernel_patches
from titan_ext.models import loss
from titan_ext.models.args import HFModelArgs
from titan_ext.parallel import activation_checkpoint, context_parallel, float8, moe_plan, pipeline_plan, tensor_parallel
from titan_ext.parallel.compile import model_compile_enabled

logger = logging.getLogger()

_cpu_mode = False
_checked_job = None
"""The config ``on_trainer_import`` checked, held (not its id, which a later object may reuse) until the
job is planned."""


def _world_size() -> int:
    """torchrun's world size: the one place titan_ext reads it (the plan carries it on)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def on_trainer_import() -> None:
    """Set up the job of the torchtitan Trainer importing titan_ext; outside a Trainer, do nothing."""
    global _cpu_mode, _checked_job
    job_config = compat.importing_trainer_job_config()
    if job_config is None:
        return
    try:
        preflight.check_job_config(job_config, _world_size())
        _checked_job = job_config
        _cpu_mode = cpu_mode.wanted()
        path = kernel_path(job_config)
    except ConfigError as error:
        exit_with(error)
    job_patches.apply_job()
    job_patches.TRAINER_CLOSE.apply(compat.importing_trainer(), data.ending_dataloader_workers)
    interrupt.install(compat.importing_trainer(), job_config)
    if job_config.checkpoint.enable:
        patching.apply_once(checkpoint_patches.CHECKPOINT_MANIFEST)
    if dcp_steps.damaged_checkpoint_policy(job_config) == "skip":
        patching.apply_once(checkpoint_patches.SKIP_DAMAGED_STEPS)
    if progress.quiets_this_rank(job_config):
        job_patches.quiet_other_rank(progress.OtherRankQuiet())
    if documents.enabled(job_config):  # every pipeline stage reads the boundaries
        job_patches.TRAINER_BATCH.apply(compat.importing_trainer(), documents.to_every_stage)
    if path == "fla" and interpreting():
        patching.apply_once(kernel_patches.INTERPRETER)
    elif path == "fla":
        patching.apply_once(kernel_patches.CUDA)
    if _cpu_mode:
        cpu_patches.apply_cpu_mode()
        if rank() == 0:
            logger.warning(
                "titan_ext: CPU mode: no accelerator in use, torchtitan runs on the CPU with gloo "
                f"(fla models on titan_ext's portable kernels; {cpu_mode.FORCE_ENV}=1 forces this on a GPU machine)"
            )


KERNELS_OPTION = "--titan_ext.kernels"
KERNEL_CHOICES = ("auto", "fla", "portable")
INTERPRETER_TRITON = (3, 9)
"""The first Triton whose interpreter runs fla's kernels on the CPU (with ``kernels.host_patches.INTERPRETER``)."""


def kernel_path(job_config=None) -> str:
    """The kernels titan_ext's fla models run (``titan_ext.kernels``), from ``[titan_ext] kernels``:
    ``auto`` is fla's on CUDA and torch code anywhere else or in CPU mode."""
    choice = getattr(getattr(job_config, "titan_ext", None), "kernels", "auto")
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"{KERNELS_OPTION}={choice!r} is not one of {KERNEL_CHOICES}; use one of them")
    from titan_ext import kernels

    on_cuda = kernels.default_path() == "fla"  # the one rule: fla's kernels on CUDA unless CPU mode is forced
    if choice == "fla" and not on_cuda and not interpreting():
        raise ConfigError(
            f"{KERNELS_OPTION}='fla' runs fla's Triton kernels, which need a CUDA GPU or, on the CPU, Triton's "
            f"interpreter: set TRITON_INTERPRET=1 in the environment (slow: tiny models only), or use 'auto'"
        )
    if choice == "fla" and not on_cuda and compat.triton_version() < INTERPRETER_TRITON:
        raise ConfigError(
            f"{KERNELS_OPTION}='fla' on the CPU: Triton {compat.triton_version_string()}'s interpreter cannot run fla's "
            f"kernels (its range() of a program id fails under NumPy 2); install triton>="
            f"{'.'.join(map(str, INTERPRETER_TRITON))}, or use 'auto'"
        )
    if choice == "auto":
        return "fla" if on_cuda else "portable"
    return choice


def interpreting() -> bool:
    """Whether Triton's interpreter runs Triton kernels in this process (``TRITON_INTERPRET=1``, read by
    Triton when a kernel is defined: it must be set before fla is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


class JobModelArgs(HFModelArgs):
    """The model args titan_ext's train specs hand torchtitan: reading the job config plans the job.

    The plan is an attribute, not a dataclass field: torchtitan logs ``asdict(model_args)`` as JSON.
    Every builder torchtitan calls afterwards is handed these args or the model built from them, and
    reads the plan there (``job_plan.job_plan_of``).
    """

    plan: JobPlan | None = None

    def __setattr__(self, name: str, value) -> None:
        if name == "plan":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    @classmethod
    def of(cls, args: HFModelArgs) -> JobModelArgs:
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(args)})

    @config_boundary
    def update_from_config(self, job_config, **kwargs) -> None:
        """torchtitan calls this right before building the model: the last moment a bad config can fail
        cheaply."""
        self.read_job_config(job_config)
        self.plan = decide_job_plan(self, job_config)


def decide_job_plan(model_args: HFModelArgs, job_config) -> JobPlan:
    """Check the job against the model, then decide everything, once."""
    global _checked_job
    world_size = _world_size()
    if job_config is not _checked_job:  # built without the import hook (titan_ext was imported earlier)
        preflight.check_job_config(job_config, world_size)
    _checked_job = None
    model_args.kernel_path = kernel_path(job_config)  # the model built from these args binds these kernels
    meta = preflight.check_model_job(model_args, job_config, model_args.kernel_path, world_size)
    return _build(model_args, job_config, meta, world_size)


def _build(model_args, job_config, meta, world_size: int) -> JobPlan:
    """``meta``: the model on the meta device (the TP plan is chosen from its modules)."""
    section = getattr(job_config, "titan_ext", None)
    float8_choice = float8.float8_choice(job_config, model_args.arch.float8_high_precision)
    return JobPlan(
        world_size=world_size,
        kernel_path=model_args.kernel_path,
        tp=tensor_parallel.tp_choice(meta, job_config),
        cp=context_parallel.cp_choice(model_args, job_config),
        pp=pipeline_plan.pp_choice(meta, job_config, world_size),
        ac=activation_checkpoint.ac_choice(job_config),
        compile=CompileChoice(model=model_compile_enabled(job_config), backend=job_config.compile.backend),
        float8=float8_choice,
        data_parallel=_data_parallel(job_config, world_size),
        moe=moe_plan.moe_choice(meta, job_config),
        loss=loss.loss_choice(meta, job_config, float8_choice and float8_choice.filter_fqns),
        document_mask=documents.enabled(job_config),
        nonfinite=nonfinite.policy(section),
        metrics_jsonl=getattr(section, "metrics_jsonl", ""),
        hf_export=job_config.checkpoint.enable and job_config.checkpoint.last_save_in_hf,
        hf_assets_path=assets.resolve_asset_path(job_config.model.hf_assets_path),
    )


def _data_parallel(job_config, world_size: int) -> DataParallelChoice:
    from torchtitan.config import TORCH_DTYPE_MAP

    p = job_config.parallelism
    # context-parallel ranks hold pieces of one batch: FSDP spans them too, summing their gradients
    shard = degrees.shard_degree(p, world_size) * p.context_parallel_degree
    replicate = p.data_parallel_replicate_degree
    kind = "hsdp" if shard > 1 and replicate > 1 else "fsdp" if shard > 1 else "ddp" if replicate > 1 else "none"
    policy = p.fsdp_reshard_after_forward
    return DataParallelChoice(
        kind=kind,
        param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
        # "default": reshard blocks (without PP), keep the final norm and head gathered from forward into backward.
        reshard_blocks=policy == "always" or (policy == "default" and p.pipeline_parallel_degree == 1),
        reshard_head=policy == "always",
        cpu_offload=job_config.training.enable_cpu_offload,
    )
