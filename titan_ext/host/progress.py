"""The console a person reads: one rank's lines, and a step line that says how far the job is.

torchtitan prints every INFO line once per rank and a step line (``step: N  loss: ...``) without the total
or the time left, in ANSI colours even into a file, with an MFU of 0.00% where its device has no peak (the
CPU). In a titan_ext job:

* ranks other than 0 print only their warnings and errors (``[titan_ext] log_every_rank`` prints every
  rank's lines, as torchtitan does); the step line comes from the rank holding the loss (under PP the last
  stage's), printed there only;
* the step line reads ``step: N/TOTAL ... left: H:MM:SS``, the time left from the recent steps' times;
* colours only on a terminal, and not with ``NO_COLOR`` set (https://no-color.org);
* no ``mfu`` where the device has no peak FLOPS to divide by.

Every change to torchtitan's objects is a row of ``titan_ext.host.job_patches``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import re
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator

from titan_ext.errors import rank

RECENT_STEPS = 10
"""The time left is the mean step time over at most this many of the latest steps."""

_ANSI = r"(?:\x1b\[[\d;]*m)?"
STEP = re.compile(rf"^({_ANSI}step:)\s*(\d+)")
MFU = re.compile(rf"\s*{_ANSI}mfu: [^\s\x1b]+")


def every_rank(job_config) -> bool:
    """``[titan_ext] log_every_rank`` (the section is absent without ``custom_config_module``)."""
    return bool(getattr(getattr(job_config, "titan_ext", None), "log_every_rank", False))


def colours_wanted() -> bool:
    """Colours on a terminal only, unless ``NO_COLOR`` is set."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


class StepLineMark(logging.Filter):
    """Marks the step line torchtitan logs inside ``MetricsProcessor.log`` and gives it its new text (or drops
    it: ``render`` returns None), for one call."""

    def __init__(self, render: Callable[[str], str | None]):
        super().__init__()
        self.render = render

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not STEP.match(message):
            return True
        text = self.render(message)
        if text is None:
            return False
        record.msg, record.args, record.titan_ext_step_line = text, None, True
        return True


class OtherRankQuiet(logging.Filter):
    """On a rank other than 0, on torchtitan's console handler: warnings, errors and the step line only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or getattr(record, "titan_ext_step_line", False)


def quiets_this_rank(job_config) -> bool:
    return rank() != 0 and not every_rank(job_config)


class StepClock:
    """The latest logged steps' (step, time): seconds per step over the recent ones, the first logged step's
    own time left out (it holds the build, compile and autotuning)."""

    def __init__(self, recent: int = RECENT_STEPS):
        self.recent = recent
        self.marks: deque[tuple[int, float]] = deque()

    def tick(self, step: int, now: float) -> None:
        self.marks.append((step, now))
        while len(self.marks) > 2 and self.marks[-1][0] - self.marks[1][0] >= self.recent:
            self.marks.popleft()

    def seconds_per_step(self) -> float | None:
        if len(self.marks) < 2:
            return None
        (first_step, first_time), (last_step, last_time) = self.marks[0], self.marks[-1]
        return (last_time - first_time) / (last_step - first_step) if last_step > first_step else None

    def seconds_left(self, total: int) -> float | None:
        per_step = self.seconds_per_step()
        return None if per_step is None else per_step * max(total - self.marks[-1][0], 0)


def clock_text(seconds: float | None) -> str:
    """``left: H:MM:SS``, or ``left: ?`` before two steps were timed."""
    if seconds is None:
        return "left: ?"
    return f"left: {datetime.timedelta(seconds=round(seconds))}"


def step_line(message: str, total: int, seconds_left: float | None, mfu: bool) -> str:
    """torchtitan's step line with the total after the step, the time left at its end, and no MFU unless
    ``mfu``; any colour codes kept where they were."""
    line = STEP.sub(lambda m: f"{m.group(1)} {m.group(2)}/{total}", message, count=1)
    if not mfu:
        line = MFU.sub("", line)
    reset = re.search(rf"{_ANSI}$", line).group(0)
    return f"{line[:len(line) - len(reset)]}  {clock_text(seconds_left)}{reset}"


def with_progress(log, total: int, shown: bool, mfu: bool, clock: StepClock | None = None):
    """``MetricsProcessor.log`` whose step line says step N/total and the time left, or is not printed
    (``shown`` False: another rank prints it)."""
    clock = clock or StepClock()

    def log_step(step, *args, **kwargs):
        clock.tick(step, time.perf_counter())
        left = clock.seconds_left(total)
        with _marked(StepLineMark(lambda message: step_line(message, total, left, mfu) if shown else None)):
            return log(step, *args, **kwargs)

    return log_step


@contextlib.contextmanager
def _marked(mark: logging.Filter) -> Iterator[None]:
    root = logging.getLogger()
    root.addFilter(mark)
    try:
        yield
    finally:
        root.removeFilter(mark)


def has_peak(processor) -> bool:
    """Whether torchtitan knows the device's peak FLOPS (CPU mode answers inf: no MFU)."""
    return math.isfinite(processor.gpu_peak_flops)
