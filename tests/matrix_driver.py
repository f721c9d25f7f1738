"""Run many torchtitan jobs inside one ``torchrun`` launch (used by ``tests/integration_matrix.py``).

Usage: ``torchrun --nproc_per_node=N tests/matrix_driver.py PLAN.json``.

Every process start costs ~15-30 s of imports (fla, torchao, transformers) on
the 2-core CI machine, so the matrix starts its processes once and calls
torchtitan's own entry point, ``torchtitan.train.main(Trainer)``, once per job.
The plan is a list of phases; a phase splits the N processes into lanes (e.g.
four lanes of one process, or two of two) and hands its units (a row's jobs, run
in order) to whichever lane is free, in the plan's order (longest first): a lane
whose units ran long does not hold the phase while the others idle, however
rough the plan's cost estimates are. A job is a fresh torchtitan job: ``main``
parses the job's argv, builds the Trainer, trains, closes and destroys the
process group.

Each job gets its own env:// rendezvous: the lane's first process picks a free
port, hands it to the others through torchrun's store, and every process
points ``MASTER_PORT``/``RANK``/``WORLD_SIZE`` at it with
``TORCHELASTIC_USE_AGENT_STORE=False`` (the lane's rank 0 hosts a new store).
Re-initializing on torchrun's own store does not work: ``destroy_process_group``
resets the group counter, so the next group reads the previous one's gloo
addresses from the store and hangs.

The plan's ``preload`` modules (what the jobs import) are imported once, up
front; titan_ext itself is imported by each job's Trainer, which sets up
that job. Each process writes one JSON result per job (``ok`` or the error) and the
job's log; rank 0 of a job writes its metrics (``--titan_ext.metrics_jsonl``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import importlib
import itertools
import json
import os
import random
import socket
import sys
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path
from unittest import mock

import torch.distributed as dist

PHASE_TIMEOUT = timedelta(minutes=30)
# torchtitan's rank 0 sleeps 2 s after training "for other ranks to complete";
# every job here ends in destroy_process_group, which already waits for them.
NO_SLEEP_TIME = types.SimpleNamespace(**{**vars(time), "sleep": lambda seconds: None})


def free_port() -> int:
    """A free port below the kernel's ephemeral range (``ip_local_port_range``, from 32768 by default): a port
    ``bind(0)`` picks is in that range, where any outgoing connection may take it before the job's store
    binds it (seen once: a job's EADDRINUSE, then every later job of its ranks waiting for it in vain)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def barrier(store: dist.Store, key: str, size: int) -> None:
    if store.add(key, 1) == size:
        store.set(f"{key}/go", "1")
    store.wait([f"{key}/go"], PHASE_TIMEOUT)


def job_env(rank: int, size: int, port: int, extra: dict):
    """torchrun's variables for one job's process group (and the job's own), restored afterwards."""
    return mock.patch.dict(os.environ, {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_WORLD_SIZE": str(size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False", **extra,
    })


def train(argv: list[str], log: Path) -> dict:
    """One torchtitan job through its own ``main``; never raises.

    Each job starts with an empty dynamo cache (a job must not reuse another's
    compiled frames: each job empties it at its end) and fails on any recompile, unless its spec documents why
    it recompiles (``MATRIX_ALLOW_RECOMPILES``, see ``integration_matrix.Spec``).
    It ends with its process groups freed, not only destroyed: DTensor's caches
    hold the job's meshes, and through them its gloo groups, whose threads and
    sockets would otherwise live on through every later job (``job_threads``).
    """
    import torch._dynamo
    import torchtitan.train as titan_train
    from torchtitan.config import ConfigManager

    from titan_ext import compat

    begin = time.monotonic()
    result = {"status": "ok", "error": ""}
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            # main() parses ConfigManager.parse_args' default, sys.argv[1:] as it was at import.
            parse = functools.partialmethod(ConfigManager.parse_args, argv)
            with mock.patch.object(ConfigManager, "parse_args", parse), \
                    mock.patch.object(titan_train, "time", NO_SLEEP_TIME), \
                    torch._dynamo.config.patch(error_on_recompile=os.environ.get("MATRIX_ALLOW_RECOMPILES") != "1"):
                titan_train.main(titan_train.Trainer)
        except BaseException as error:  # noqa: BLE001  (tyro exits with SystemExit on a bad flag)
            if isinstance(error, KeyboardInterrupt):
                raise
            traceback.print_exc()
            result = {"status": "error", "error": f"{type(error).__name__}: {error}"[-2000:]}
        finally:
            if dist.is_initialized():  # main() leaves it up when the job fails
                dist.destroy_process_group()
            torch._dynamo.reset()  # the job's compiled frames, whose guards hold its modules
            forget_dynamo_scopes()
            # DTensor's cached sharding decisions hold the first of equal meshes: a later job's collectives
            # would go to this job's groups. Its other caches keep the groups alive.
            compat.clear_dtensor_caches()
    result["seconds"] = round(time.monotonic() - begin, 2)
    return result


def forget_dynamo_scopes() -> None:
    """Remove the globals dynamo installed for the job's functions without a module (``___unnamed_scope_*``:
    titan_ext's rebound kernels, ``kernels.binding.rebased``) in the modules of the frames it compiled:
    ``torch._dynamo.reset`` leaves them (torch 2.13), and they hold the job's context-parallel layout and
    so its process group."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict):
            for name in [n for n in names if isinstance(n, str) and n.startswith("___unnamed_scope_")]:
                del names[name]


def job_threads() -> dict[str, int]:
    """This process's threads that belong to process groups and stores, by name: what a finished job leaves."""
    names = collections.Counter(path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm"))
    return {name: n for name, n in names.items() if name.startswith(("gloo", "pt_gloo", "pt_tcpstore"))}


def run_job(store: dist.Store, key: str, job: dict, ranks: list[int], rank: int, root: Path) -> None:
    lane_rank = ranks.index(rank)
    port_key = f"{key}/{job['id']}/port"
    if lane_rank == 0:
        store.set(port_key, str(free_port()))
    port = int(store.get(port_key))
    with job_env(lane_rank, len(ranks), port, job["env"]):
        result = train(job["argv"], root / "logs" / f"{job['id']}.rank{lane_rank}.log")
    # The job's groups are in reference cycles, some freed only by a later collection than the one that frees
    # what held them: their threads end when no collection finds more.
    for _ in range(8):
        if not gc.collect():
            break
    result["threads"] = job_threads()
    path = root / "results" / f"{job['id']}.rank{lane_rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)  # whole, for a reader waiting for it (``Launch.guest_finished``)


def run_phase(store: dist.Store, key: str, phase: dict, rank: int, root: Path) -> None:
    """This process's lane takes the phase's next unit until none is left: the lane's first process claims it
    (a counter in the store) and tells the lane's others which one."""
    lane = next((l for l, ranks in enumerate(phase["lanes"]) if rank in ranks), None)
    if lane is None:
        return
    ranks = phase["lanes"][lane]
    for n in itertools.count():
        claim = f"{key}/lane{lane}/{n}"
        if rank == ranks[0]:
            store.set(claim, str(store.add(f"{key}/next", 1) - 1))
        unit = int(store.get(claim))
        if unit >= len(phase["units"]):
            return
        for job in phase["units"][unit]:
            run_job(store, key, job, ranks, rank, root)


def keep_niceness_across_sessions() -> None:
    """Give this process's autogroup its niceness (``nice 10`` from ``integration_matrix.launch``).

    torchrun starts each worker in a session of its own. Where the kernel groups tasks by session
    (``/proc/sys/kernel/sched_autogroup_enabled``, on where CI's runs were measured) a process's niceness
    only ranks it within its session, and each worker's session weighs as much as pytest's: beside four such
    sessions a busy loop got 0.28 of a core, 0.59 with their sessions at nice 10 (2026-11-26, on a machine
    others loaded too). The session's own niceness gives the tests the priority ``matrix_launch`` asks for.
    Only a session leader sets it (else it would lower its caller's session)."""
    niceness = os.nice(0)
    if niceness > 0 and os.getsid(0) == os.getpid():
        with contextlib.suppress(OSError):  # no autogroups (kernel or sandbox): the niceness alone applies
            Path("/proc/self/autogroup").write_text(str(niceness))


def main(plan_path: str) -> None:
    keep_niceness_across_sessions()
    plan = json.loads(Path(plan_path).read_text())
    root = Path(plan["root"])
    for module in ["torchtitan.train", *plan["preload"]]:  # before phase 0, where some processes idle
        importlib.import_module(module)
    # The imports' half a million objects live as long as the process: out of the collector's sight, each
    # collection after a job (``run_job``) reads only what jobs made (0.4 s a collection -> under 1 ms).
    gc.freeze()
    store, rank, world = next(dist.rendezvous("env://"))
    store = dist.PrefixStore(f"titan_ext_matrix/{plan['name']}", store)
    for p, phase in enumerate(plan["phases"]):
        run_phase(store, str(p), phase, rank, root)
        barrier(store, f"phase{p}", world)
    gc.unfreeze()  # for the interpreter's shutdown, which frees only what the collector sees


if __name__ == "__main__":
    main(sys.argv[1])
