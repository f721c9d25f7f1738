"""``python -m titan_ext.census``: every causal-LM model type transformers and fla register, trained through titan_ext.

For each decoder-only text causal LM model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (the
others are listed with their reason: ``titan_ext.census_configs.left_out_reason``), and each of fla's model
types, the census derives a tiny config from the type's own config class (``census_configs.tiny_config``) and
writes one Markdown row:

- **layers' mixers**: the token mixer titan_ext found at each layer of the model its train spec builds
  (``layer_mixers_of``);
- **one process**: one training step as a user runs it, torchtitan's own ``Trainer`` through
  ``torchtitan.train.main`` with ``--model.name hf`` (``fla``) ``--titan_ext.hf_config <tiny config.json>``
  (``train_configs/debug_llama.toml``, seq_len 64, batch 2, fp32, 1 step, no checkpoint, no validation, seed
  0 and torch's deterministic mode, which also fills uninitialized memory with NaN: a parameter that
  ``init_weights`` leaves uninitialized fails the step every time, not now and then):
  ``ok``, titan_ext's one-line refusal, or ``TRACEBACK: <type>: <first line>`` when the job died otherwise
  (a bug), or ``TIMEOUT``;
- **FSDP2, TP, CP, PP, EP, documents**: whether titan_ext *plans* the job under that layout on 2 ranks
  (documents: one) without launching any: the checks a job runs before its build (preflight, then
  ``update_from_config``, which plans the job against a meta-device model), as ``plans`` or the refusal. EP
  is ``n/a`` for a model without experts. These columns say "planned", not "ran": the integration matrix
  runs one model per mixer kind for real.

The last line is ``N of M model types train`` (transformers' types), after ``fla: N of M model types train``.

How it runs (measured on the 2-core CI machine: the whole census in about 40 s with 2 workers unloaded, about
0.3 s of work per type; the budget is 3 minutes): jobs run in ``--jobs`` worker processes forked from this one
once it has imported torch, torchtitan and transformers, so a job costs its own work, not the 5-15 s of imports
of a fresh process; each worker takes one type after another, with the cleanup the integration matrix does
between jobs (``tests/matrix_driver.py``). Each job is torchtitan's real ``Trainer`` and titan_ext's train spec
(``update_from_config`` and the job plan, the spec's model, ``parallelize_fn``, ``init_weights``, forward, the
spec's loss, backward, the optimizer step); what the census trims: the job config is parsed once per worker
(tyro's parse costs about 0.4 s, seven times a type) and each job gets a copy with its own config file and
dump folder (what parsing those flags gives; ``job_config``), and torchtitan's 2 s sleep after training "for
other ranks" is skipped (there are none). Importing fla registers fla's ``mamba``, ``mamba2`` and ``bitnet``
under transformers' names (and titan_ext's TP plans and some transformers modeling files import fla): a
transformers type whose name a worker's fla import took over runs in a fresh worker (``shadowed``), as in a
user's fresh process. A step that runs ``--timeout`` seconds of its worker's CPU time (or sits 10 times that
long on the wall clock: a deadlock uses no CPU) ends its worker: that cell is ``TIMEOUT`` and the type's cells
after it ``not run``. CPU time, not the wall clock, so that a loaded machine (CI runs the integration matrix
beside the tests) does not turn a slow step into a ``TIMEOUT``. Timings go to stderr, never into the table.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import difflib
import functools
import gc
import io
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
TOML = REPO / "train_configs" / "debug_llama.toml"
ASSETS = Path(__file__).resolve().parent / "assets" / "tiny"

LIBRARIES = {"transformers": "hf", "fla": "fla"}
"""The library of a section -> its generic train spec."""
SEQ_LEN, BATCH = 64, 2
LAYOUTS: dict[str, tuple[dict[str, object], int]] = {
    "FSDP2": ({"parallelism.data_parallel_shard_degree": 2}, 2),
    "TP": ({"parallelism.tensor_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),
    "CP": ({"parallelism.context_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),
    "PP": ({"parallelism.pipeline_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),
    "EP": ({"parallelism.expert_parallel_degree": 2}, 2),
    "documents": ({"titan_ext.document_mask": True}, 1),
}
"""Each planned column: its settings (the ``--section.field value`` flags it stands for) and world size."""
ONE_PROCESS = "one process"
COLUMNS = ("model type", "layers' mixers", ONE_PROCESS, *LAYOUTS)
STEPS = ("mixers", *LAYOUTS, ONE_PROCESS)
"""A type's steps, in the order a worker runs them (the cheap plan checks first)."""
NOT_RUN = "not run"
MATRIX = REPO / "tests" / "integration_matrix.py"
"""The integration matrix, in a clone: its runs stand for one model per mixer kind's multi-rank columns."""
PLANS = "plans"


