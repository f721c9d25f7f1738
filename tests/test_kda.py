"""fla's Kimi Delta Attention on titan_ext's portable kernel: the chunked KDA rule against fla's naive
recurrent reference (values and gradients), each in-kernel option, packed sequences, and a whole model on CPU."""

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
from fla.ops.kda.naive import naive_recurrent_kda
from helpers import assert_rel_close, backward_with_random_cotangents, leaves

from titan_ext import kernels
from titan_ext.kernels.kda import CHUNK, chunk_kda, fused_recurrent_kda


def kda_inputs(B=2, T=45, H=3, HV=3, K=8, V=6, seed=0, dtype=torch.float32):
    """T spans partial chunks; keys unit-norm, beta in (0, 1) and a log decay per value head and key channel."""
    g = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, HV, V, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    gate = F.logsigmoid(2 * torch.randn(B, T, HV, K, generator=g, dtype=dtype))
    beta = torch.rand(B, T, HV, generator=g, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, generator=g, dtype=dtype)
    return q, k, v, gate, beta, h0


@pytest.mark.parametrize("with_h0", [True, False])
def test_chunked_matches_fla_naive_recurrent_values_and_gradients(with_h0):
    q, k, v, g, beta, h0 = kda_inputs()
    h0 = h0 if with_h0 else None
    ours, ref = leaves(q, k, v, g, beta, h0), leaves(q, k, v, g, beta, h0)
    o, ht = chunk_kda(*ours[:5], initial_state=ours[5], output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(*ref[:5], initial_state=ref[5], output_final_state=True)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")
    backward_with_random_cotangents([o, ht])
    backward_with_random_cotangents([o_ref, ht_ref])
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ours, ref):
        if a is not None:
            assert_rel_close(a.grad, b.grad, tol=1e-4, what=name)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_in_kernel_options_of_kimi_delta_attention(lower_bound):
    """What KimiDeltaAttention asks the kernel to fuse, against the same steps written out before fla's
    reference: L2-normalised q/k (fla's eps 1e-6), the KDA gate (fla's naive gates: softplus, or the
    bounded sigmoid form with lower_bound), 2 * sigmoid(beta), grouped value heads and a V-first state."""
    q, k, v, raw_g, raw_beta, h0 = kda_inputs(H=2, HV=4)
    A_log, dt_bias = torch.randn(4), torch.randn(4 * 8)
    o, ht = chunk_kda(
        q, k, v, raw_g, raw_beta, initial_state=h0.transpose(-1, -2), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        safe_gate=lower_bound is not None, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
    )

    def l2(x):
        return x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()

    if lower_bound is None:
        gate = naive_kda_gate(raw_g, A_log, dt_bias)
    else:
        gate = naive_kda_lowerbound_gate(raw_g, A_log, dt_bias, lower_bound=lower_bound)
    o_ref, ht_ref = naive_recurrent_kda(
        l2(q), l2(k), v, gate, 2 * raw_beta.sigmoid(), initial_state=h0, output_final_state=True
    )
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht.transpose(-1, -2), ht_ref, what="final state (V-first)")


def test_strong_gates_stay_finite():
    """Decays are taken pairwise inside a chunk (never as a ratio of cumulative products): a log decay of
    -60 per step (exp(-60 * 16) underflows fp32) gives the reference's values, not inf or nan."""
    q, k, v, g, beta, h0 = kda_inputs(T=40)
    g = torch.where(torch.rand(g.shape, generator=torch.Generator().manual_seed(2)) < 0.5, g, torch.full_like(g, -60.0))
    g = g.requires_grad_()
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g.detach(), beta, initial_state=h0, output_final_state=True)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")
    o.sum().backward()
    assert g.grad.isfinite().all()


def test_packed_sequences_run_from_their_own_states():
    """cu_seqlens (batch 1): each sequence as if alone, from its own initial state (none leaks across)."""
    q, k, v, g, beta, h0 = kda_inputs(B=3, T=40)
    lengths = (40, 5, 16)
    o_each, ht_each = zip(*(
        chunk_kda(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], g[i:i + 1, :n], beta[i:i + 1, :n],
                  initial_state=h0[i:i + 1], output_final_state=True)
        for i, n in enumerate(lengths)
    ))  # fmt: skip
    packed = [torch.cat([x[i:i + 1, :n] for i, n in enumerate(lengths)], dim=1) for x in (q, k, v, g, beta)]
    o, ht = chunk_kda(*packed, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor([0, 40, 45, 61]))
    assert_rel_close(o, torch.cat(o_each, dim=1), what="o")
    assert_rel_close(ht, torch.cat(ht_each, dim=0), what="final states")
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 40]))


