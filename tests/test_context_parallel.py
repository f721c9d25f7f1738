"""Context parallelism: two real gloo ranks against one process, and (over a fake 2-rank group, whose
collectives do nothing) what one rank sends and keeps. Training over 5 steps is the integration
matrix's (``cp2*`` rows); the state exchange alone is ``test_state_passing.py``'s."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from titan_ext import compat
from titan_ext.context_parallel import CPChoice, apply_cp
from titan_ext.kernels.state_passing import piece_order
from titan_ext.models.adapter import build_model
from titan_ext.models.gla import gla_flavors


@pytest.fixture
def cp_mesh():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


def gla(layers=2, short_conv=False):
    args = copy.deepcopy(gla_flavors["debugmodel"])
    args.config["num_hidden_layers"] = layers
    args.config["use_short_conv"] = short_conv
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("pieces_per_rank", [1, 2])
def test_each_gla_layer_sends_one_all_gather_of_its_states(cp_mesh, pieces_per_rank, monkeypatch):
    model = gla(layers=3)
    apply_cp(model, cp_mesh, CPChoice(2, pieces_per_rank))
    B, T = 2, 128
    tokens = torch.randint(0, 2048, (B, T))
    sent = []
    gather = compat.all_gather_autograd
    monkeypatch.setattr(compat, "all_gather_autograd", lambda t, group: sent.append(t.nbytes) or gather(t, group))
    with CommDebugMode() as comm:
        logits = model(tokens)
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d_functional.all_gather_into_tensor": 3}, counts  # one per layer, nothing else
    H, K, V = 4, 32 // 4, 64 // 4  # debug GLA: 4 heads, key dim 32, value dim 64
    assert sent == [pieces_per_rank * B * H * K * (V + 1) * 4] * 3  # fp32 states and decays of this rank's pieces
    print(f"\nCP=2, {pieces_per_rank} piece(s) per rank, batch {B}: each layer all-gathers {sent[0]} bytes per rank")
    with CommDebugMode() as comm:
        logits.float().sum().backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d_functional.reduce_scatter_tensor": 3}, counts  # the all-gathers' backward


def saved_bytes(model, tokens) -> int:
    """Bytes autograd keeps for backward during one forward: the activation memory of a step."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).float().sum()
    return total


def test_activation_memory_per_rank_halves_under_cp2(cp_mesh):
    T = 16384
    tokens = torch.randint(0, 2048, (1, T))
    whole = saved_bytes(gla(), tokens)
    model = gla()
    apply_cp(model, cp_mesh, CPChoice(2, 1))
    piece = saved_bytes(model, tokens[:, : T // 2])  # what one CP rank holds
    ratio = piece / whole
    print(f"\nGLA debug model, {T} tokens: activations saved per rank {piece / 2**20:.1f} MiB under CP=2 "
          f"vs {whole / 2**20:.1f} MiB at CP=1 (ratio {ratio:.3f})")
    assert 0.45 < ratio < 0.6  # half, plus the exchanged states


def test_short_convolutions_take_their_halo_in_one_all_gather_each(cp_mesh):
    model = gla(layers=2, short_conv=True)
    apply_cp(model, cp_mesh, CPChoice(2, 1))
    with CommDebugMode() as comm:
        model(torch.randint(0, 2048, (2, 128)))
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    # per layer: the GLA state, and the last 3 inputs of each of the q, k and v convolutions
    assert counts == {"c10d_functional.all_gather_into_tensor": 2 * (1 + 3)}, counts


CASES = [("fla_gla", 1, 1e-5), ("fla_gla", 2, 1e-5), ("hf_llama", 1, 1e-12), ("hf_llama", 2, 1e-12),
         ("fla_transformer", 1, 1e-12), ("fla_transformer", 2, 1e-12), ("fla_transformer+window", 2, 1e-12)]
"""(spec, pieces per rank, tolerance): GLA with short convolutions in fp32 (fla takes fp32 states);
Llama and the fla transformer (all-gathered keys and values; also with a sliding window) in fp64."""


def _two_ranks(rank, port, results):
    """One of two gloo ranks: each case's model under CP=2 on this rank's pieces vs one process on the whole batch."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    try:
        for spec, pieces_per_rank, _ in CASES:
            torch.set_default_dtype(torch.float32 if spec == "fla_gla" else torch.float64)
            results[rank, spec, pieces_per_rank] = _compare(spec, pieces_per_rank, rank, mesh)
    finally:
        dist.destroy_process_group()


def _compare(spec, pieces_per_rank, rank, mesh):
    if spec == "hf_llama":
        from titan_ext.models.llama import llama_flavors

        args = copy.deepcopy(llama_flavors["debugmodel"])
    elif spec.startswith("fla_transformer"):
        from titan_ext.models.transformer import transformer_flavors

        args = copy.deepcopy(transformer_flavors["debugmodel"])
        args.config["window_size"] = 24 if spec.endswith("window") else None  # reaches across pieces of 40
    else:
        args = copy.deepcopy(gla_flavors["debugmodel"])
        args.config["use_short_conv"] = True
    torch.manual_seed(0)
    whole = build_model(args)
    whole.init_weights()
    model = copy.deepcopy(whole)
    apply_cp(model, mesh, CPChoice(2, pieces_per_rank))
    tokens = torch.randint(0, 2048, (2, 160), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(160).expand(2, 160)
    size = 160 // (2 * pieces_per_rank)
    mine = torch.cat([torch.arange(p * size, (p + 1) * size) for p in piece_order(rank, 2, pieces_per_rank)])
    whole(tokens).sum().backward()
    out = model(tokens[:, mine], positions=positions[:, mine])
    out.sum().backward()
    worst = 0.0
    for p, q in zip(model.parameters(), whole.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # FSDP's sum over the CP ranks
        worst = max(worst, ((grad - q.grad).norm() / q.grad.norm()).item())
    with torch.no_grad():
        forward = ((out - whole(tokens)[:, mine]).norm() / out.norm()).item()
    return forward, worst


def test_two_ranks_equal_one_process():
    """Logits and summed gradients of CP=2 on real gloo ranks equal one process over the whole sequence,
    for contiguous and head-tail pieces."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(port, results), nprocs=2)
    for spec, pieces_per_rank, tol in CASES:
        for rank in (0, 1):
            forward, grads = results[rank, spec, pieces_per_rank]
            assert forward <= tol and grads <= tol, (spec, pieces_per_rank, rank, forward, grads)
