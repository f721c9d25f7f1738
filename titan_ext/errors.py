"""A configuration mistake ends the job in one line.

Checks raise ``ConfigError`` with one line naming the option, its value and
the fix. ``config_boundary`` wraps every titan_ext hook torchtitan calls: it
turns a ``ConfigError`` into that line, logged once (rank 0; see ``exit_with``), and a quiet
``SystemExit(2)`` on every rank, so no rank prints a Python traceback; under
torchrun the line is also the root cause of torchrun's failure summary
(``report_to_torchrun``). Outside those hooks (tests, scripts) the error is an
ordinary ``ValueError``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time

EXIT_CODE = 2

logger = logging.getLogger("titan_ext")


class ConfigError(ValueError):
    """A bad option, flag or file: one line that names it and the fix."""


class HostChanged(ConfigError):
    """An installed release of a host package (transformers, fla, torchtitan, torch) no longer behaves as
    titan_ext relies on: training would run on wrong numbers, so the job stops, naming the package, its
    version and what changed."""

    def __init__(self, package: str, what: str):
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version(package)
        except PackageNotFoundError:
            installed = "(not installed)"
        super().__init__(f"{package} {installed}: {what}; titan_ext would train on wrong numbers. Install a "
                         f"tested version (docs/tested-versions.md) or report it")


def rank() -> int:
    """This process's global rank, before or after the process group exists."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


OTHER_RANKS_WAIT_S = 30.0
"""How long a rank other than 0 waits for rank 0 to print its line first: on a loaded machine rank 0 may still
be importing when another rank has its error."""


def exit_with(error: ConfigError) -> None:
    """Log the error's one line on rank 0 and leave quietly (no traceback) with ``EXIT_CODE``.

    Every rank runs the same checks, but not in step: a rank that leaves first
    makes torchrun stop the others, possibly before rank 0 has printed. So the
    other ranks wait for rank 0 to print and exit (torchrun then stops them);
    a rank whose input alone is bad (rank 0 never fails) speaks for itself.
    """
    own_rank = rank()
    if own_rank != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    prefix = "titan_ext" if own_rank == 0 else f"titan_ext (rank {own_rank} only)"
    logging.getLogger().error(f"{prefix}: {error}")
    for handler in logging.getLogger().handlers:
        handler.flush()
    report_to_torchrun(f"{prefix}: {error}")
    raise SystemExit(EXIT_CODE) from None


def report_to_torchrun(line: str) -> None:
    """Hand torchrun the line as this worker's error (torch.distributed.elastic's error-file protocol, the
    format of its ``ErrorHandler.record_exception`` without a Python call stack): its failure summary, the
    last thing a user sees, then shows the line as the root cause instead of a link to enable tracebacks."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return  # not under torchrun
    message = {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}
    try:
        with open(path, "w") as f:
            json.dump({"message": message}, f)
    except OSError:  # the summary falls back to torchrun's own words; the log keeps the line
        pass


def config_boundary(fn):
    """Run a hook torchtitan calls; a ``ConfigError`` ends the job in one line."""

    @functools.wraps(fn)
    def hook(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as error:
            exit_with(error)

    return hook


_deferred: list[ConfigError] = []


def defer(error: ConfigError) -> None:
    """Hold an error met inside a training step (a bad data record): the ranks learn of it together at the
    step's end (``nonfinite``'s per-step agreement) and stop in one line, none left blocked in a collective."""
    if not _deferred:
        _deferred.append(error)


def take_deferred() -> ConfigError | None:
    return _deferred.pop() if _deferred else None
