"""``--experimental.custom_import nan_injection``: the GLA spec, with a NaN loss on rank 0 at one step.

``fla_gla_nan`` is ``fla_gla`` whose loss turns NaN on rank 0 at step
``$NAN_AT_STEP`` (one microbatch per step), so tests can watch
titan_ext's non-finite-loss guard act on a real job.
"""

import dataclasses
import os

import torch.distributed as dist
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.protocols import train_spec

import titan_ext  # noqa: F401  (the fla_gla spec)
from titan_ext.host.nonfinite import watch_loss


def build_nan_loss(job_config, **kwargs):
    loss_fn = build_cross_entropy_loss(job_config, **kwargs)
    nan_at = int(os.environ["NAN_AT_STEP"])
    calls = 0

    def loss(pred, labels):
        nonlocal calls
        calls += 1
        value = loss_fn(pred, labels)
        if calls == nan_at and dist.get_rank() == 0:
            value = value * float("nan")
        return value

    return loss


if "fla_gla_nan" not in train_spec._extra_train_specs:
    spec = dataclasses.replace(train_spec.get_train_spec("fla_gla"), build_loss_fn=watch_loss(build_nan_loss))
    train_spec.register_train_spec("fla_gla_nan", spec)
