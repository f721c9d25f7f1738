"""The portable kernels bound by the fla function a transformers model calls, in families titan_ext never names.

transformers 5.24's modeling files call fla's kernels through module globals made by
``use_kernel_func_from_hub_with_fallback(func_name, "fla")`` (``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ...): a wrapper holding fla's function in its closure. On the CPU such a
model calls fla's Triton kernel and dies (``0 active drivers``) unless the binding finds the wrapper by what
it calls (``kernels.binding.hub_wrapper``). OLMo Hybrid (Gated DeltaNet) and Bailing Hybrid (KDA) here,
tiny, built from their config classes: forward and backward on the CPU equal transformers' own torch
fallback (what the model runs when fla is not installed), and a cached decoding step equals the full forward.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from helpers import assert_rel_close

from titan_ext import kernels
from titan_ext.kernels import binding

FAMILIES = {
    "olmo_hybrid": dict(
        config="OlmoHybridConfig", model="OlmoHybridForCausalLM",
        args=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, pad_token_id=0,
                  eos_token_id=1),
        kernels={"fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule",
                 "fla.ops.gated_delta_rule.fused_recurrent.fused_recurrent_gated_delta_rule"}),
    "bailing_hybrid": dict(
        config="BailingHybridConfig", model="BailingHybridForCausalLM",
        args=dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, kv_lora_rank=16, qk_rope_head_dim=8,
                  v_head_dim=16, qk_nope_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2,
                  num_local_experts=4, first_k_dense_replace=2, layer_group_size=2, pad_token_id=0, eos_token_id=1,
                  num_mtp_layers=0),
        kernels={"fla.ops.kda.chunk.chunk_kda", "fla.ops.kda.fused_recurrent.fused_recurrent_kda"}),
}


def tiny(family: str):
    import transformers

    spec = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, spec["config"])(**spec["args"])
    return getattr(transformers, spec["model"])(config)


def hub_wrappers(module) -> dict:
    """The module's transformers hub wrappers whose closure holds an fla function -> that function."""
    found = {}
    for value in vars(module).values():
        implementation = binding.hub_implementation(value)
        if implementation is not None and getattr(implementation, "__module__", "").startswith("fla."):
            found[value] = implementation
    return found


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_titan_ext_never_named_runs_the_portable_kernels_and_equals_transformers_fallback(family):
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    wrappers = hub_wrappers(modeling)
    assert {f"{fn.__module__}.{fn.__qualname__}" for fn in wrappers.values()} == FAMILIES[family]["kernels"]
    model = tiny(family)
    fallback = copy.deepcopy(model)
    # before binding, unported sees fla's kernels through the hub wrappers (the model would die on the CPU)
    assert set(kernels.unported(model)) == FAMILIES[family]["kernels"]
    kernels.bind(model, "portable", training=True)
    assert kernels.unported(model) == {}
    # transformers' own torch path: each wrapper's torch function, as when fla is not installed
    used = binding.bind(fallback, {wrapper: wrapper.__wrapped__ for wrapper in wrappers}, key="test:hub-fallback")
    binding.forget("test:hub-fallback")
    assert used == set(wrappers)
    # fla's and transformers' modules are as shipped: only the bound model's classes see other globals
    assert all(vars(modeling)[wrapper.__name__] is wrapper for wrapper in wrappers)

    tokens = torch.randint(2, 64, (2, 70), generator=torch.Generator().manual_seed(1))  # > 64: several chunks
    ours, theirs = model(input_ids=tokens).logits, fallback(input_ids=tokens).logits
    assert_rel_close(ours, theirs, tol=1e-5, what="logits")
    cotangent = torch.randn(ours.shape, generator=torch.Generator().manual_seed(2))
    (ours * cotangent).sum().backward()
    (theirs * cotangent).sum().backward()
    for (name, p), q in zip(model.named_parameters(), fallback.parameters()):
        if q.grad is not None:
            assert_rel_close(p.grad, q.grad, tol=1e-4, what=name)

    # decoding: the prefill's final states (chunk kernel) and one cached step (the recurrent kernel's wrapper)
    model.eval()
    with torch.no_grad():
        full = model(input_ids=tokens[:, :21]).logits
        prefix = model(input_ids=tokens[:, :20], use_cache=True)
        step = model(input_ids=tokens[:, 20:21], past_key_values=prefix.past_key_values, use_cache=True).logits
    assert_rel_close(step[:, -1], full[:, 20], tol=1e-4, what="cached decoding step")


def test_the_bound_wrapper_keeps_transformers_contract():
    """The copy runs the wrapper's own code: the caller's keywords filtered to fla's parameter names (a
    transformers layer hands its kernel every keyword it got, ``position_ids`` included), fla's function
    swapped for titan_ext's."""
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as modeling

    from titan_ext.kernels.gated_delta import chunk_gated_delta_rule

    wrapper = modeling.torch_chunk_gated_delta_rule
    ours = binding.hub_wrapper(wrapper, chunk_gated_delta_rule)
    assert binding.hub_wrapper(wrapper, chunk_gated_delta_rule) is ours  # one copy per wrapper and kernel
    assert binding.hub_implementation(ours) is None  # not taken for transformers' own again
    assert ours.__wrapped__ is wrapper.__wrapped__  # transformers' torch function, as functools.wraps left it
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 10, 2, 8, generator=g), torch.randn(1, 10, 2, 8, generator=g)
    v, gate, beta = torch.randn(1, 10, 2, 4, generator=g), -torch.rand(1, 10, 2, generator=g), torch.rand(1, 10, 2, generator=g)
    o, state = ours(q, k, v, g=gate, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    cu_seqlens=None, position_ids=torch.arange(10), chunk_size=64)
    o_ref, state_ref = chunk_gated_delta_rule(q, k, v, gate, beta, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(state, state_ref)
    # the copies are kept only while something holds them: a replacement holding a job's state goes with its job
    import gc
    import weakref

    def job_kernel(*args, **kwargs):
        return chunk_gated_delta_rule(*args, **kwargs)

    copy_of_job, alive = binding.hub_wrapper(wrapper, job_kernel), weakref.ref(job_kernel)
    del job_kernel, copy_of_job
    gc.collect()
    assert alive() is None
