"""The state exchange alone: a sequence split into pieces across simulated ranks equals one pass (fp64),
for GLA's diagonal decay (and simple GLA's one per head: Mamba-2's scan), the gated delta rule's full-matrix one (a per-head decay, and KDA's per key channel), with and without packed documents,
and the short convolutions' halos.

Each simulated rank runs the real wrapper; the all-gather is stubbed in two passes: the first records
every rank's summary, the second hands each rank all of them (graph-connected), so gradients reach
every piece through the exchange as they do through the real collective's backward.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_rel_close, gla_inputs

from titan_ext.models.packing import cu_seqlens, packed_cu_seqlens
from titan_ext.kernels import gla as portable
from titan_ext.kernels import state_passing
from titan_ext.kernels.conv import causal_conv1d
from titan_ext.kernels.gated_delta import chunk_gated_delta_rule
from titan_ext.kernels.kda import chunk_kda
from titan_ext.kernels.simple_gla import chunk_simple_gla

LAYOUTS = [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)]
"""(ranks, pieces per rank): contiguous pieces, and torchtitan's head-tail order."""

DOC_STARTS = [0, 7, 24, 25, 46, 60, 62, 72, 95]
"""Document starts in a row of 96 tokens: across piece borders, one at a piece start (24), a 1-token document,
and within a convolution's halo of a piece's end (46 for pieces of 24 and 48, 62 for pieces of 32): the next
piece's halo then holds tokens of two documents."""


def split(world, pieces_per_rank, T):
    """Each rank's global token indices, its pieces back to back."""
    size = T // (world * pieces_per_rank)
    return {r: torch.cat([torch.arange(p * size, (p + 1) * size)
                          for p in state_passing.piece_order(r, world, pieces_per_rank)]) for r in range(world)}


def on_simulated_ranks(monkeypatch, world, pieces_per_rank, T, run, document_positions=None):
    """``run(layout, mine)`` on every simulated rank (``mine``: its global indices); the outputs put
    back in sequence order along dim 1 (``[B, T, ...]``)."""
    held = split(world, pieces_per_rank, T)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
    recorded, replay = [], []

    def gather(summary, group):
        if replay:  # second pass: every rank's summary from the first
            return torch.stack(replay)
        recorded.append(summary)
        return summary.new_zeros(world, *summary.shape)

    monkeypatch.setattr(state_passing, "gather_pieces", gather)

    def each_rank():
        outputs = []
        for r in range(world):
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=r: r)
            layout = state_passing.PieceLayout(None, pieces_per_rank)
            layout.record(held[r].expand(2, -1), document_positions)  # B = 2
            outputs.append(run(layout, held[r]))
        return outputs

    each_rank()
    assert len(recorded) == world, "one all-gather per rank"
    replay.extend(recorded)
    outputs = each_rank()
    whole = torch.empty(outputs[0].shape[0], T, *outputs[0].shape[2:], dtype=outputs[0].dtype)
    for r, o in enumerate(outputs):
        whole[:, held[r]] = o
    return whole


def packed(x, mine, layout):
    """The local rows as the model's forward hands them to a mixer under document masking: one row."""
    return x[:, mine].reshape(1, -1, *x.shape[2:])


def document_positions(B, T):
    """``[B, T]``: row 0 with ``DOC_STARTS``, the other rows with every start 7 tokens earlier (and one at 0)."""
    shifted = sorted({0, *[s - 7 for s in DOC_STARTS if s >= 7]})
    rows = []
    for b in range(B):
        starts = DOC_STARTS if b == 0 else shifted
        row = torch.zeros(T, dtype=torch.long)
        for start, end in zip(starts, starts[1:] + [T]):
            row[start:end] = torch.arange(end - start)
        rows.append(row)
    return torch.stack(rows)


def gla_case(B, T, with_h0):
    q, k, v, g, h0 = gla_inputs(B, T, 2, 8, 16, dtype=torch.float64, with_h0=with_h0)
    return [x.clone().requires_grad_() for x in (q, k, v, g)], None if h0 is None else h0.double().requires_grad_()


