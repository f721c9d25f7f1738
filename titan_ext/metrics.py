"""torchtitan's metrics processor, plus an optional full-precision JSON-lines log.

The console log rounds the loss to 5 decimals; comparing runs (parity,
exact resume) needs every bit, so ``--titan_ext.metrics_jsonl PATH`` makes
rank 0 append each logged step's metrics there as JSON.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.components.metrics import build_metrics_processor as titan_build_metrics_processor


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


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None) -> MetricsProcessor:
    processor = titan_build_metrics_processor(job_config, parallel_dims, model_args, tag)
    section = getattr(job_config, "titan_ext", None)
    path = section.metrics_jsonl if section is not None else ""
    if path and (not dist.is_initialized() or dist.get_rank() == 0):
        processor.logger = JsonlLogger(processor.logger, path)
    return processor
