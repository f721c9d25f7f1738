"""Stop (or skip) a training step whose loss is NaN or Inf, before the update is applied.

torchtitan 0.2.2 applies whatever gradients a step produced, and a NaN loss
then poisons the weights and every checkpoint written after it. Here the
loss function records whether any loss of the step was non-finite (no host
sync); right before the optimizer step all ranks agree on the flag (one
small all-reduce) and then, per ``[titan_ext] nonfinite_loss``:

- ``"stop"`` (default): raise with the step number; the job ends before the
  update and before that step's checkpoint, so the last checkpoint is clean;
- ``"skip"``: drop the step's update (the LR schedule still advances), log it;
- ``"off"``: no check, no sync (for the last bit of speed).

Validation reuses the training loss function; it runs without gradients,
and only losses computed with gradients are watched, so a non-finite
validation loss is reported by the validator and never stops training.

torchtitan builds the loss and the optimizers in separate calls, so a
module-level guard links them for the job being built; building the loss
starts it afresh.
"""

from __future__ import annotations

import functools

import logging

import torch
import torch.distributed as dist

from titan_ext.errors import ConfigError, exit_with, take_deferred
from titan_ext.host import job_patches
from titan_ext.job_plan import job_plan_of
from titan_ext.models.moe.balance_loss import with_balance_loss

logger = logging.getLogger()

POLICIES = ("stop", "skip", "off")


def policy(section) -> str:
    """``[titan_ext] nonfinite_loss`` (``section`` may be None without ``custom_config_module``)."""
    value = getattr(section, "nonfinite_loss", "stop")
    if value not in POLICIES:
        raise ConfigError(f"--titan_ext.nonfinite_loss={value!r} is not one of {list(POLICIES)}; pick one of them")
    return value


class NonFiniteLossGuard:
    def __init__(self) -> None:
        self.policy = "stop"
        self.flag: torch.Tensor | None = None

    def start_job(self) -> None:
        """Forget the last job's flag and any deferred error (a process may run several jobs)."""
        self.policy = "stop"
        self.flag = None
        take_deferred()

    def record(self, loss: torch.Tensor) -> None:
        local = loss.detach()
        if hasattr(local, "full_tensor"):  # a DTensor loss under loss parallel
            local = local.full_tensor()
        bad = ~torch.isfinite(local).all()
        self.flag = bad if self.flag is None else self.flag | bad

    def step_is_nonfinite(self) -> bool:
        """Whether any rank saw a non-finite loss since the last call (collective: every rank calls it).

        The same reduction carries whether any rank met a bad data record this step (``errors.defer``):
        then every rank ends the job here, together, in one line (rank 0 prints the record's)."""
        flag, deferred = self.flag, take_deferred()
        self.flag = None
        if not dist.is_initialized():
            if deferred is not None:
                exit_with(deferred)
            return bool(flag) if flag is not None else False
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        if flag is None:  # a pipeline stage without the loss still joins the reduction
            flag = torch.zeros((), dtype=torch.bool, device=device)
        flags = torch.stack([flag.to(device, torch.int32), torch.tensor(deferred is not None, dtype=torch.int32, device=device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1].item():
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, None if deferred is None else str(deferred))
            exit_with(ConfigError(next(m for m in messages if m is not None)))
        return bool(flags[0].item())


_guard = NonFiniteLossGuard()


def watch_loss(build_loss_fn):
    """Wrap a train spec's ``build_loss_fn`` so the built loss reports training losses to the guard.

    torchtitan builds the loss before the optimizers: the guard starts a new job here and learns the
    job's policy when the optimizers are built (``guard_optimizer_step``), before the first step.
    """

    @functools.wraps(build_loss_fn)
    def build(job_config, **kwargs):
        loss_fn = build_loss_fn(job_config, **kwargs)
        _guard.start_job()

        def loss_with_check(pred, labels):
            loss = loss_fn(pred, labels)
            if _guard.policy != "off" and torch.is_grad_enabled():  # training, not validation
                _guard.record(loss)
            return loss

        return loss_with_check

    return build


def _job_loss(job_config, **kwargs):
    from titan_ext.models.loss import build_loss

    return build_loss(job_config, **kwargs)


build_watched_loss = watch_loss(with_balance_loss(_job_loss))  # the job's loss (titan_ext.models.loss) + MoE routers' balancing loss (titan_ext.models.moe)


def guard_optimizer_step(build_lr_schedulers_fn):
    """Wrap ``build_lr_schedulers_fn``: it is the one builder that sees the optimizers and the step count.

    The LR schedulers' ``last_epoch`` is the number of completed steps (and is
    checkpointed), so the current step is ``last_epoch + 1``.
    """

    @functools.wraps(build_lr_schedulers_fn)
    def build(optimizers, lr_scheduler_config, training_steps):
        schedulers = build_lr_schedulers_fn(optimizers, lr_scheduler_config, training_steps)
        policy = _guard.policy = job_plan_of(optimizers.model_parts[0]).nonfinite
        if policy == "off":
            return schedulers

        def guarded(step_optimizers):
            def step(*args, **kwargs):
                if _guard.step_is_nonfinite():
                    step_number = schedulers.schedulers[0].last_epoch + 1
                    if policy == "stop":
                        raise FloatingPointError(
                            f"non-finite loss (NaN or Inf) at step {step_number}: stopped before its update and "
                            "checkpoint; lower the LR or fix the data, or set --titan_ext.nonfinite_loss skip"
                        )
                    logger.warning(f"non-finite loss at step {step_number}: skipped its update (--titan_ext.nonfinite_loss skip)")
                    optimizers.zero_grad()
                    return None
                return step_optimizers(*args, **kwargs)

            return step

        job_patches.OPTIMIZER_STEP.apply(optimizers, guarded)
        return schedulers

    return build
