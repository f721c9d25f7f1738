"""``custom_import`` for ``tests/test_crash_safety.py``: titan_ext, plus a SIGKILL mid-checkpoint on one rank.

With ``CRASH_TEST_KILL="STEP:RANK"`` that rank kills itself (SIGKILL: no
handler, no cleanup) right after writing its own shard of checkpoint
``step-STEP``, i.e. while the checkpoint is being written: DCP's ``.metadata``,
which rank 0 writes only after every rank's shard, never appears.
"""

import os
import signal

from torch.distributed.checkpoint.filesystem import FileSystemWriter

import titan_ext  # noqa: F401  (the train specs, and the job's own wrapper of write_data: this one wraps it)

_write_data = FileSystemWriter.write_data


def _write_data_then_maybe_die(self, plan, planner):
    written = _write_data(self, plan, planner)
    step, rank = os.environ["CRASH_TEST_KILL"].split(":")
    if os.path.basename(os.fspath(self.path)) == f"step-{step}" and os.environ["RANK"] == rank:
        written.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    return written


if os.environ.get("CRASH_TEST_KILL"):
    FileSystemWriter.write_data = _write_data_then_maybe_die
