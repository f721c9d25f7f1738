"""The census's worker processes: forked once the parent has imported torch, torchtitan and transformers, each
takes one model type after another (``cells.census_type``); a step past ``--timeout`` CPU seconds ends its worker."""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

from titan_ext.census.cells import census_type
from titan_ext.census.columns import NOT_RUN, ONE_PROCESS, STEPS


def fla_types() -> list[str]:
    from titan_ext.models.architecture import fla_model_types

    return fla_model_types()


def worker_main(conn, root: str, threads: int) -> None:
    """Take (library, model type) tasks until told to stop; send each cell, then ``done`` with whether fla is
    now imported here."""
    import logging

    import torch

    torch.set_num_threads(threads)
    silence_process()
    gc.freeze()  # the imports' objects: each job's collections read only what jobs made
    while True:
        task = conn.recv()
        if task is None:
            conn.close()
            os._exit(0)  # no interpreter teardown: nothing of a worker's needs it
        library, model_type = task
        last = [time.monotonic()]

        def send(kind, key, value):
            now = time.monotonic()
            conn.send((kind, key, value, round(now - last[0], 2)))
            last[0] = now

        if library == "fla-list":
            send("fla-list", None, fla_types())
        else:
            census_type(library, model_type, Path(root), send)
        logging.getLogger().handlers.clear()  # torchtitan's handler writes to the job's (closed) log
        send("done", None, "fla" in sys.modules)


def silence_process() -> None:
    """A worker writes nothing to the census's console (the parent reports each type): its jobs' logs go
    to their log files, anything else (library warnings, C++ log lines) nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    sys.stdout = sys.stderr = open(os.devnull, "w")


class Worker:
    def __init__(self, context, root: Path, threads: int):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, str(root), threads), daemon=True)
        self.process.start()
        child.close()
        self.task: tuple[str, str] | None = None
        self.cpu_mark = self.wall_mark = 0.0
        self.step = 0
        self.requeue = False
        self.started = 0.0

    def give(self, task) -> None:
        self.task, self.step, self.started = task, 0, time.monotonic()
        self.mark()
        self.conn.send(task)

    def mark(self) -> None:
        """A step starts now."""
        self.cpu_mark, self.wall_mark = self.cpu_seconds(), time.monotonic()

    def cpu_seconds(self) -> float:
        """The worker's CPU time (its threads' user and system time; Linux's /proc), else the wall clock."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return time.monotonic()

    def overdue(self, timeout: float) -> bool:
        return self.cpu_seconds() - self.cpu_mark > timeout or time.monotonic() - self.wall_mark > 10 * timeout

    def stop(self, kill: bool = False) -> None:
        if not kill:
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def run_census(tasks: list[tuple[str, str]], jobs: int, timeout: float, root: Path, with_fla: bool,
               fla_filter=None, log=print) -> dict:
    """Every task's cells: ``{(library, type): {"left_out": reason} | {step: cell}}``; ``seconds`` by task."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    threads = 1 if jobs > 1 else 2
    results: dict[tuple[str, str], dict] = {}
    seconds: dict[tuple[str, str], float] = {}
    step_seconds: dict[tuple[str, str], dict[str, float]] = {}
    pending = collections.deque(tasks)
    if with_fla:
        pending.append(("fla-list", ""))
    workers = [Worker(context, root, threads) for _ in range(jobs)]
    try:
        while pending or any(w.task for w in workers):
            for i, worker in enumerate(workers):
                if worker.task or not pending:
                    continue
                worker.give(pending.popleft())
            busy = [w for w in workers if w.task]
            from multiprocessing.connection import wait

            ready = wait([w.conn for w in busy], timeout=1.0)
            for worker in busy:
                if worker.conn in ready:
                    try:
                        kind, key, value, took = worker.conn.recv()
                    except (EOFError, OSError):
                        died(worker, results, f"TRACEBACK: worker died (exit code {worker.process.exitcode})")
                        workers[workers.index(worker)] = Worker(context, root, threads)
                        continue
                    worker.mark()
                    cells = results.setdefault(worker.task, {})
                    if kind == "cell":
                        cells[key] = value
                        step_seconds.setdefault(worker.task, {})[key] = took
                        worker.step = STEPS.index(key) + 1
                    elif kind == "requeue":
                        results.pop(worker.task)
                        worker.requeue = True
                    elif kind == "left_out":
                        cells["left_out"] = value
                    elif kind == "fla-list":
                        results.pop(worker.task)
                        pending.extend(("fla", t) for t in value if fla_filter is None or t in fla_filter)
                    elif kind == "done" and worker.requeue:  # to a fresh worker, forked from this clean process
                        pending.appendleft(worker.task)
                        worker.task = None
                        worker.stop()
                        workers[workers.index(worker)] = Worker(context, root, threads)
                    elif kind == "done":
                        seconds[worker.task] = time.monotonic() - worker.started
                        if worker.task[0] != "fla-list":
                            log(f"census: {worker.task[0]} {worker.task[1]}: "
                                f"{cells.get(ONE_PROCESS, cells.get('left_out', ''))[:100]} "
                                f"({seconds[worker.task]:.1f} s)")
                        worker.task = None
                elif worker.overdue(timeout):
                    log(f"census: {worker.task[0]} {worker.task[1]}: TIMEOUT in its {STEPS[worker.step]} step")
                    died(worker, results, "TIMEOUT")
                    worker.stop(kill=True)
                    workers[workers.index(worker)] = Worker(context, root, threads)
    finally:
        for worker in workers:
            worker.stop(kill=bool(worker.task))
    return {"cells": results, "seconds": seconds, "steps": step_seconds}


def died(worker: Worker, results: dict, cell: str) -> None:
    """The step in progress gets ``cell``; the steps after it were not run."""
    if worker.task[0] == "fla-list":
        worker.task = None
        return
    cells = results.setdefault(worker.task, {})
    for n, step in enumerate(STEPS[worker.step:]):
        cells[step] = cell if n == 0 else NOT_RUN
    if worker.step == 0:
        cells["mixers"] = "—"
    worker.task = None