def matrix_runs() -> dict[str, tuple[tuple[str, str, str], dict[str, str]]]:
    """Mixer kind -> ((library, model type, matrix spec), {column: ``spec/row``}) from the integration matrix
    (``MIXER_SPECS``, ``mixer_runs``); empty in an install without the repository's tests."""
    if not MATRIX.exists():
        return {}
    sys.path.insert(0, str(MATRIX.parent))
    try:
        import integration_matrix
    finally:
        sys.path.remove(str(MATRIX.parent))
    return {mixer: (integration_matrix.MIXER_SPECS[mixer], runs) for mixer, runs in integration_matrix.mixer_runs().items()}


def with_runs(cells: dict, runs: dict) -> dict:
    """The census's cells with each planned multi-rank cell of a matrix-run model type (``matrix_runs``) naming
    the matrix row that ran it instead."""
    ran = {(library, model_type): found for (library, model_type, _), found in runs.values()}
    return {key: {column: (f"ran: `{ran[key][column]}`" if value == PLANS and column in ran.get(key, {}) else value)
                  for column, value in cell.items()} for key, cell in cells.items()}


def runs_section(runs: dict) -> list[str]:
    """The table of the matrix's runs, one model per mixer kind."""
    if not runs:
        return []
    columns = [*(c for c in LAYOUTS if c != "documents"), "documents"]
    lines = ["", "## Runs on several ranks, one model per mixer kind", "",
             "Each cell names the integration-matrix row (`python tests/integration_matrix.py --spec SPEC --rows ROW`, "
             "`tests/integration_matrix.py: MIXER_SPECS`) that trains that model equal to one process from one seed "
             "checkpoint; `—`: no row runs it. The census table's cells of these model types say `ran:` with the same "
             "row where they plan (the matrix trains its own tiny config of that type, which may hold fewer kinds of layers "
             "than the census's). A mixer kind not listed has the plan-time checks above only.", "",
             "| mixer | model type (matrix spec) | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 2)]
    for mixer, ((library, model_type, spec), found) in runs.items():
        cells = [f"`{found[c]}`" if c in found else "—" for c in columns]
        lines.append(f"| {mixer} | {library} `{model_type}` (`{spec}`) | " + " | ".join(cells) + " |")
    return lines


# ---- the one place that reads a built model's mixers -----------------------------------------------

def layer_mixers_of(model) -> list[str] | None:
    """Each layer's token-mixer name in a model titan_ext's train spec built, or None if it says none."""
    mixers = getattr(model, "mixers", None)
    if mixers is None:
        return None
    return [str(getattr(mixer, "name", mixer)) for mixer in mixers]


def compress_mixers(names: list[str] | None) -> str:
    """``gla x2, fla attention x2``: runs of equal names, in layer order."""
    if not names:
        return "—"
    runs: list[list] = []
    for name in names:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in runs)


# ---- one type, in a worker -------------------------------------------------------------------------

def base_argv(library: str) -> list[str]:
    """The flags of every job of ``library`` (a type's own config file and dump folder are set per type)."""
    return [
        "--job.config_file", str(TOML), "--model.name", LIBRARIES[library], "--model.flavor", "from_config",
        "--titan_ext.hf_config", "<config.json>", "--model.hf_assets_path", str(ASSETS),
        "--training.steps", "1", "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(BATCH),
        "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1", "--debug.seed", "0",
        "--debug.deterministic", "--debug.deterministic_warn_only",
    ]


@functools.cache
def _parsed(library: str):
    """torchtitan's ``JobConfig`` for ``base_argv``, parsed once per worker: tyro's parse costs about 0.4 s,
    seven times a type."""
    from torchtitan.config import ConfigManager

    with quiet():
        return ConfigManager().parse_args(base_argv(library))


def job_config(library: str, config_path: Path, dump: Path, settings: dict[str, object] | None = None):
    """A fresh copy of the parsed config with this type's config file and dump folder, and ``settings``
    (``{"section.field": value}``) applied: what parsing the equivalent flags gives."""
    config = copy.deepcopy(_parsed(library))
    for key, value in {"titan_ext.hf_config": str(config_path), "job.dump_folder": str(dump),
                       **(settings or {})}.items():
        section, field = key.split(".")
        setattr(getattr(config, section), field, value)
    return config


