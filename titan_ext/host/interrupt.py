"""Ctrl-C or SIGTERM ends a titan_ext job in one line: the step reached and what the same command run again loads.

torchrun hands SIGINT and SIGTERM on to every rank (a terminal's Ctrl-C reaches them all directly). Without a
handler each rank raises KeyboardInterrupt wherever it is, inside a collective or a checkpoint save, and prints
its traceback, or dies of SIGTERM in silence. Here every rank leaves at once with ``os._exit`` (no cleanup to
hang on a rank already gone; a save cut short leaves a step without ``.metadata``, which resuming passes over),
rank 0 after its one line. torchrun's own report of the signal is not the job's to change.
"""

from __future__ import annotations

import logging
import os
import signal
import weakref

from titan_ext.checkpoints import dcp_steps
from titan_ext.errors import rank
from titan_ext.host import job_patches


_job: tuple = (lambda: None, None)
"""(a weak reference to the running job's trainer, its job config): the handler reads the job it stops, and a
finished job's trainer (its process groups) is not kept alive by it in a process that runs several."""


def install(trainer, job_config) -> None:
    """Handle SIGINT and SIGTERM in this rank of the job ``trainer`` runs (the handlers once per process)."""
    global _job
    _job = (weakref.ref(trainer), job_config)
    job_patches.apply_signal_handlers(_stop)


def _stop(number: int, frame) -> None:
    trainer, job_config = _job[0](), _job[1]
    if rank() == 0 and job_config is not None:
        logging.getLogger().warning(f"titan_ext: {interrupted_line(number, trainer, job_config)}")
        for handler in logging.getLogger().handlers:
            handler.flush()
    os._exit(128 + number)


def interrupted_line(number: int, trainer, job_config) -> str:
    step, steps = getattr(trainer, "step", 0), job_config.training.steps
    where = f"at step {step} of {steps}" if step else "before the first step"
    return (f"stopped by {signal.Signals(number).name} {where}; the same command "
            f"{dcp_steps.rerun_resumes_from(job_config)}")
