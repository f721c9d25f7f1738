"""Attention sinks (gpt-oss) and logit softcapping (Gemma 2) in titan_ext's masked attentions: the one over
all-gathered keys and values under CP (``cp_attention.per_document_sdpa``) and the per-document one
(``document_attention``), against transformers' own eager attention with a block-causal mask, forward and
gradients (the sinks' included), fp32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titan_ext.kernels import attention_block, cp_attention
from titan_ext.kernels.document_attention import document_attention

B, H, H_KV, D, T = 2, 4, 2, 8, 24
STARTS = ((0, 5, 17), (0, 11))
"""Each row's documents' first tokens."""
CAP = 2.0
"""A softcap the scores reach (|q.k| * scale up to about 5 here), so tanh bends them."""


def document_positions() -> torch.Tensor:
    rows = []
    for starts in STARTS:
        ends = (*starts[1:], T)
        rows.append(torch.cat([torch.arange(e - s) for s, e in zip(starts, ends)]))
    return torch.stack(rows)


def additive_mask(window: int | None) -> torch.Tensor:
    """transformers' 4D float mask: causal within each document (and within ``window``), -inf elsewhere."""
    documents = torch.arange(T) - document_positions()  # each token's document start
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    allowed = (distance >= 0) & (documents[:, :, None] == documents[:, None, :])
    if window is not None:
        allowed &= distance < window
    return torch.zeros(B, 1, T, T).masked_fill(~allowed[:, None], float("-inf"))


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, H_KV, T, D, generator=g) for _ in range(2))
    sinks = torch.randn(H, generator=g)
    return [x.requires_grad_() for x in (q, k, v, sinks)]


def eager(kind: str, q, k, v, sinks, window):
    """transformers' eager attention of the family: ``[B, T, H, D]``."""
    if kind == "sinks":
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    else:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=H // H_KV, head_dim=D, training=False)
    options = {} if kind == "sinks" else {"softcap": CAP}
    return eager_attention_forward(module, q, k, v, additive_mask(window), scaling=D ** -0.5, **options)[0]


def options(kind: str, sinks) -> dict:
    return {"sinks": sinks} if kind == "sinks" else {"softcap": CAP}


def compared(got, want, tensors):
    """The outputs, and every input's gradient of a random projection of them."""
    cotangent = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    grads = [torch.autograd.grad((out * cotangent).sum(), tensors, allow_unused=True) for out in (got, want)]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kind", ["sinks", "softcap"])
def test_attention_over_gathered_keys_equals_transformers_eager(kind, window, monkeypatch):
    """Rank 0's head-tail pieces of 2 (tokens 0-5 and 18-23) over the whole sequence's keys, in blocks of 4
    queries, equal the same queries of transformers' eager attention over the whole rows."""
    monkeypatch.setattr(cp_attention, "QUERY_BLOCK", 4)
    monkeypatch.setattr(attention_block, "QUERY_BLOCK", 3)  # the rescored path's own blocks, smaller still
    q, k, v, sinks = inputs()
    mine = torch.cat([torch.arange(0, 6), torch.arange(18, 24)])
    layout = SimpleNamespace(positions=mine.expand(B, -1), document_positions=document_positions())
    got = cp_attention.per_document_sdpa(q[:, :, mine], k, v, layout, D ** -0.5, window, **options(kind, sinks))
    want = eager(kind, q, k, v, sinks, window)[:, mine].transpose(1, 2)
    compared(got, want, (q, k, v, sinks))


@pytest.mark.parametrize("kind", ["sinks", "softcap"])
def test_per_document_attention_equals_transformers_eager(kind, monkeypatch):
    """``document_attention`` (what a transformers model runs with document masking) takes the sinks and the
    softcap as the model's attention hands them over (gpt-oss's keyword is ``s_aux``)."""
    monkeypatch.setattr(attention_block, "QUERY_BLOCK", 4)
    q, k, v, sinks = inputs(2)
    bounds = torch.tensor([s + row * T for row, starts in enumerate(STARTS) for s in starts] + [B * T])
    given = {"s_aux": sinks} if kind == "sinks" else {"softcap": CAP}
    module = SimpleNamespace(training=False)
    got, _ = document_attention(module, q, k, v, None, scaling=D ** -0.5, cu_seq_lens_q=bounds, **given)
    compared(got, eager(kind, q, k, v, sinks, None), (q, k, v, sinks))


def test_without_sinks_or_softcap_the_blocks_are_torchs_sdpa(monkeypatch):
    """Nothing to rescore: one SDPA call per block, as before (no scores computed here)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    q, k, v, _ = inputs()
    attention_block.attention_block(q, k, v)
    assert calls == [1]


def test_the_ring_refuses_what_it_cannot_apply():
    """The plan sends a model with sinks or softcapping to the gathered attention (``ring_attention_blocker``)."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    from titan_ext.models.mixers.attention import TransformersAttention

    config = AutoConfig.for_model("gpt_oss", hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=16, num_hidden_layers=1, layer_types=["full_attention"],
                                  attention_dropout=0.0)
    with torch.device("meta"):
        module = GptOssAttention(config, 0)
    mixer = TransformersAttention("self_attn", module)
    assert mixer.ring_attention_blocker(config, 0) == "attention sinks"
    assert mixer.context_parallel_blocker(config, 0) is None and mixer.document_mask_blocker(config, 0) is None
