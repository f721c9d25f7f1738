"""The GLA state exchange alone: a sequence split into pieces across simulated ranks equals one pass (fp64)."""

import pytest
import torch
from helpers import assert_rel_close, gla_inputs

from titan_ext.kernels import gla as portable
from titan_ext.kernels import state_passing


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("world,pieces_per_rank", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)])
def test_pieces_with_exchanged_states_equal_one_pass(monkeypatch, world, pieces_per_rank, with_h0):
    B, H, K, V = 2, 2, 8, 16
    chunks = world * pieces_per_rank
    T = 24 * chunks  # pieces of 24: a partial last chunk of fla's 16
    q, k, v, g, h0 = gla_inputs(B, T, H, K, V, dtype=torch.float64, with_h0=with_h0)
    h0 = None if h0 is None else h0.double()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)] + ([h0.clone().requires_grad_()] if with_h0 else [])
    cotangent = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    # one pass over the whole sequence
    o_ref, _ = portable.chunk_gla(*leaves[:4], initial_state=leaves[4] if with_h0 else None)
    ref_grads = torch.autograd.grad(o_ref, leaves, cotangent)

    # each simulated rank holds its pieces back to back (head-tail order with two per rank)
    size = T // chunks
    held = {r: [slice(p * size, (p + 1) * size) for p in state_passing.piece_order(r, world, pieces_per_rank)]
            for r in range(world)}
    local = {r: [torch.cat([x[:, s] for s in held[r]], dim=1) for x in leaves[:4]] for r in range(world)}
    every = torch.stack([state_passing.piece_summaries(k_, v_, g_, pieces_per_rank) for _, k_, v_, g_ in local.values()])
    out = torch.empty(B, T, H, V, dtype=torch.float64)
    outputs = []
    for r in range(world):  # the all-gather is every rank's summaries; its backward sums over ranks
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=r: r)
        monkeypatch.setattr(state_passing, "gather_pieces", lambda summary, group: every)
        kernel = state_passing.across_ranks(portable.chunk_gla, "g", group=None, pieces_per_rank=pieces_per_rank)
        lq, lk, lv, lg = local[r]
        o, _ = kernel(lq, lk, lv, g=lg, initial_state=leaves[4] if with_h0 else None, state_v_first=r % 2 == 1)
        outputs.append(o)
    out = torch.cat([o[:, i * size:(i + 1) * size] for r, o in enumerate(outputs) for i in range(pieces_per_rank)], 1)
    order = [p for r in range(world) for p in state_passing.piece_order(r, world, pieces_per_rank)]
    whole = torch.empty_like(out)
    for slot, p in enumerate(order):
        whole[:, p * size:(p + 1) * size] = out[:, slot * size:(slot + 1) * size]
    assert_rel_close(whole, o_ref, tol=1e-10, what="output")
    for got, want, name in zip(torch.autograd.grad(whole, leaves, cotangent), ref_grads, "qkvgh"):
        assert_rel_close(got, want, tol=1e-10, what=f"d{name}")


def test_piece_order():
    assert [state_passing.piece_order(r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [state_passing.piece_order(r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("world,pieces_per_rank", [(2, 1), (3, 1), (2, 2)])
def test_convolution_pieces_with_halos_equal_one_pass(monkeypatch, world, pieces_per_rank):
    from titan_ext.kernels.conv import causal_conv1d

    B, D, W = 2, 6, 4
    chunks = world * pieces_per_rank
    T = 5 * chunks  # pieces longer than the halo (W - 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(D, W, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(D, dtype=torch.float64, generator=g)
    cotangent = torch.randn(B, T, D, dtype=torch.float64, generator=g)
    ref, _ = causal_conv1d(x=x, weight=weight, bias=bias, activation="silu")
    ref_grads = torch.autograd.grad(ref, (x, weight), cotangent)

    size = T // chunks
    order = {r: state_passing.piece_order(r, world, pieces_per_rank) for r in range(world)}
    local = {r: torch.cat([x[:, p * size:(p + 1) * size] for p in order[r]], dim=1) for r in range(world)}
    tails = torch.stack([torch.stack([local[r][:, (i + 1) * size - (W - 1):(i + 1) * size]
                                      for i in range(pieces_per_rank)]) for r in range(world)])
    whole = torch.empty_like(ref)
    for r in range(world):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=r: r)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(state_passing, "gather_pieces", lambda summary, group: tails)
        conv = state_passing.conv_across_ranks(causal_conv1d, group=None, pieces_per_rank=pieces_per_rank)
        y, _ = conv(x=local[r], weight=weight, bias=bias, activation="silu")
        for i, p in enumerate(order[r]):
            whole[:, p * size:(p + 1) * size] = y[:, i * size:(i + 1) * size]
    assert_rel_close(whole, ref, tol=1e-12, what="output")
    for got, want, name in zip(torch.autograd.grad(whole, (x, weight), cotangent), ref_grads, ("dx", "dweight")):
        assert_rel_close(got, want, tol=1e-12, what=name)
