"""The changes every titan_ext job makes (``JOB``), those a feature makes to its own job (``PER_JOB``), the
job's signal handlers, and the host warnings and log lines that ask nothing of a user.

* ``JOB``: in every torchtitan job that imports titan_ext, CPU or GPU (``apply_job``).
* ``PER_JOB``: one object of the job, changed by the feature that needs it (the optimizer's step, the metrics logger, step line, colours and close, the trainer's split
  of a batch and its close).
* ``SIGNALS``: the SIGINT and SIGTERM handlers of every titan_ext job (Python's, not a library's).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator

from titan_ext import patching
from titan_ext.host.cpu_patches import CPU_MODE_LOGS, CPU_MODE_WARNINGS
from titan_ext.patching import TORCHTITAN, InstancePatch, Setting

# Python warnings of any titan_ext job that ask nothing of its user: (message regex, why, versions seen).
JOB_WARNINGS: tuple[tuple[str, str, str], ...] = (
    ("FSDP2-wrapped module .* returned a view tensor",
     "torch's FSDP, on every rank at step 1: titan_ext's forward returns its logits as a view (reshaped from a "
     "packed row); only the loss reads them, nothing writes them in place", "torch 2.13-2.15"),
)

# Log records of any titan_ext job that ask nothing of its user: (logger, message part, why).
JOB_LOGS: tuple[tuple[str, str, str], ...] = (
    ("torch.utils._pytree", "is an Enum subclass",
     "torchao 0.18 registers its enums with torch.compile on import, which torch 2.13 deprecates"),
    ("transformers.utils.generic", "`past_key_values`/`cache_params` are deprecated",
     "fla 0.6's models build their outputs with past_key_values=, which transformers 5.24 renamed to cache"),
    ("", "Pipeline Parallel loss is not visible",
     "torchtitan's hint (every rank, under PP) to list the last stage's rank in LOG_RANK: titan_ext prints the step "
     "line from that rank (titan_ext.host.progress)"),
)


# Python warnings of titan_ext's entry points other than training (``titan_ext.pretrained.from_pretrained(...)``
# and its ``generate``, the planner) that ask nothing of their user: (message regex, why, versions seen).
ENTRY_WARNINGS: tuple[tuple[str, str, str], ...] = (
    ("`past_key_values` is deprecated and will be removed",
     "fla 0.6's prepare_inputs_for_generation passes past_key_values=, which transformers 5.24 renamed to cache",
     "fla 0.6.0, transformers 5.24"),
    ("Both `past_key_values` and `cache` are set", "the same call, once transformers has made its cache",
     "fla 0.6.0, transformers 5.24"),
)


@contextlib.contextmanager
def quiet_entry() -> Iterator[None]:
    """The console of a titan_ext entry point other than training, for the call alone: the job's tables,
    ``ENTRY_WARNINGS``, and off an accelerator CPU mode's (its warnings and logs, not its patches)."""
    import torch

    cpu = not torch.accelerator.is_available()
    messages = [m for m, *_ in (*JOB_WARNINGS, *ENTRY_WARNINGS)] + [m for m, _ in CPU_MODE_WARNINGS] * cpu
    logs = [(name, part) for name, part, _ in (*JOB_LOGS, *(CPU_MODE_LOGS if cpu else ()))]
    filters = [(logging.getLogger(name), patching.DropMessages(part)) for name, part in logs]
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=message)
        for logger, log_filter in filters:
            logger.addFilter(log_filter)
        try:
            yield
        finally:
            for logger, log_filter in filters:
                logger.removeFilter(log_filter)