def test_packed_training_pass_equals_each_sequence_alone_in_fp64():
    """Training's packed path (no initial or final states) runs every sequence in one pass, masking across
    sequences: documents that start, end or fit exactly at chunk borders, 1-token documents, grouped values."""
    lengths = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2, 2 * CHUNK + 2, 1, 7]
    T, H, HV, K, V = sum(lengths), 2, 4, 8, 6
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
              for shape in ((1, T, H, K), (1, T, H, K), (1, T, HV, V), (1, T, HV, K), (1, T, HV), (HV,), (HV * K,))]
    q, k, v, gate, beta, A_log, dt_bias = inputs
    options = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                   use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packed, _ = chunk_kda(q, k, v, gate, beta, cu_seqlens=torch.tensor(bounds), **options)
    alone = torch.cat([chunk_kda(*(x[:, a:b] for x in (q, k, v, gate, beta)), **options)[0]
                       for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-13)
    cotangent = torch.randn(packed.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad((packed * cotangent).sum(), inputs),
                    torch.autograd.grad((alone * cotangent).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_decoding_entry_point_takes_fla_argument_order():
    q, k, v, g, beta, h0 = kda_inputs(T=5)
    A_log, dt_bias = torch.randn(3), torch.randn(3 * 8)
    o, ht = fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, None, h0, True, use_gate_in_kernel=True)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, naive_kda_gate(g, A_log, dt_bias), beta, initial_state=h0,
                                        output_final_state=True)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")


def tiny_kda(**kw):
    from fla.models import KDAConfig, KDAForCausalLM

    torch.manual_seed(0)
    return KDAForCausalLM(KDAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, vocab_size=100, **kw))


def test_kda_model_trains_and_decodes_on_cpu():
    model = tiny_kda()
    assert set(kernels.unported(model)) == {"fla.ops.kda.chunk.chunk_kda", "fla.ops.kda.fused_recurrent.fused_recurrent_kda"}
    model = kernels.portable(model)
    assert kernels.unported(model) == {}
    x = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))  # > CHUNK: several chunks
    out = model(input_ids=x, labels=x)  # fla's fused loss, on the portable path (it returns no logits in training)
    expected = F.cross_entropy(model(input_ids=x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert_rel_close(out.loss, expected, what="loss")
    out.loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():  # decoding from the cache (conv and recurrent states) = the full forward
        full = model(input_ids=x[:, :20]).logits
        prefix = model(input_ids=x[:, :12], use_cache=True)
        rest = model(input_ids=x[:, 12:20], past_key_values=prefix.past_key_values, use_cache=True).logits
    assert_rel_close(rest, full[:, 12:20], what="cached decoding")


def test_packed_documents_through_the_model_equal_each_document_alone():
    """fla's varlen interface (batch 1 + cu_seqlens) on the portable path: no state or convolution leaks
    from one document into the next (what document masking hands fla models)."""
    model = kernels.portable(tiny_kda())
    lengths = (30, 9, 21)
    docs = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = model(input_ids=torch.cat(docs, dim=1), cu_seqlens=torch.tensor([0, 30, 39, 60])).logits
    alone = torch.cat([model(input_ids=d).logits for d in docs], dim=1)
    assert_rel_close(packed, alone, what="packed logits")


def test_fla_kda_spec_flavors_and_flops():
    """The shipped spec's flavors (also as ``--model.name fla --model.flavor kda-<flavor>``), and the FLOPs
    per token MFU counts for every KDA layer: fla's chunk of 64, grouped values counted per value head."""
    from fla.models import KDAConfig

    from titan_ext.models.mixers.kda import KDA, kda_flops
    from titan_ext.train_specs import FLAVORS

    assert set(FLAVORS["fla_kda"]) == {"debugmodel", "340M", "1.3B"}
    assert "kda-340M" in FLAVORS["fla"]
    assert kda_flops(1, 16, 32) == 3 * (4 * 64 * 16 + 2 * 64 * (16 + 32) + 2 * 64 * 32 + 6 * 16 * 32 + 4 * 16)
    config = KDAConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=16, num_v_heads=8, expand_v=2.0)
    assert KDA().flops_per_token(config, 0, 80) == kda_flops(8, 16, 32)