def flags(settings: dict[str, object]) -> list[str]:
    """The command-line flags ``settings`` stand for."""
    return [part for key, value in settings.items()
            for part in ([f"--{key}"] if value is True else [f"--{key}", str(value)])]


def census_type(library: str, model_type: str, root: Path, send) -> None:
    """Every cell of one model type, each sent as soon as it is known (``send(kind, key, value)``)."""
    from titan_ext import census_configs

    if library == "transformers":
        if shadowed(model_type):
            send("requeue", model_type, None)
            return
        try:
            reason = census_configs.left_out_reason(model_type)
        except Exception as error:  # noqa: BLE001  (the census never crashes: this is its own finding)
            reason = f"CENSUS: cannot read its classes ({one_line(error)})"
        if reason:
            send("left_out", model_type, reason)
            return
    folder = root / library / model_type
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.json"
    try:
        config_path.write_text(json.dumps(census_configs.tiny_config(model_type, library), indent=1,
                                          sort_keys=True, default=str))
    except Exception as error:  # noqa: BLE001
        send("cell", ONE_PROCESS, f"CENSUS: no tiny config ({one_line(error)})")
        return
    dump = folder / "outputs"
    mixers, moe = model_structure(library, config_path)
    send("cell", "mixers", compress_mixers(mixers))
    for column, (settings, world) in LAYOUTS.items():
        if column == "EP" and not moe:
            send("cell", column, "n/a")
            continue
        send("cell", column, plan_result(lambda: job_config(library, config_path, dump, settings), world,
                                         folder / f"plan-{column}.log"))
    send("cell", ONE_PROCESS, train_one_step(job_config(library, config_path, dump), folder / "train.log"))


def shadowed(model_type: str) -> bool:
    """Whether a registration since this process started (fla's, once imported) took ``model_type``'s name
    from transformers: the type then runs in a fresh worker, as in a user's fresh process."""
    from transformers import CONFIG_MAPPING

    from titan_ext import census_configs

    try:
        return CONFIG_MAPPING[model_type] is not census_configs.transformers_classes(model_type)[0]
    except Exception:  # noqa: BLE001  (left_out_reason reports it)
        return False