def delta_case(B, T, with_h0):
    """Gated DeltaNet's call: grouped value heads, q/k L2-normalised in the kernel, a V-first state."""
    gen = torch.Generator().manual_seed(3)
    H, HV, K, V = 2, 4, 8, 6
    q, k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(2 * torch.randn(B, T, HV, generator=gen, dtype=torch.float64))
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, HV, V, K, generator=gen, dtype=torch.float64).requires_grad_() if with_h0 else None
    return [x.clone().requires_grad_() for x in (q, k, v, g, beta)], h0


KDA_GATE = {"A_log": torch.log(torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)),
            "dt_bias": torch.linspace(-2, 1, 4 * 8, dtype=torch.float64)}


def kda_case(B, T, with_h0):
    """KDA's call: a raw gate per value head and key channel, the rest as Gated DeltaNet's."""
    (q, k, v, _, beta), h0 = delta_case(B, T, with_h0)
    g = torch.randn(B, T, 4, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return [q, k, v, g.requires_grad_(), beta], h0


def simple_gla_case(B, T, with_h0):
    """Mamba-2's scan as transformers' Mamba2 mixers call it (``kernels.transformers_mamba2``): one log decay per
    head and token, scale 1."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, T, 2, n, generator=gen, dtype=torch.float64) for n in (8, 8, 6))
    g = -F.softplus(torch.randn(B, T, 2, generator=gen, dtype=torch.float64))
    h0 = torch.randn(B, 2, 8, 6, generator=gen, dtype=torch.float64).requires_grad_() if with_h0 else None
    return [x.clone().requires_grad_() for x in (q, k, v, g)], h0


def simple_gla_call(kernel, xs, h0, cu_seqlens=None):
    q, k, v, g = xs
    return kernel(q=q, k=k, v=v, g=g, scale=1.0, initial_state=h0, cu_seqlens=cu_seqlens)[0]


def gla_call(kernel, xs, h0, cu_seqlens=None):
    q, k, v, g = xs
    return kernel(q=q, k=k, v=v, g=g, initial_state=h0, cu_seqlens=cu_seqlens, state_v_first=False)[0]


def delta_call(kernel, xs, h0, cu_seqlens=None):
    q, k, v, g, beta = xs
    return kernel(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu_seqlens, state_v_first=True,
                  use_qk_l2norm_in_kernel=True)[0]


def kda_call(kernel, xs, h0, cu_seqlens=None):
    q, k, v, g, beta = xs
    return kernel(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu_seqlens, state_v_first=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, **KDA_GATE)[0]


CASES = {
    "gla": (gla_case, gla_call, portable.chunk_gla, state_passing.DiagonalDecay("g")),
    "delta": (delta_case, delta_call, chunk_gated_delta_rule, state_passing.AffineState()),
    "kda": (kda_case, kda_call, chunk_kda, state_passing.AffineState()),
    "simple_gla": (simple_gla_case, simple_gla_call, chunk_simple_gla, state_passing.DiagonalDecay("g")),
}


def cases(layouts, few=((2, 1), (3, 2))):
    """(recurrence, ranks, pieces per rank): every layout for GLA and the gated delta rule; KDA and simple GLA
    (the same paths, other kernels) on one contiguous and one head-tail layout."""
    return [(r, *layout) for r in CASES for layout in layouts if r not in ("kda", "simple_gla") or layout in few]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("recurrence,world,pieces_per_rank", cases(LAYOUTS))
def test_pieces_with_exchanged_states_equal_one_pass(monkeypatch, recurrence, world, pieces_per_rank, with_h0):
    make, call, kernel, kind = CASES[recurrence]
    B, T = 2, 24 * world * pieces_per_rank  # pieces of 24: partial chunks of fla's 16 and of 64
    xs, h0 = make(B, T, with_h0)
    leaves = xs + ([h0] if with_h0 else [])
    cotangent = torch.randn(*xs[2].shape[:3], xs[2].shape[3], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref = call(kernel, xs, h0)
    ref_grads = torch.autograd.grad(ref, leaves, cotangent)

    def run(layout, mine):
        split_kernel = state_passing.across_ranks(kernel, kind, layout)
        return call(split_kernel, [x[:, mine] for x in xs], h0)

    whole = on_simulated_ranks(monkeypatch, world, pieces_per_rank, T, run)
    assert_rel_close(whole, ref, tol=1e-10, what="output")
    for got, want, name in zip(torch.autograd.grad(whole, leaves, cotangent), ref_grads, "qkvgbh"):
        assert_rel_close(got, want, tol=1e-10, what=f"d{name}")


@pytest.mark.parametrize("recurrence,world,pieces_per_rank", cases([(2, 1), (4, 1), (2, 2), (3, 2)]))
def test_packed_documents_restart_across_ranks(monkeypatch, recurrence, world, pieces_per_rank):
    """Documents packed in rows and split across ranks equal the same documents run one pass each:
    a piece that starts a document reads no state, one that holds a start hands on only its last document's."""
    make, call, kernel, kind = CASES[recurrence]
    B, T = 2, 96
    xs, _ = make(B, T, False)
    doc_positions = document_positions(B, T)
    cotangent = torch.randn(*xs[2].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    ref = call(kernel, [x.reshape(1, B * T, *x.shape[2:]) for x in xs], None, cu_seqlens(doc_positions))
    ref = ref.view(xs[2].shape)
    ref_grads = torch.autograd.grad(ref, xs, cotangent)

    def run(layout, mine):
        split_kernel = state_passing.across_ranks(kernel, kind, layout)
        o = call(split_kernel, [packed(x, mine, layout) for x in xs], None, packed_cu_seqlens(layout))
        return o.view(B, len(mine), *o.shape[2:])

    whole = on_simulated_ranks(monkeypatch, world, pieces_per_rank, T, run, doc_positions)
    assert_rel_close(whole, ref, tol=1e-10, what="output")
    for got, want, name in zip(torch.autograd.grad(whole, xs, cotangent), ref_grads, "qkvgb"):
        assert_rel_close(got, want, tol=1e-10, what=f"d{name}")


def test_piece_order():
    assert [state_passing.piece_order(r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert [state_passing.piece_order(r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("with_documents", [False, True])
@pytest.mark.parametrize("world,pieces_per_rank", [(2, 1), (3, 1), (2, 2)])
def test_convolution_pieces_with_halos_equal_one_pass(monkeypatch, world, pieces_per_rank, with_documents):
    B, D, W = 2, 6, 4
    T = 96 if with_documents else 5 * world * pieces_per_rank  # pieces longer than the halo (W - 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(D, W, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(D, dtype=torch.float64, generator=g)
    residual = torch.randn(B, T, D, dtype=torch.float64, generator=g)
    cotangent = torch.randn(B, T, D, dtype=torch.float64, generator=g)
    doc_positions = document_positions(B, T) if with_documents else None
    if with_documents:
        ref, _ = causal_conv1d(x=x.reshape(1, B * T, D), weight=weight, bias=bias, residual=residual.reshape(1, B * T, D),
                               activation="silu", cu_seqlens=cu_seqlens(doc_positions))
        ref = ref.view(B, T, D)
    else:
        ref, _ = causal_conv1d(x=x, weight=weight, bias=bias, residual=residual, activation="silu")
    ref_grads = torch.autograd.grad(ref, (x, weight), cotangent)

    def run(layout, mine):
        conv = state_passing.conv_across_ranks(causal_conv1d, layout)
        if not with_documents:
            return conv(x=x[:, mine], weight=weight, bias=bias, residual=residual[:, mine], activation="silu")[0]
        y, _ = conv(x=packed(x, mine, layout), weight=weight, bias=bias, residual=packed(residual, mine, layout),
                    activation="silu", cu_seqlens=packed_cu_seqlens(layout))
        return y.view(B, len(mine), D)

    whole = on_simulated_ranks(monkeypatch, world, pieces_per_rank, T, run, doc_positions)
    assert_rel_close(whole, ref, tol=1e-12, what="output")
    for got, want, name in zip(torch.autograd.grad(whole, (x, weight), cotangent), ref_grads, ("dx", "dweight")):
        assert_rel_close(got, want, tol=1e-12, what=name)
