"""torchtitan's metrics processor, plus an optional full-precision JSON-lines log, a readable step line
(``titan_ext.host.progress``), plus the job's end.

The console log rounds the loss to 5 decimals; comparing runs (parity,
exact resume) needs every bit, so ``--titan_ext.metrics_jsonl PATH`` makes
the rank holding the loss (rank 0; under PP the last stage's) append each
logged step's metrics there as JSON.

The processor is also the one component of a train spec that torchtitan
closes at the end of a job, after the checkpointer: its ``close`` completes
an HF export (``titan_ext.checkpoints.hf.finish_hf_export``) on rank 0.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.components.metrics import build_metrics_processor as titan_build_metrics_processor
from torchtitan.tools.utils import NoColor

from titan_ext import compat
from titan_ext.checkpoints.hf import finish_hf_export
from titan_ext.host import job_patches, progress
from titan_ext.host.moe_metrics import step_metrics
from titan_ext.job_plan import job_plan_of

logger = logging.getLogger()


class JsonlLogger(BaseLogger):
    def __init__(self, inner: BaseLogger, path: str):
        self.inner = inner
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.inner.log(metrics, step)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        self.inner.close()


def build_metrics_processor(job_config, parallel_dims, model_args, tag=None) -> MetricsProcessor:
    processor = titan_build_metrics_processor(job_config, parallel_dims, model_args, tag)
    plan = job_plan_of(model_args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rank0 = rank == 0
    # torchtitan logs from rank 0 for ZBVZeroBubble only; DualPipeV's last stage is on rank 0 too
    logs_loss = 0 if plan.pp is not None and plan.pp.v_shape else compat.metrics_rank(parallel_dims, job_config)
    if plan.metrics_jsonl and rank == logs_loss:
        job_patches.METRICS_LOGGER.apply(processor, lambda logger: JsonlLogger(logger, plan.metrics_jsonl))
    if plan.moe is not None:
        job_patches.METRICS_LOG.apply(processor, lambda log: _with_moe_metrics(log, parallel_dims, rank0))
    shown = progress.every_rank(job_config) or rank == logs_loss
    job_patches.METRICS_STEP_LINE.apply(
        processor, lambda log: progress.with_progress(log, job_config.training.steps, shown, progress.has_peak(processor))
    )
    if not progress.colours_wanted():
        job_patches.METRICS_COLOR.apply(processor, lambda _: NoColor())
    if plan.hf_export and rank0:
        checkpoint_dir = os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)
        job_patches.METRICS_CLOSE.apply(
            processor, lambda close: _then(close, lambda: finish_hf_export(model_args, checkpoint_dir, plan.hf_assets_path))
        )
    return processor


def _with_moe_metrics(log, parallel_dims, rank0: bool):
    """Every rank logs (rank 0 prints): the routers' statistics are summed over the batch's ranks first."""

    def log_step(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        batch_mesh = parallel_dims.get_optional_mesh("loss")
        pp_group = parallel_dims.get_mesh("pp").get_group() if parallel_dims.pp_enabled else None
        routing = step_metrics(batch_mesh.get_group() if batch_mesh is not None else None, pp_group)
        log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics={**(extra_metrics or {}), **routing})
        if routing and rank0:
            logger.info("  ".join(f"{name}: {value:.6g}" for name, value in routing.items()))

    return log_step


def _then(first, second):
    def both():
        first()
        second()

    return both
