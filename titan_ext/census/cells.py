"""One model type's cells, in a worker: the mixers of the model its train spec builds, whether titan_ext plans
the job under each layout (``columns.LAYOUTS``), and one training step through torchtitan's own ``main``."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import io
import json
import os
import socket
import sys
import time
import traceback
import types
from pathlib import Path
from unittest import mock

from titan_ext.census import configs, model_types
from titan_ext.census.columns import LAYOUTS, ONE_PROCESS, PLANS

TOML = Path(__file__).resolve().parents[2] / "train_configs" / "debug_llama.toml"
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tiny"

LIBRARIES = {"transformers": "hf", "fla": "fla"}
"""The library of a section -> its generic train spec."""
SEQ_LEN, BATCH = 64, 2


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
    if library == "transformers":
        if shadowed(model_type):
            send("requeue", model_type, None)
            return
        try:
            reason = model_types.left_out_reason(model_type)
        except Exception as error:  # noqa: BLE001  (the census never crashes: this is its own finding)
            reason = f"CENSUS: cannot read its classes ({one_line(error)})"
        if reason:
            send("left_out", model_type, reason)
            return
    folder = root / library / model_type
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "config.json"
    try:
        config_path.write_text(json.dumps(configs.tiny_config(model_type, library), indent=1,
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

    try:
        return CONFIG_MAPPING[model_type] is not model_types.transformers_classes(model_type)[0]
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
    return any(isinstance(v, int) and v > 1 for k, v in config.items() if k in configs.EXPERT_COUNTS) or \
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