class _OneLineModelArgs(logging.Filter):
    """torchtitan logs the model args as indented JSON (~26 lines per rank); keep it to one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Building ") and "with {\n" in message:
            head, _, body = message.partition("with {\n")
            record.msg, record.args = f"{head.rstrip()} with {{{' '.join(body.split())}", None
        return True


JOB: tuple[tuple[str, str], ...] = (
    ("root logger: filter _OneLineModelArgs", "the model-args dump, one line instead of ~26 per rank"),
    ("torch._inductor.config._micro_pipeline_tp", "async TP (model_plans.enable_async_tp: model_plans imports "
     "no titan_ext, so it sets torch's flag itself, as torchtitan's own apply_tp does)"),
    ("torch CP: DTensor's SDPA handlers", "ring attention under CP (torchtitan's apply_cp_to_attention_module, as for "
     "its own models; titan_ext.parallel.context_parallel.apply_cp); torchtitan never turns it off"),
    ("root logger's handlers: filter progress.OtherRankQuiet", "on a rank other than 0, warnings, errors and the "
     "step line only (quiet_other_rank; torchtitan prints every INFO line once per rank)"),
)
"""Changes a job makes through torchtitan's or model_plans' own functions (listed, not applied here)."""


OPTIMIZER_STEP = InstancePatch(
    "torchtitan.components.optimizer:OptimizersContainer.step",
    "the non-finite-loss guard: every rank agrees on the step's flag, then steps, skips or stops before the update "
    "(titan_ext.host.nonfinite)",
    TORCHTITAN,
)
METRICS_LOGGER = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.logger",
    "--titan_ext.metrics_jsonl: every logged step also at full precision, as JSON lines (titan_ext.host.metrics)",
    TORCHTITAN,
)
METRICS_CLOSE = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.close",
    "the one component torchtitan closes after the checkpointer: an HF export is completed there (config.json, "
    "tokenizer; titan_ext.host.metrics)",
    TORCHTITAN,
)
METRICS_LOG = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.log",
    "a mixture-of-experts model's per-step metrics (the routers' balancing loss, tokens per expert) join the "
    "logged ones (titan_ext.host.moe_metrics, titan_ext.host.metrics)",
    TORCHTITAN,
)
METRICS_STEP_LINE = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.log",
    "its step line says step N of --training.steps and the time left, and no MFU where the device has no peak "
    "FLOPS; it is printed by the rank holding the loss only (titan_ext.host.progress, titan_ext.host.metrics)",
    TORCHTITAN,
)
METRICS_COLOR = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.color",
    "torchtitan colours its lines with ANSI codes unless --metrics.disable_color_printing, also into a file: "
    "no colours off a terminal or with NO_COLOR set (titan_ext.host.progress)",
    TORCHTITAN,
)
TRAINER_BATCH = InstancePatch(
    "torchtitan.train:Trainer.post_dataloading_process",
    "torchtitan hands the dataloader's extra inputs to the first pipeline stage only, and its extra kwargs (its "
    "own models' attention masks, CP's positions) to every stage, which torch's schedule splits into micro-batches "
    "as it splits the inputs: document masking's document_positions join the kwargs, so every stage reads each "
    "micro-batch's boundaries (without PP the model receives both alike; titan_ext.data.documents)",
    TORCHTITAN,
)
TRAINER_CLOSE = InstancePatch(
    "torchtitan.train:Trainer.close",
    "the job's end (torchtitan's main calls it after training and after a failure) ends its dataloaders' worker "
    "processes, which torchdata keeps until the garbage collector frees the trainer: in a process running one job "
    "after another, a worker forked from one job outlived it (titan_ext.data.ending_dataloader_workers)",
    TORCHTITAN,
)
PER_JOB: tuple[Setting | InstancePatch, ...] = (OPTIMIZER_STEP, METRICS_LOGGER, METRICS_CLOSE, METRICS_LOG,
                                                METRICS_STEP_LINE, METRICS_COLOR, TRAINER_BATCH, TRAINER_CLOSE)
"""Applied by the feature that needs it, to its own job (each names it)."""

SIGNALS: tuple[str, ...] = ("SIGINT", "SIGTERM")
"""The Python handlers a titan_ext job installs (``apply_signal_handlers``): Ctrl-C or a scheduler's SIGTERM
ends every rank at once, rank 0 first saying in one line the step reached and what a rerun loads, instead of a
KeyboardInterrupt traceback per rank (``titan_ext.host.interrupt``). Restored by ``patching.undo()``."""

TABLES = (PER_JOB,)


def apply_job() -> None:
    """``JOB``'s log filter and its warning/log filters, once per process."""
    if not patching.first_time(JOB):
        return
    log_filter = _OneLineModelArgs()
    logging.getLogger().addFilter(log_filter)
    patching.on_undo(lambda: logging.getLogger().removeFilter(log_filter))
    patching.quiet([message for message, _, _ in JOB_WARNINGS], [(name, part) for name, part, _ in JOB_LOGS])


def quiet_other_rank(log_filter: logging.Filter) -> None:
    """The job's filter on the root logger's handlers (torchtitan's ``init_logger`` makes them anew for each job,
    so a filter ends with its job); ``patching.undo()`` removes it."""
    for handler in list(logging.getLogger().handlers):
        handler.addFilter(log_filter)
        patching.on_undo(lambda h=handler: h.removeFilter(log_filter))


def apply_signal_handlers(handler: Callable) -> None:
    """``handler`` for each of ``SIGNALS``, once per process; ``patching.undo()`` restores the handlers before."""
    import signal

    if not patching.first_time(SIGNALS):
        return
    for name in SIGNALS:
        number = getattr(signal, name)
        before = signal.signal(number, handler)
        patching.on_undo(lambda n=number, b=before: signal.signal(n, b))
