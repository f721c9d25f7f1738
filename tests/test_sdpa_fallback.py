"""fla's ``Attention`` on PyTorch SDPA (no flash-attn) against explicit softmax attention, fp32.

fla's layer refuses to build without flash-attn except inside ``kernels.host_patches.building()``;
``kernels.portable`` then gives that one layer SDPA (and torch rotary/RMSNorm). fla is not changed.
"""

import math

import fla.layers.attn
import pytest
import torch
from fla.layers.attn import Attention

from titan_ext import kernels
from titan_ext.kernels import sdpa_attention
from titan_ext.kernels.host_patches import building

FLASH_ATTN_AS_SHIPPED = fla.layers.attn.flash_attn_func


def attention(**kwargs) -> Attention:
    """fla's Attention layer, bound to SDPA (and torch rotary/RMSNorm)."""
    with building():
        layer = Attention(**kwargs)
    return kernels.portable(layer)


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on [B, T, H, D], rotating the two halves of each head (fla's non-interleaved layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv_freq
    angles = angles.to(x.device)
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference(layer: Attention, x: torch.Tensor, window: int | None) -> torch.Tensor:
    b, t, _ = x.shape
    d = layer.head_dim
    q = layer.q_proj(x).view(b, t, -1, d)
    k = layer.k_proj(x).view(b, t, -1, d)
    v = layer.v_proj(x).view(b, t, -1, d)
    if layer.qk_norm:
        q, k = (n.weight * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + n.eps) for n, y in ((layer.q_norm, q), (layer.k_norm, k)))
    q, k = rotate(q, layer.rope_theta), rotate(k, layer.rope_theta)
    k, v = (y.repeat_interleave(layer.num_kv_groups, dim=2) for y in (k, v))
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
    i, j = torch.arange(t, device=x.device)[:, None], torch.arange(t, device=x.device)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", probs, v)
    return layer.o_proj(o.reshape(b, t, -1))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "num_kv_heads,qk_norm,window",
    [(4, False, None), (2, False, None), (1, True, None), (2, False, 5)],
    ids=["mha", "gqa", "mqa-qknorm", "gqa-window5"],
)
def test_sdpa_attention_matches_softmax_reference(num_kv_heads, qk_norm, window, device):
    torch.manual_seed(0)
    layer = attention(hidden_size=64, num_heads=4, num_kv_heads=num_kv_heads, qk_norm=qk_norm, window_size=window, layer_idx=0)
    layer.to(device)
    if qk_norm:
        with torch.no_grad():
            for n in (layer.q_norm, layer.k_norm):
                n.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 24, 64, device=device, requires_grad=True)
    grad = torch.randn(2, 24, 64, device=device)

    def run(fn):
        out = fn()
        params = [x, *layer.parameters()]
        return out, torch.autograd.grad(out, params, grad)

    got, got_grads = run(lambda: layer(x)[0])
    want, want_grads = run(lambda: reference(layer, x, window))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(sdpa_attention.flash_attn_available(), reason="flash-attn is installed: no fallback")
def test_fallback_only_inside_the_bound_layer():
    assert FLASH_ATTN_AS_SHIPPED is None
    with pytest.raises(ImportError, match="flash-attn"):  # fla's own check, outside building()
        Attention(hidden_size=64, num_heads=4, layer_idx=0)
    layer = attention(hidden_size=64, num_heads=4, layer_idx=0)
    assert type(layer).forward.__globals__["flash_attn_func"] is sdpa_attention.sdpa_attn_func
    assert Attention.forward.__globals__["flash_attn_func"] is None
    # building() restored fla's global, and binding never touched it
    assert fla.layers.attn.flash_attn_func is FLASH_ATTN_AS_SHIPPED


def test_fla_module_global_is_unchanged_after_building_and_binding():
    attention(hidden_size=64, num_heads=4, layer_idx=0)(torch.randn(1, 4, 64))
    assert fla.layers.attn.flash_attn_func is FLASH_ATTN_AS_SHIPPED
    if not sdpa_attention.flash_attn_available():
        assert fla.layers.attn.flash_attn_func is None  # what fla ships without flash-attn


def test_padded_batches_attend_to_their_tokens_only():
    """A padding mask goes through fla's unpadding to the varlen SDPA: each row's real tokens see only
    themselves, exactly as that row alone."""
    torch.manual_seed(0)
    layer = attention(hidden_size=64, num_heads=4, layer_idx=0)
    x = torch.randn(2, 8, 64)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # row 0: left padding
    with torch.no_grad():
        padded = layer(x, attention_mask=mask)[0]
        alone = layer(x[:1, 3:])[0]
    assert (padded[0, 3:] - alone[0]).abs().max() <= 1e-5 * alone.abs().max()
    assert (padded[1] - layer(x[1:])[0][0]).abs().max() <= 1e-5


def test_packed_documents_through_the_transformer_equal_each_document_alone():
    """fla's varlen interface (batch 1 + cu_seqlens) on titan_ext's CPU path: SDPA's varlen attention and
    rotary positions that restart at each document, so nothing crosses a boundary."""
    from fla.models import TransformerConfig, TransformerForCausalLM

    config = TransformerConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=100)
    torch.manual_seed(0)
    with building():
        model = kernels.portable(TransformerForCausalLM(config))
    lengths = (30, 7, 19)
    docs = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    cu_seqlens = torch.tensor([0, 30, 37, 56])
    with torch.no_grad():
        packed = model(input_ids=torch.cat(docs, dim=1), cu_seqlens=cu_seqlens).logits
        alone = torch.cat([model(input_ids=d).logits for d in docs], dim=1)
        unmasked = model(input_ids=torch.cat(docs, dim=1)).logits
    assert (packed - alone).abs().max() <= 1e-5 * alone.abs().max()
    assert (unmasked - alone).abs().max() > 1e-3  # without cu_seqlens the documents see each other
