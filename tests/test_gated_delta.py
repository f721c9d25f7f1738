"""fla's Gated DeltaNet on titan_ext's portable kernels: the chunked delta rule against fla's naive
recurrent reference (values and gradients), each in-kernel option, and a whole model on CPU."""

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from helpers import assert_rel_close, backward_with_random_cotangents, leaves

from titan_ext import kernels
from titan_ext.kernels.gated_delta import chunk_gated_delta_rule


def delta_inputs(B=2, T=150, H=3, HV=3, K=16, V=8, seed=0):
    """T spans a partial chunk; keys unit-norm and beta in (0, 1), as GatedDeltaNet feeds the kernel."""
    g = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, HV, V, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    gate = F.logsigmoid(2 * torch.randn(B, T, HV, generator=g))
    beta = torch.rand(B, T, HV, generator=g)
    h0 = torch.randn(B, HV, K, V, generator=g)
    return q, k, v, gate, beta, h0


@pytest.mark.parametrize("with_h0", [True, False])
def test_chunked_matches_fla_naive_recurrent_values_and_gradients(with_h0):
    q, k, v, g, beta, h0 = delta_inputs()
    h0 = h0 if with_h0 else None
    ours = leaves(q, k, v, g, beta, h0)
    ref = leaves(q, k, v, g, beta, h0)
    o, ht = chunk_gated_delta_rule(*ours[:5], initial_state=ours[5], output_final_state=True)
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(
        ref[0], ref[1], ref[2], ref[4], ref[3], initial_state=ref[5], output_final_state=True  # (beta, g) order
    )
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")
    backward_with_random_cotangents([o, ht])
    backward_with_random_cotangents([o_ref, ht_ref])
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], ours, ref):
        if a is not None:
            assert_rel_close(a.grad, b.grad, tol=1e-4, what=name)


def test_in_kernel_options_of_gated_deltanet():
    """What GatedDeltaNet asks the kernel to fuse, against the same steps written out before fla's reference:
    L2-normalised q/k (fla's eps 1e-6), the GDN gate (fla's naive_gdn_gate), 2 * sigmoid(beta), grouped
    value heads (value head i reads q/k head i // (HV // H), as fla's kernels index them) and a V-first state."""
    q, k, v, raw_g, raw_beta, h0 = delta_inputs(H=2, HV=4)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    o, ht = chunk_gated_delta_rule(
        q, k, v, raw_g, raw_beta, initial_state=h0.transpose(-1, -2), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
    )

    def l2(x):
        return x / (x.square().sum(-1, keepdim=True) + 1e-6).sqrt()

    qr, kr = (l2(x).repeat_interleave(2, dim=2) for x in (q, k))
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(
        qr, kr, v, 2 * raw_beta.sigmoid(), naive_gdn_gate(raw_g, A_log, dt_bias), initial_state=h0, output_final_state=True
    )
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht.transpose(-1, -2), ht_ref, what="final state (V-first)")


def test_packed_sequences_run_from_their_own_states():
    """cu_seqlens (batch 1): each sequence as if alone, from its own initial state (none leaks across)."""
    q, k, v, g, beta, h0 = delta_inputs(B=3, T=70)
    o_each, ht_each = zip(*(
        chunk_gated_delta_rule(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n], g[i:i + 1, :n], beta[i:i + 1, :n],
                               initial_state=h0[i:i + 1], output_final_state=True)
        for i, n in enumerate((70, 5, 64))
    ))  # fmt: skip
    packed = [torch.cat([x[i:i + 1, :n] for i, n in enumerate((70, 5, 64))], dim=1) for x in (q, k, v, g, beta)]
    o, ht = chunk_gated_delta_rule(*packed, initial_state=h0, output_final_state=True,
                                   cu_seqlens=torch.tensor([0, 70, 75, 139]))  # fmt: skip
    assert_rel_close(o, torch.cat(o_each, dim=1), what="o")
    assert_rel_close(ht, torch.cat(ht_each, dim=0), what="final states")
    with pytest.raises(ValueError, match="batch size must be 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 70]))


def tiny_gated_deltanet():
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    torch.manual_seed(0)
    config = GatedDeltaNetConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, vocab_size=100)
    return GatedDeltaNetForCausalLM(config)


def test_gated_deltanet_model_trains_and_decodes_on_cpu():
    model = kernels.portable(tiny_gated_deltanet())
    x = torch.randint(0, 100, (2, 80), generator=torch.Generator().manual_seed(0))  # > 64: the chunk path
    out = model(input_ids=x, labels=x)  # fla's fused loss, on the portable path
    expected = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    assert_rel_close(out.loss, expected, what="loss")
    out.loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():  # decoding from the cache (conv and recurrent states) = the full forward
        full = model(input_ids=x[:, :20]).logits
        prefix = model(input_ids=x[:, :12], use_cache=True)
        rest = model(input_ids=x[:, 12:20], past_key_values=prefix.past_key_values, use_cache=True).logits
    assert_rel_close(rest, full[:, 12:20], what="cached decoding")


def test_decoding_entry_point_takes_fla_argument_order():
    from titan_ext.kernels.gated_delta import fused_recurrent_gated_delta_rule

    q, k, v, g, beta, h0 = delta_inputs(T=5)
    o, ht = fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, None, h0, True)  # q, k, v, g, gk, gv, beta, ...
    o_ref, ht_ref = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    assert_rel_close(o, o_ref, what="o")
    assert_rel_close(ht, ht_ref, what="final state")


def test_packed_documents_through_the_model_equal_each_document_alone():
    """fla's varlen interface (batch 1 + cu_seqlens) on the portable path: no state or convolution leaks
    from one document into the next (what document masking will hand fla models)."""
    model = kernels.portable(tiny_gated_deltanet())
    lengths = (70, 9, 41)
    docs = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    cu_seqlens = torch.tensor([0, 70, 79, 120])
    packed = model(input_ids=torch.cat(docs, dim=1), cu_seqlens=cu_seqlens).logits
    alone = torch.cat([model(input_ids=d).logits for d in docs], dim=1)
    assert_rel_close(packed, alone, what="packed logits")


def test_packed_training_pass_equals_each_sequence_alone_in_fp64():
    """Training's packed path (no initial or final states) runs every sequence in one pass, masking across
    sequences: documents that start, end or fit exactly at chunk borders, 1-token documents, grouped values."""
    lengths = [1, 63, 64, 65, 2, 130, 1, 7]
    T, H, HV, K, V = sum(lengths), 2, 4, 16, 8
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
              for shape in ((1, T, H, K), (1, T, H, K), (1, T, HV, V), (1, T, HV), (1, T, HV), (HV,), (HV,))]
    q, k, v, gate, beta, A_log, dt_bias = inputs
    options = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True,
                   use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    packed, _ = chunk_gated_delta_rule(q, k, v, gate, beta, cu_seqlens=torch.tensor(bounds), **options)
    alone = torch.cat([chunk_gated_delta_rule(*(x[:, a:b] for x in (q, k, v, gate, beta)), **options)[0]
                       for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-13)
    cotangent = torch.randn(packed.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad((packed * cotangent).sum(), inputs),
                    torch.autograd.grad((alone * cotangent).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