def model_structure(library: str, config_path: Path) -> tuple[list[str] | None, bool]:
    """(each layer's mixer, whether it has experts) of the model titan_ext's train spec builds from the config,
    on the meta device; where it builds none (the one-process cell says why): (None, whether the config names
    more than one expert)."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    import titan_ext  # noqa: F401  (train specs)
    from titan_ext.models.args import load_hf_config_json

    config = load_hf_config_json(str(config_path))
    try:
        spec = get_train_spec(LIBRARIES[library])
        args = spec.model_args["from_config"]
        args.update_from_hf_config(config, "census")
        with quiet(), torch.device("meta"):
            model = spec.model_cls(args)
    except Exception:  # noqa: BLE001  (reported by the one-process cell)
        return None, names_experts(config)
    moe = any(name.rsplit(".", 1)[-1] == "experts" for name, _ in model.named_modules())
    return layer_mixers_of(model), moe


def names_experts(config: dict) -> bool:
    """Whether a config (or one of its sub-configs) sets more than one expert."""
    from titan_ext.census_configs import EXPERT_COUNTS

    return any(isinstance(v, int) and v > 1 for k, v in config.items() if k in EXPERT_COUNTS) or \
        any(names_experts(v) for v in config.values() if isinstance(v, dict))


def plan_result(make_config, world: int, log: Path) -> str:
    """``plans``, or the one line a job with this config on ``world`` ranks stops with before its build
    (what ``tests/helpers.py: first_error`` runs: preflight, then planning the job against its model); a
    traceback is kept in ``log``."""
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}), quiet():
        try:
            from torchtitan.protocols.train_spec import get_train_spec

            import titan_ext  # noqa: F401  (train specs)
            from titan_ext.errors import ConfigError
            from titan_ext.host import preflight

            config = make_config()
            try:
                preflight.check_job_config(config, world_size=world)
                model_args = get_train_spec(config.model.name).model_args[config.model.flavor]
                type(model_args).update_from_config.__wrapped__(model_args, config)
            except ConfigError as error:
                return refusal(str(error))
            return PLANS
        except BaseException as error:  # noqa: BLE001
            if isinstance(error, KeyboardInterrupt):
                raise
            log.write_text(traceback.format_exc())
            return traceback_cell(error)


def train_one_step(config, log: Path) -> str:
    """One step through torchtitan's own ``main`` with this (parsed) config: ``ok``, titan_ext's one-line
    refusal, or the traceback's cell. The job's log (and a traceback) is kept in ``log``."""
    import torch.distributed as dist
    import torchtitan.train as titan_train
    from torchtitan.config import ConfigManager

    error_file = log.with_suffix(".error.json")
    error_file.unlink(missing_ok=True)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "TORCHELASTIC_USE_AGENT_STORE": "False",
           "TORCHELASTIC_ERROR_FILE": str(error_file)}
    # torchtitan's rank 0 sleeps 2 s after training "for other ranks to complete": there are none
    no_sleep = types.SimpleNamespace(**{**vars(time), "sleep": lambda seconds: None})
    # What parsing does besides building the config: it forgets the titan_ext package (titan_ext.config), so
    # that the Trainer's import of it (custom_import) sets up this job.
    sys.modules.pop("titan_ext", None)
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
            mock.patch.dict(os.environ, env), mock.patch.object(ConfigManager, "parse_args", lambda self: config), \
            mock.patch.object(titan_train, "time", no_sleep):
        try:
            titan_train.main(titan_train.Trainer)
            return "ok"
        except SystemExit as error:  # titan_ext's one line (config_boundary), or tyro on a bad flag
            return refusal(titan_ext_line(error_file)) if error.code == 2 and error_file.exists() else \
                f"TRACEBACK: SystemExit: {error.code}"
        except BaseException as error:  # noqa: BLE001
            if isinstance(error, KeyboardInterrupt):
                raise
            traceback.print_exc()
            return traceback_cell(error)
        finally:
            end_job(dist)


def end_job(dist) -> None:
    """What ``tests/matrix_driver.py`` does between jobs: no process group, compiled frame or DTensor cache
    of this job lives on into the next."""
    import torch._dynamo

    from titan_ext import compat

    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    torch._dynamo.reset()
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict):
            for name in [n for n in names if isinstance(n, str) and n.startswith("___unnamed_scope_")]:
                del names[name]
    with contextlib.suppress(Exception):
        compat.clear_dtensor_caches()
    for _ in range(8):
        if not gc.collect():
            break
    gc.freeze()  # what survived is the worker's (imports, caches): later collections skip it


def titan_ext_line(error_file: Path) -> str:
    """The line titan_ext handed torchrun's error file (``errors.report_to_torchrun``)."""
    try:
        line = json.loads(error_file.read_text())["message"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return "titan_ext: (a refusal whose line was not recorded)"
    return line.removeprefix("titan_ext: ")


def refusal(line: str) -> str:
    return one_line(line)


def traceback_cell(error: BaseException) -> str:
    return f"TRACEBACK: {type(error).__name__}: {one_line(error)}"


def one_line(what) -> str:
    text = str(what).strip().splitlines()[0] if str(what).strip() else "(no message)"
    return text[:400]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def quiet():
    """Library logs and warnings of the plan checks stay out of the census's output."""
    import logging
    import warnings

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        previous = logging.root.manager.disable
        logging.disable(logging.ERROR)
        try:
            yield
        finally:
            logging.disable(previous)


def fla_types() -> list[str]:
    from titan_ext.models.architecture import fla_model_types

    return fla_model_types()


# ---- workers -----------------------------------------------------------------------------------------

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


# ---- the table ----------------------------------------------------------------------------------------

def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("transformers", "flash-linear-attention", "torch", "torchtitan"):
        try:
            found.append(f"{package} {version(package).split('+')[0]}")  # not the build (+cpu, +cu128)
        except PackageNotFoundError:
            found.append(f"{package} (not installed)")
    return ", ".join(found)


def cell_text(value: str, root: Path) -> str:
    """A cell as the table shows it: the run's folder named ``<census>``, addresses elided, pipes escaped."""
    value = value.replace(str(root), "<census>")
    value = re.sub(r"0x[0-9a-fA-F]{6,}", "0x…", value)
    return value.replace("|", "\\|").replace("\n", " ")


def render(cells: dict, root: Path, libraries: list[str]) -> str:
    header = [
        "# Model types titan_ext trains",
        f"Generated by `python -m titan_ext.census --out docs/models.md` ({versions()}); do not edit.",
        "",
        "Each model type's tiny config (`titan_ext/census_configs.py`) trained one step in one process through "
        "torchtitan's Trainer (`--model.name hf` or `fla`, `--titan_ext.hf_config`). The FSDP2, TP, CP, PP, EP "
        "and documents columns say whether titan_ext *plans* the job on 2 ranks (documents: 1): its checks "
        "before the build, not a run, except for one model per mixer kind, run by the integration matrix (`ran:`, "
        "the last section). `TRACEBACK` cells are bugs.",
    ]
    runs = matrix_runs()
    cells = with_runs(cells, runs)
    summaries = []
    body: list[str] = []
    for library in libraries:
        rows = {t: c for (lib, t), c in cells.items() if lib == library}
        if not rows and library != "transformers":  # a --types subset without one of its types
            continue
        kept = {t: c for t, c in rows.items() if "left_out" not in c}
        left = {t: c["left_out"] for t, c in rows.items() if "left_out" in c}
        trains = sum(c.get(ONE_PROCESS) == "ok" for c in kept.values())
        body += ["", f"## {library}", "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        for model_type in sorted(kept):
            c = kept[model_type]
            values = [f"`{model_type}`", c.get("mixers", "—"), *(c.get(k, NOT_RUN) for k in COLUMNS[2:])]
            body.append("| " + " | ".join(cell_text(v, root) for v in values) + " |")
        if left:
            body += ["", f"Left out ({len(left)} of {len(rows)} causal-LM model types: not decoder-only text models):",
                     ""]
            body += [f"- `{t}`: {cell_text(left[t], root)}" for t in sorted(left)]
        line = f"{trains} of {len(kept)} model types train"
        summaries.append(line if library == "transformers" else f"{library}: {line}")
    return "\n".join([*header, *body, *runs_section(runs), "", *reversed(summaries)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_ext.census", description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="", help="comma-separated model types (transformers' and fla's)")
    parser.add_argument("--out", default="", help="write the Markdown here (default: stdout)")
    parser.add_argument("--check", default="", help="exit 1 if this file differs from what the run produces")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="CPU seconds one step of a type may take before it is a TIMEOUT (default 30)")
    parser.add_argument("--logs", default="", help="keep each type's config, job log and results.json here")
    parser.add_argument("--library", choices=["all", "transformers", "fla"], default="all")
    options = parser.parse_args(argv)
    begin = time.monotonic()

    os.environ.setdefault("TITAN_EXT_CPU", "1")  # the same table on a GPU machine
    os.environ.setdefault("OMP_NUM_THREADS", "1" if options.jobs > 1 else "2")
    import torch  # noqa: F401  (before the fork: each worker costs its work, not its imports)
    import torchtitan.train  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import titan_ext  # noqa: F401

    assert "fla" not in sys.modules, "the census's own process must not import fla (see the module docstring)"
    wanted = {t for t in options.types.split(",") if t} or None
    libraries = ["transformers", "fla"] if options.library == "all" else [options.library]
    tasks = [("transformers", t) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
             if "transformers" in libraries and (wanted is None or t in wanted)]
    root = Path(options.logs).resolve() if options.logs else Path(tempfile.mkdtemp(prefix="titan_ext_census_"))
    root.mkdir(parents=True, exist_ok=True)
    imported = time.monotonic() - begin
    try:
        run = run_census(tasks, max(1, options.jobs), options.timeout, root, "fla" in libraries, wanted,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
        text = render(run["cells"], root, libraries)
        if options.logs:
            (root / "results.json").write_text(json.dumps(
                {f"{lib}/{t}": {**c, "seconds": round(run["seconds"].get((lib, t), 0.0), 2),
                                "step_seconds": run["steps"].get((lib, t), {})}
                 for (lib, t), c in sorted(run["cells"].items())}, indent=1))
    finally:
        if not options.logs:
            shutil.rmtree(root, ignore_errors=True)
    jobs = sorted(((s, f"{lib}/{t}") for (lib, t), s in run["seconds"].items()), reverse=True)
    total = time.monotonic() - begin
    print(f"census: {len(jobs)} types in {total:.1f} s wall ({imported:.1f} s imports) on {options.jobs} workers; "
          f"per type {sum(s for s, _ in jobs) / max(1, len(jobs)):.2f} s mean; slowest: "
          + ", ".join(f"{name} {s:.1f} s" for s, name in jobs[:5]), file=sys.stderr)
    if options.out:
        Path(options.out).write_text(text)
    elif not options.check:
        sys.stdout.write(text)
    if options.check:
        expected = Path(options.check).read_text() if Path(options.check).exists() else ""
        if expected != text:
            diff = list(difflib.unified_diff(expected.splitlines(), text.splitlines(), options.check, "this run",
                                             lineterm="", n=0))
            print("\n".join(diff[:40] + ([f"... ({len(diff) - 40} more diff lines)"] if len(diff) > 40 else [])))
            print(f"{options.check} is stale: regenerate it with python -m titan_ext.census --out {options.check}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
