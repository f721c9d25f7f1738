"""The step line a person reads, through torchtitan's own ``MetricsProcessor.log`` (one process; the matrix's
``fsdp2`` row checks a 2-rank job's console: tests/integration_matrix.py, ``console_problem``)."""

import logging
import math
import re
from types import SimpleNamespace

import pytest
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.utils import Color, NoColor

from titan_ext import patching
from titan_ext.host import job_patches, progress


def processor(color, peak: float) -> MetricsProcessor:
    """torchtitan's processor with what its ``log`` reads, and no process group or device."""
    stats = SimpleNamespace(max_active_gib=0.5, max_active_pct=1.0, max_reserved_gib=0.6, max_reserved_pct=2.0,
                            num_alloc_retries=0, num_ooms=0)
    p = MetricsProcessor.__new__(MetricsProcessor)
    p.logger = SimpleNamespace(log=lambda metrics, step: None)
    p.parallel_dims = SimpleNamespace(non_data_parallel_size=1)
    p.job_config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1))
    p.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: stats, reset_peak_stats=lambda: None)
    p.color, p.gpu_peak_flops, p.num_flops_per_token = color, peak, 1000
    p.ntokens_since_last_log, p.data_loading_times, p.time_last_log = 512, [0.01], 0.0
    return p


def logged_lines(caplog, p: MetricsProcessor, steps, total: int, shown: bool = True) -> list[str]:
    clock = progress.StepClock()
    times = iter(float(step) * 2 for step in steps)  # 2 s a step
    log = progress.with_progress(p.log, total, shown, progress.has_peak(p), clock)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        for step in steps:
            real_tick = clock.tick
            clock.tick = lambda s, _now, t=next(times): real_tick(s, t)
            p.ntokens_since_last_log, p.data_loading_times = 512, [0.01]
            log(step, 2.5, 2.6, 1.2)
            clock.tick = real_tick
    return [r.getMessage() for r in caplog.records]


def test_the_step_line_says_step_of_total_and_the_time_left(caplog):
    lines = logged_lines(caplog, processor(NoColor(), math.inf), [1, 2, 3, 5], total=10)
    assert [re.match(r"step: (\d+/\d+)  loss", line).group(1) for line in lines] == ["1/10", "2/10", "3/10", "5/10"]
    assert [line.rsplit("  ", 1)[1] for line in lines] == ["left: ?", "left: 0:00:16", "left: 0:00:14", "left: 0:00:10"]
    assert not any("mfu" in line or "\x1b" in line for line in lines)
    assert "tflops:" in lines[0]  # torchtitan's other figures stay


def test_mfu_stays_where_the_device_has_a_peak_and_colours_where_asked(caplog):
    (line,) = logged_lines(caplog, processor(Color(), 1e15), [1], total=3)
    assert line.startswith(f"{Color.red}step: 1/3  {Color.green}loss:")
    assert re.search(r"mfu: [\d.]+%  left: \?\x1b\[39m$", line), line


def test_another_ranks_step_line_is_not_printed(caplog):
    assert logged_lines(caplog, processor(NoColor(), math.inf), [1, 2], total=3, shown=False) == []


def test_the_clock_times_the_recent_steps_only():
    clock = progress.StepClock(recent=4)
    for step, now in [(1, 100.0), (2, 110.0), (3, 111.0), (4, 112.0), (5, 113.0), (6, 114.0), (7, 115.0)]:
        clock.tick(step, now)
    assert clock.seconds_per_step() == pytest.approx(1.0)  # step 2's 10 s fell out of the window
    assert clock.seconds_left(10) == pytest.approx(3.0)


def test_other_ranks_keep_warnings_and_the_step_line(monkeypatch):
    quiet = progress.OtherRankQuiet()
    record = logging.LogRecord("", logging.INFO, __file__, 1, "Building model", None, None)
    assert not quiet.filter(record)
    record.titan_ext_step_line = True
    assert quiet.filter(record)
    assert quiet.filter(logging.LogRecord("", logging.WARNING, __file__, 1, "x", None, None))
    monkeypatch.setenv("RANK", "1")
    job_config = SimpleNamespace(titan_ext=SimpleNamespace(log_every_rank=False))
    assert progress.quiets_this_rank(job_config)
    job_config.titan_ext.log_every_rank = True
    assert not progress.quiets_this_rank(job_config)


def test_colours_only_on_a_terminal_without_no_color(monkeypatch):
    monkeypatch.setattr("sys.stdout", SimpleNamespace(isatty=lambda: True))
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert progress.colours_wanted()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not progress.colours_wanted()
    monkeypatch.setattr("sys.stdout", SimpleNamespace(isatty=lambda: False))
    monkeypatch.delenv("NO_COLOR")
    assert not progress.colours_wanted()


def test_the_quiet_filter_leaves_with_undo():
    root = logging.getLogger()
    handler = logging.NullHandler()
    root.addHandler(handler)
    try:
        quiet = progress.OtherRankQuiet()
        job_patches.quiet_other_rank(quiet)
        assert quiet in handler.filters
        patching.undo()
        assert quiet not in handler.filters
    finally:
        root.removeHandler(handler)
