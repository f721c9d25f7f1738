"""Plain helpers shared by several test files (fixtures live in ``conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEBUG_GLA_TOML = REPO / "train_configs" / "debug_gla.toml"


def without_fla_python_notice(stderr: str) -> str:
    """``stderr`` less fla's import-time advice to a Python below 3.11 to upgrade: it asks something of its
    user, so titan_ext's quiet consoles pass it on (pyproject.toml allows Python 3.10)."""
    import re
    import sys

    if sys.version_info >= (3, 11):
        return stderr
    return re.sub(r"Current Python version 3\.\d+ is below the recommended 3\.11 version\..*\n?", "", stderr)


def job_config(*flags: str, config_file: Path | str = DEBUG_GLA_TOML):
    """torchtitan's parsed ``JobConfig`` for a shipped TOML plus command-line ``flags``."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(config_file), *flags])


def assert_rel_close(actual, expected, tol=1e-5, what=""):
    """Relative error in the Frobenius norm: ||a - e|| <= tol * ||e||."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).norm()
    ref = expected.double().norm().clamp_min(1e-12)
    assert err <= tol * ref, f"{what}: relative error {(err / ref).item():.2e} > {tol:.0e}"


def gla_inputs(B, T, H, K, V, seed=0, with_h0=True, dtype=torch.float32, device="cpu"):
    """q, k, v, log-space gate, and an fp32 initial state (fla requires fp32 states)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, generator=g, dtype=dtype).to(device)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    gk = F.logsigmoid(4 * randn(B, T, H, K))  # some gates near 0, some strongly decaying
    h0 = randn(B, H, K, V, dtype=torch.float32) if with_h0 else None
    return q, k, v, gk, h0


def leaves(*xs):
    """Fresh leaf copies that require grad (None stays None)."""
    return [None if x is None else x.clone().requires_grad_() for x in xs]


def backward_with_random_cotangents(outputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outputs if o is not None)
    loss.backward()


def assert_outputs_exact_and_gradients_close(ours: list, reference: list, what: str) -> None:
    """``[output, final state, *gradients]`` of two runs of the same kernels: the outputs bit for bit, the
    gradients within bf16 slack (a backward kernel may not be deterministic); prints the worst gradient."""
    torch.testing.assert_close(ours[:2], reference[:2], rtol=0, atol=0)
    worst = 0.0
    for a, b in zip(ours[2:], reference[2:]):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    print(f"{what}: outputs bit for bit, gradients within {worst:.1e} (max abs)")


def on_forked_ranks(world: int, work):
    """``work(rank, mesh)`` on ``world`` forked gloo ranks (a 1-D CPU mesh); returns ``{rank: result}``.

    Forked, not spawned: a spawned rank spends ~10-20 s of a 2-core machine importing fla and
    transformers. Fork hands the children the test process's state: DTensor's cached shardings,
    which would give back an equal mesh of an earlier (fake) process group (DeviceMesh equality
    ignores the group) whose collectives exchange nothing, are cleared here, before the fork (in a
    forked child the clear can block on a lock another thread of this process held); each child
    drops an inherited initialized process group itself.

    Once this process has started autograd's device threads (any CUDA backward; a DTensor backward
    in torch 2.11's CUDA build), a forked child cannot run backward at all; and while gloo's threads of an
    earlier group run in it, a forked child may inherit a lock one of them held and wait on it for ever (seen
    once in the whole suite: both ranks asleep in an optimizer step). The ranks then fork from a fresh server
    process instead (``forkserver``: one import of titan_ext for the whole session).
    """
    import socket

    import torch.multiprocessing as mp
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_method = "fork" if _forked_child_can_backward() and not _gloo_threads() else "forkserver"
    if start_method == "forkserver":
        mp.set_forkserver_preload(["titan_ext", "fla.models", "transformers", "helpers"])
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_forked_rank, args=(world, port, work, results), nprocs=world, start_method=start_method)
        return dict(results)


def _gloo_threads() -> bool:
    """Whether gloo's threads (an earlier process group's) run in this process."""
    import os

    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return False
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return any(name.startswith(("gloo", "pt_gloo")) for name in names)


def _forked_child_can_backward() -> bool:
    import os

    pid = os.fork()
    if pid == 0:
        try:
            (torch.ones(1, requires_grad=True) * 2).sum().backward()
        except RuntimeError:
            os._exit(1)
        os._exit(0)
    return os.waitpid(pid, 0)[1] == 0


def _forked_rank(rank, world, port, work, results):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # before any op: the parent's OpenMP pool does not survive fork
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = work(rank, init_device_mesh("cpu", (world,)))
    finally:
        dist.destroy_process_group()


def first_error(argv: list[str], world: int) -> str:
    """What a job with these flags on ``world`` ranks stops with before its build (the checks a job runs:
    preflight, then planning the job against its model), or '' if nothing."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    import titan_ext  # noqa: F401  (train specs)
    from titan_ext.errors import ConfigError
    from titan_ext.host import preflight

    job_config = ConfigManager().parse_args(argv)
    try:
        preflight.check_job_config(job_config, world_size=world)
        model_args = get_train_spec(job_config.model.name).model_args[job_config.model.flavor]
        type(model_args).update_from_config.__wrapped__(model_args, job_config)  # without the SystemExit boundary
    except ConfigError as error:
        return str(error)
    return ""


def assert_documents_restart(model, length: int, starts: list[int], mixed_from: int) -> None:
    """With document masking applied as a job applies it (per-document attention where the forward plan says
    so; fla's blocks take ``cu_seqlens``), each packed document's logits equal the document's alone; without the
    boundaries the documents from ``mixed_from`` on mix (so the check can fail)."""
    from titan_ext.data.documents import apply_document_attention

    if plan_forward(model, document_mask=True).document_attention:
        apply_document_attention(model)
    tokens = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(1))
    spans = list(zip(starts, starts[1:] + [length]))
    positions = torch.arange(length).expand(2, length).clone()
    for first, last in spans:
        positions[:, first:last] -= first
    packed = model(tokens, document_positions=positions)
    alone = torch.cat([model(tokens[:, first:last]) for first, last in spans], dim=1)
    assert torch.allclose(packed, alone, atol=1e-5)
    assert not torch.allclose(model(tokens)[:, mixed_from:], alone[:, mixed_from:], atol=1e-3)


def plan_forward(model, *, cp=None, cp_mesh=None, loss=None, document_mask: bool = False):
    """``model``'s forward decided as ``parallelize_fn`` decides it for a job with these choices (no TP), and set
    on it: for a test that applies a feature alone. Returns the ``ForwardPlan``."""
    from types import SimpleNamespace

    from titan_ext.models.forward_plan import decide_forward

    plan = SimpleNamespace(tp=None, cp=cp, loss=loss, document_mask=document_mask)
    model.forward_plan = decide_forward(model, plan, cp_mesh=cp_mesh)
    return model.forward_plan
