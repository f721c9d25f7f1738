"""The job's loss: torchtitan's cross-entropy over the model's logits, or the head and the loss in chunks.

``[titan_ext] loss = "full"`` (the default) is torchtitan's ``cross_entropy_loss``: the model returns
``[B, T, vocab]`` logits. ``"chunked"`` never holds them whole: the model returns its final hidden states and
the loss runs the output head over chunks of tokens (``titan_ext.kernels.linear_cross_entropy``), inside a
call of the head module, so FSDP gathers (and reshards) the head's weight with its own hooks, as for any
forward. Both are a token SUM (torchtitan divides by the global count of valid tokens).

The seam is ``JobLoss``: torchtitan's ``loss_fn(pred, labels)``, handed the model's output (logits, or
hidden states when a head is bound); a further term (e.g. an auxiliary loss) is added there. torchtitan
builds the loss before it parallelizes the model, so the loss being built is where ``apply_chunked_loss``
(run on each model part by the ``parallelize_fn``) binds the head of the part that holds one (the last
pipeline stage's).
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
import torch.nn as nn

from titan_ext.errors import ConfigError
from titan_ext.job_plan import LossChoice

logger = logging.getLogger()

OPTION = "--titan_ext.loss"
CHOICES = ("full", "chunked")
CHUNK_OPTION = "--titan_ext.loss_chunk_tokens"


def loss_choice(model: nn.Module, job_config, float8_filters: tuple[str, ...] | None) -> LossChoice | None:
    """``[titan_ext] loss`` checked against the meta-device model; None: torchtitan's loss over the logits.

    ``float8_filters``: the FQN parts Float8 leaves alone (None: no Float8)."""
    section = getattr(job_config, "titan_ext", None)
    choice, chunk = getattr(section, "loss", "full"), getattr(section, "loss_chunk_tokens", 0)
    if choice not in CHOICES:
        raise ConfigError(f"{OPTION}={choice!r} is not one of {list(CHOICES)}; pick one of them")
    if chunk < 0:
        raise ConfigError(f"{CHUNK_OPTION}={chunk} is negative; give a number of tokens, or 0 for automatic")
    if choice == "full":
        return None
    head = model.get_output_embeddings()
    name = next(name for name, module in model.named_modules() if module is head)
    if type(head) is not nn.Linear or head.bias is not None:
        raise ConfigError(
            f"{OPTION}=chunked computes the head as a bias-free linear, and this model's {name} is "
            f"{type(head).__name__}{' with a bias' if getattr(head, 'bias', None) is not None else ''}; use {OPTION} full"
        )
    if float8_filters is not None and not any(part in name for part in float8_filters):
        raise ConfigError(
            f"{OPTION}=chunked runs the head in the weight's precision, and Float8 would convert {name}; add "
            f"{name!r} to --quantize.linear.float8.filter_fqns or use {OPTION} full"
        )
    return LossChoice(chunk_tokens=chunk)


class JobLoss:
    """torchtitan's ``loss_fn(pred, labels)``: a token sum over the model's output."""

    def __init__(self, full_loss):
        self.full_loss = full_loss
        self.head: nn.Module | None = None
        """The output head, bound by ``apply_chunked_loss``: the model's output is then its input."""

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return self.full_loss(pred, labels)
        return self.head(pred, labels=labels)


_building: weakref.ref[JobLoss] | None = None
"""The loss of the job being built (torchtitan builds one job at a time, its loss before its model parts).
Held weakly: the trainer owns it, and a process that runs another job (a benchmark's rows, the test matrix)
must not keep this one's head, with its sharded weight and process groups, alive."""


def build_loss(job_config, **kwargs) -> JobLoss:
    """The train specs' ``build_loss_fn``: torchtitan's loss, until a chunked head is bound."""
    global _building
    from torchtitan.components.loss import build_cross_entropy_loss

    loss = JobLoss(build_cross_entropy_loss(job_config, **kwargs))
    _building = weakref.ref(loss)
    return loss


def apply_chunked_loss(model: nn.Module, choice: LossChoice) -> None:
    """The head, called by the job's loss with the labels and the hidden states the model returns
    (``ForwardPlan.head_in_loss``), returns the chunked loss (a pipeline stage without the head has none)."""
    head = model.get_output_embeddings()
    if head is None:
        return
    head.forward = functools.partial(_head_loss, head, choice.chunk_tokens)
    loss = _building() if _building is not None else None
    if loss is not None:  # a job's (outside a job, e.g. in a benchmark, the caller calls the head)
        loss.head = head
    logger.info(f"Chunked loss: the head runs in the loss, {choice.chunk_tokens or 'automatic'} tokens per chunk")


def _head_loss(head: nn.Module, chunk_tokens: int, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The head module's forward under the chunked loss: the token-sum cross-entropy of its logits."""
    from titan_ext.kernels.linear_cross_entropy import tp_linear_cross_entropy_sum

    return tp_linear_cross_entropy_sum(hidden, head.weight, labels, chunk_tokens)
