"""Host behaviours titan_ext relies on that a release could change without raising, probed at job start.

A renamed function fails loudly; a changed meaning does not. transformers
5.24 wrapped every attention ``forward`` in a decorator, and titan_ext's
context-parallel attention, bound where the old ``forward`` read its
attention registry, silently stayed local to each rank: a run trained on
wrong numbers. Each row below is one such reliance, checked in milliseconds
on tiny tensors (or by reading a signature) before the model is built; a
change stops the job in one line naming the package, its version and what
changed (``errors.HostChanged``).

``check_host(model_args)`` runs the rows that apply to the job's model.
"""

from __future__ import annotations

import copy
import contextlib
import inspect
import itertools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from titan_ext.errors import ConfigError, HostChanged


@dataclass(frozen=True)
class HostCheck:
    package: str
    relies_on: str
    """What titan_ext relies on, in a sentence (the table in docs/architecture.md)."""
    applies: Callable[[object], bool]
    """model args -> whether the job uses this behaviour."""
    check: Callable[[object, frozenset[str]], None]
    """(model args, what the job uses: ``FEATURES``) -> None, or raises ``HostChanged``."""
    needed_by: str = ""
    """The job's feature that relies on it (``FEATURES``); empty: every job."""


FEATURES = ("context parallelism or documents", "routing bias", "experts placed by EP or TP")
"""What a job may use that some rows alone rely on (``check_host(model_args, uses)``)."""


# fla functions titan_ext replaces (host_patches.MODEL_KERNELS) or calls by keyword, and the parameters
# (name=default) they had when titan_ext's replacements and calls were written against them.
FLA_SIGNATURES = {
    "fla.ops.gla.chunk:chunk_gla": "q, k, v, g, scale=None, initial_state=None, output_final_state=False, "
    "state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None",
    "fla.ops.gla.chunk:chunk_gla_fwd": "q, k, v, g, g_cumsum, scale, initial_state, output_final_state, "
    "state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None",
    "fla.ops.gla.chunk:chunk_gla_bwd": "q, k, v, g, g_cumsum, scale, initial_state, h, A, do, dht, "
    "state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None",
    "fla.ops.gla.fused_recurrent:fused_recurrent_gla": "q, k, v, gk=None, gv=None, scale=None, initial_state=None, "
    "output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule": "q, k, v, g, beta, scale=None, initial_state=None, "
    "output_final_state=False, use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, "
    "allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, "
    "cp_context=None, **kwargs",
    "fla.ops.gated_delta_rule.fused_recurrent:fused_recurrent_gated_delta_rule": "q, k, v, g=None, gk=None, gv=None, "
    "beta=None, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, "
    "use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, "
    "state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.kda.chunk:chunk_kda": "q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
    "use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, "
    "allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False, "
    "return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, "
    "cp_context=None, use_graph=False, max_num_seqs=None, **kwargs",
    "fla.ops.kda.fused_recurrent:fused_recurrent_kda": "q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, "
    "initial_state=None, output_final_state=False, "
    "use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, "
    "allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.modules.norm.layernorm:rms_norm": "x, weight, bias, residual=None, eps=1e-05, prenorm=False, "
    "residual_in_fp32=False",
    "fla.modules.norm.fused_norm_gate:rms_norm_gated": "x, g, weight, bias, activation='swish', residual=None, "
    "prenorm=False, residual_in_fp32=False, eps=1e-06",
    "fla.modules.activations.ops:logsigmoid": "x, temperature=1.0",
    "fla.modules.activations.ops:swiglu_linear": "x, y, weight, bias",
    "fla.modules.rotary.ops:rotary_embedding": "x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, "
    "cu_seqlens=None, chunk_indices=None",
    "fla.modules.rotary.ops:RotaryEmbedding._update_cos_sin_cache": "self, seqlen, device=None, dtype=None",
    "fla.layers.utils:get_layer_cache": "module, past_key_values",
    "fla.layers.utils:update_layer_cache": "module, past_key_values, **kwargs",
    "fla.modules.causal_conv1d.ops:causal_conv1d": "x, weight=None, bias=None, residual=None, initial_state=None, "
    "output_final_state=False, activation=None, backend='triton', cu_seqlens=None, cu_seqlens_cpu=None, "
    "chunk_indices=None, cp_context=None, **kwargs",
    "fla.modules.causal_conv1d.ops:causal_conv1d_update": "x, cache, residual=None, weight=None, bias=None, "
    "activation=None",
    "fla.ops.simple_gla.chunk:chunk_simple_gla":
    "q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, "
    "state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs",
    "fla.ops.simple_gla.fused_chunk:fused_chunk_simple_gla":
    "q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, "
    "cu_seqlens=None",
    "fla.ops.simple_gla.fused_recurrent:fused_recurrent_simple_gla":
    "q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False, "
    "reverse=False, state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.simple_gla.parallel:parallel_simple_gla":
    "q, k, v, g=None, scale=None, output_attentions=False, cu_seqlens=None, cu_seqlens_cpu=None",
    "fla.ops.linear_attn.chunk:chunk_linear_attn":
    "q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True, cu_seqlens=None",
    "fla.ops.linear_attn.fused_chunk:fused_chunk_linear_attn":
    "q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True, cu_seqlens=None",
    "fla.ops.linear_attn.fused_recurrent:fused_recurrent_linear_attn":
    "q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False, normalize=False, "
    "cu_seqlens=None",
    "fla.ops.lightning_attn.chunk:chunk_lightning_attn":
    "q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False, "
    "cu_seqlens=None, **kwargs",
    "fla.ops.lightning_attn.fused_recurrent:fused_recurrent_lightning_attn":
    "q, k, v, layer_idx, num_layers, scale=None, initial_state=None, output_final_state=False, "
    "reverse=False, cu_seqlens=None",
    "fla.ops.retention.chunk:chunk_retention":
    "q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **kwargs",
    "fla.ops.retention.fused_chunk:fused_chunk_retention":
    "q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None",
    "fla.ops.retention.fused_recurrent:fused_recurrent_retention":
    "q, k, v, scale=None, initial_state=None, output_final_state=False, reverse=False, "
    "state_v_first=False, cu_seqlens=None, **kwargs",
    "fla.ops.retention.parallel:parallel_retention": "q, k, v, scale=None, output_attentions=False, cu_seqlens=None",
    "fla.ops.delta_rule.chunk:chunk_delta_rule":
    "q, k, v, beta, scale=None, initial_state=None, output_final_state=False, "
    "use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs",
    "fla.ops.delta_rule.fused_recurrent:fused_recurrent_delta_rule":
    "q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False, "
    "use_qk_l2norm_in_kernel=False, cu_seqlens=None",
    "fla.modules.norm.l2norm:l2norm": "x, eps=1e-06, output_dtype=None",
    "fla.modules.norm.layernorm_gated:rmsnorm_fn":
    "x, weight, bias, z=None, eps=1e-06, group_size=None, norm_before_gate=True",
    "fla.modules.norm.layernorm_gated:layernorm_fn":
    "x, weight, bias, z=None, eps=1e-06, group_size=None, norm_before_gate=True, is_rms_norm=False",
    "fla.layers.gated_deltanet:GatedDeltaNet._use_fused_qkv_conv": "self, last_state, use_cache, cu_seqlens",
    "fla.modules.norm.layernorm:RMSNorm.forward": "self, x, residual=None, prenorm=False, residual_in_fp32=False",
    "fla.modules.norm.fused_norm_gate:FusedRMSNormGated.forward": "self, x, g, residual=None, prenorm=False, "
    "residual_in_fp32=False",
    "fla.modules.rotary.ops:RotaryEmbedding.forward": "self, q, k, seqlen_offset=0, cu_seqlens=None, max_seqlen=None, "
    "chunk_indices=None",
    "fla.modules.causal_conv1d.ops:ShortConvolution.forward": "self, x, residual=None, mask=None, cache=None, "
    "output_final_state=False, cu_seqlens=None, chunk_indices=None, **kwargs",
    "fla.modules.fused_cross_entropy.ops:cross_entropy_loss": "logits, target, label_smoothing=0.0, logit_scale=1.0, "
    "lse_square_scale=0.0, logit_softcapping=None, ignore_index=-100, inplace_backward=False, process_group=None",
    "fla.modules.fused_linear_cross_entropy.ops:fused_linear_cross_entropy_loss": "x, target, weight, bias=None, "
    "ignore_index=-100, label_smoothing=0.0, logit_scale=1.0, logit_softcapping=None, num_chunks=8, "
    "reduction='mean', use_l2warp=False, l2_penalty_factor=0.0001, accumulate_grad_in_fp32=True, process_group=None",
    "transformers.models.kimi_linear.modeling_kimi_linear:chunk_kimi_delta_attention":
    "query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, "
    "use_qk_l2norm_in_kernel=False, **kwargs",
    "transformers.models.kimi_linear.modeling_kimi_linear:causal_conv1d_fn":
    "hidden_states, weight, bias=None, activation=None, **kwargs",
    **{f"transformers.models.{model}.modeling_{model}:{cls}GatedDeltaNet.forward": (
        "self, hidden_states, cache=None, attention_mask=None, **kwargs",
        "self, hidden_states, cache_params=None, attention_mask=None, **kwargs",  # transformers 5.17
    ) for model, cls in (("qwen3_5", "Qwen3_5"), ("qwen3_next", "Qwen3Next"))},
}
"""Checked with flash-linear-attention 0.6.0 (and transformers 5.17 and 5.24 for the Gated DeltaNet layers of Qwen3.5
and Qwen3-Next and the KDA wrappers of Kimi Linear, which call fla's kernels; the Gated DeltaNet layers'
forward titan_ext's training models run instead: ``kernels.transformers_gated_deltanet``). fla's
``(*args, **kwargs)`` activations (swish, sigmoid, swiglu) and its deprecated ``fused_chunk_gla(**kwargs)``
carry no signature to compare."""


def parameters(fn) -> str:
    """``fn``'s parameters as ``name=default`` (no annotations: they change without changing a call)."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        name = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        parts.append(name if p.default is p.empty else f"{name}={p.default!r}")
    return ", ".join(parts)


def check_fla_signatures(model_args) -> None:
    from titan_ext.host_patches import resolve

    for target, expected in FLA_SIGNATURES.items():
        found, accepted = parameters(resolve(target)), (expected,) if isinstance(expected, str) else expected
        if found not in accepted:
            package = "transformers" if target.startswith("transformers.") else "flash-linear-attention"
            raise HostChanged(
                package, f"{target.replace(':', '.')} now takes ({found}), titan_ext's kernels "
                f"were written for {' or '.join(f'({a})' for a in accepted)}"
            )


def check_torchtitan_loss_scaling(model_args) -> None:
    """The trainer backpropagates the loss function's SUM divided by the step's global count of valid
    tokens (titan_ext's losses are sums; its PP schedule divides each microbatch by the same count)."""
    from torchtitan.train import Trainer

    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    tokens = torch.tensor(4.0)
    trainer = types.SimpleNamespace(
        model_parts=[model], parallel_dims=types.SimpleNamespace(pp_enabled=False), device=torch.device("cpu"),
        post_dataloading_process=lambda input_dict, labels: (input_dict["input"], labels, {}, {}),
        train_context=contextlib.nullcontext, maybe_enable_amp=contextlib.nullcontext(),
        loss_fn=lambda pred, labels: (pred - labels).sum(),
    )
    inputs = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    loss = Trainer.forward_backward_step(trainer, input_dict={"input": inputs}, labels=torch.zeros(2, 1),
                                         global_valid_tokens=tokens)
    expected_loss, expected_grad = inputs.sum() / tokens, inputs.sum(0) / tokens
    if not (torch.allclose(loss.detach(), expected_loss) and torch.allclose(model.weight.grad[0], expected_grad)):
        raise HostChanged(
            "torchtitan", f"Trainer.forward_backward_step no longer backpropagates the loss sum divided by the global "
            f"valid-token count (loss {loss.item():.4g}, expected {expected_loss.item():.4g})"
        )


def check_transformers_attention(model_args) -> None:
    """Under CP and document masking a transformers model must (1) call the attention its modeling file
    looks up in ``ALL_ATTENTION_FUNCTIONS`` (where CP binds the ring), with queries and keys (2) rotated at
    the ``position_ids`` given (CP's global positions, documents' restarting ones), and (3) use a given
    boolean 4D ``attention_mask`` as the mask (document masking's block-causal one)."""
    from titan_ext.kernels import binding
    from titan_ext.models.mixers import TransformersAttention
    from titan_ext.models.structure import layer_stack

    # a hybrid's first attention layer (Qwen3.5's layer 0 is linear attention)
    found = next(((i, part) for i, mixer in enumerate(model_args.layer_mixers()) for part in mixer.parts
                  if isinstance(part, TransformersAttention)), None)
    model = None if found is None else tiny_copy(model_args, found[0])
    if model is None or len(layer_stack(model)) > 1 and found[0] > 0:  # earlier layers would mix the probe's tokens
        return
    attention = layer_stack(model)[-1].get_submodule(found[1].path)
    seen = []

    def record(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        seen.append((query, key))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        mask = attention_mask if attention_mask is not None else torch.ones(
            query.shape[2], key.shape[2], dtype=torch.bool).tril()
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    interface = types.SimpleNamespace(get_interface=lambda name, default: record)
    cls, name = type(attention).__qualname__, type(attention).__module__
    binding.forget("host_checks:")  # the last probe's class holds its recorder: not kept once done
    used = binding.bind(attention, {}, key=f"host_checks:{next(_probes)}", names={name: {"ALL_ATTENTION_FUNCTIONS": interface}})
    T = 6
    tokens = torch.arange(1, T + 1)[None]
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
        if (name, "ALL_ATTENTION_FUNCTIONS") not in used or len(seen) != 1:
            raise HostChanged("transformers", f"{cls}.forward no longer calls the attention it looks up in "
                                              f"{name}.ALL_ATTENTION_FUNCTIONS, where titan_ext's context parallelism puts its own")
        (q_all, k_all), = seen
        seen.clear()
        model(input_ids=tokens[:, T // 2:], position_ids=torch.arange(T // 2, T)[None], use_cache=False)
        (q_half, k_half), = seen
        if not (torch.allclose(q_half, q_all[:, :, T // 2:], atol=1e-5) and torch.allclose(k_half, k_all[:, :, T // 2:], atol=1e-5)):
            raise HostChanged("transformers", f"{cls} no longer rotates queries and keys at the position_ids given, "
                                              "which context parallelism and document masking pass")
        seen.clear()
        whole = model(input_ids=tokens, use_cache=False).logits
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        mask[T // 2:, : T // 2] = False  # two documents
        positions = torch.arange(T) % (T // 2)
        packed = model(input_ids=tokens, position_ids=positions[None], attention_mask=mask[None, None], use_cache=False).logits
        second = model(input_ids=tokens[:, T // 2:], use_cache=False).logits
        if not (torch.allclose(packed[:, T // 2:], second, atol=1e-5) and torch.allclose(packed[:, :T // 2], whole[:, :T // 2], atol=1e-5)):
            raise HostChanged("transformers", f"{type(model).__qualname__} no longer keeps packed documents apart by a "
                                              "boolean 4D attention_mask and position_ids, as document masking passes them")


_probes = itertools.count()  # a binding key per probe: a bound class holds its probe's recorder


def check_transformers_experts(model_args, bias: bool = False, placed: bool = False) -> None:
    """A MoE block's router returns its logits first and picks the top-k of their softmax (the balancing loss
    recomputes the choice from them; with ``bias``, the biased router the weights too), and (with ``placed``:
    experts placed by EP or split by TP) its experts module computes, per token, the sum over its top-k of
    weight x ``down(act(gate) * up)`` with ``gate`` the first half of ``gate_up_proj``'s rows (expert
    parallelism computes exactly that, rank by rank)."""
    from titan_ext.moe import ROUTER_FIELDS, bias_router, moe_blocks

    model = tiny_copy(model_args, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    blocks = moe_blocks(model) if model is not None else []
    if not blocks:
        return
    block = blocks[0]
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        try:
            logits, weights, index = block.gate(x)
        except Exception as error:  # noqa: BLE001  (another contract: MiniMax-M2's takes its bias, Zaya's [B, T, D])
            raise ConfigError(
                f"{model_args.model_type!r} models' MoE router {type(block.gate).__qualname__} is not called as "
                f"gate(hidden_states) -> (logits, weights, experts), which titan_ext's MoE support reads "
                f"({type(error).__name__}: {error}); train a MoE model whose router is"
            ) from None
        experts = getattr(block.experts, "gate_up_proj", None)
        if experts is not None and logits.shape[-1] != experts.shape[0]:  # Zaya's router scores a null expert too
            raise ConfigError(
                f"{model_args.model_type!r} models' MoE router {type(block.gate).__qualname__} scores "
                f"{logits.shape[-1]} choices for {experts.shape[0]} experts, which titan_ext's balancing loss cannot "
                "count; train a MoE model whose router scores its experts"
            )
        if not torch.equal(logits.float().softmax(-1).topk(block.gate.top_k, -1).indices.sort(-1).values,
                           index.sort(-1).values):
            raise HostChanged("transformers", f"{type(block.gate).__qualname__} no longer returns its logits first or no "
                                              "longer picks the top-k of their softmax, which the balancing loss reads")
        if bias and all(hasattr(block.gate, name) for name in ROUTER_FIELDS):  # what moe_balance = "bias" recomputes
            _, biased_weights, biased_index = bias_router(copy.deepcopy(block.gate))(x)
            if not (torch.equal(biased_index, index) and torch.allclose(biased_weights, weights)):
                raise HostChanged("transformers", f"{type(block.gate).__qualname__} no longer weighs its top-k experts by "
                                                  "their softmax probabilities (renormalized if norm_topk_prob), which "
                                                  "titan_ext's biased router (moe_balance = 'bias') computes")
        if not placed:
            return
        experts = block.experts
        try:
            gate, up = torch.einsum("th,eih->tei", x, experts.gate_up_proj).chunk(2, dim=-1)
            each = torch.einsum("tei,ehi->teh", experts.act_fn(gate) * up, experts.down_proj)  # [T, E, H]
        except Exception as error:  # noqa: BLE001  (experts of another layout: Inkling's two-input activation)
            raise ConfigError(
                f"{model_args.model_type!r} models' experts ({type(experts).__qualname__}) are not the sum of "
                f"down(act(gate) * up) over stacked gate_up_proj and down_proj ({type(error).__name__}: {error}), "
                "which expert parallelism and TP compute; set --parallelism.expert_parallel_degree and "
                "--parallelism.tensor_parallel_degree to 1"
            ) from None
        expected = (each.gather(1, index[..., None].expand(-1, -1, each.shape[-1])) * weights[..., None]).sum(1)
        if not torch.allclose(experts(x, index, weights), expected, atol=1e-5):
            raise HostChanged("transformers", f"{type(experts).__qualname__} no longer computes the weighted sum of "
                                              "its top-k experts' down(act(gate) * up) from stacked gate_up_proj and "
                                              "down_proj, which expert parallelism computes")


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, attention_dropout=0.0, tie_word_embeddings=False)
"""A one-layer, 32-wide copy of the job's architecture: the same modeling code in a few milliseconds."""


def tiny_copy(model_args, layer: int = 0, **sizes):
    """The job's transformers model at ``TINY`` sizes (and ``sizes``) with one layer of the kind of the job's
    ``layer`` (or, where the config derives its layers' kinds from their count, its first ``layer + 1``), in fp32
    with eager-built weights; None when its config does not take them (an architecture these sizes do not fit
    is not probed)."""
    config = model_args.to_hf_config()
    tries = [{**TINY, **sizes}, TINY]  # the sizes asked for, else TINY's (Zaya routes to one expert only)
    if (getattr(config, "hidden_size", 0) or 0) <= 256:  # a small model whose widths TINY's do not fit (fla's CAT)
        tries.append({"num_hidden_layers": 1})
    models = (_tiny_copy(model_args, config, fields, layer) for fields in tries)
    return next((model for model in models if model is not None), None)


def _tiny_copy(model_args, config, sizes: dict, layer: int):
    fields = {name: value for name, value in sizes.items() if hasattr(config, name)}
    # the job's token ids lie beyond the tiny vocabulary (transformers warns of them): the probe reads none
    fields.update({name: None for name in ("bos_token_id", "eos_token_id", "pad_token_id") if hasattr(config, name)})
    settable = not isinstance(inspect.getattr_static(type(config), "layer_types", None), property)
    if isinstance(getattr(config, "layer_types", None), (list, tuple)) and settable:  # one layer, of ``layer``'s kind
        fields.update(num_hidden_layers=1, layer_types=config.layer_types[layer:layer + 1])
    else:  # kinds derived from the layer count (Jamba's period): the first ``layer + 1``
        fields["num_hidden_layers"] = layer + 1
    try:
        tiny = type(config)(**{**config.to_dict(), **fields})
        tiny._attn_implementation = config._attn_implementation  # the job's (SDPA where the model supports it)
        torch.manual_seed(0)
        with torch.device("cpu"), model_args.build_context():
            model = model_args.hf_model_class(tiny).float().eval()
    except Exception:  # noqa: BLE001  (the library's own refusal: this architecture is not probed)
        return None
    if "fla" in sys.modules:  # its other layers may call fla's kernels: the job's kernel path, as the job's model
        from titan_ext import kernels

        kernels.bind(model, model_args.kernel_path or kernels.default_path())
    return model


def _transformers_model(model_args) -> bool:
    return model_args.library == "transformers"


def _fla_model(model_args) -> bool:
    """An fla model, or one with a token mixer other than softmax attention (whose kernels may be fla's)."""
    from titan_ext.models.mixers import TransformersAttention

    return model_args.library == "fla" or any(
        part.mixes_tokens and not isinstance(part, TransformersAttention)
        for mixer in model_args.layer_mixers() for part in mixer.parts
    )


HOST_CHECKS: tuple[HostCheck, ...] = (
    HostCheck("torchtitan", "the trainer backpropagates the loss function's sum divided by the step's global "
              "count of valid tokens", lambda args: True, lambda args, uses: check_torchtitan_loss_scaling(args)),
    HostCheck("flash-linear-attention", "the parameters (names and defaults) of every fla kernel titan_ext "
              "replaces or calls", _fla_model, lambda args, uses: check_fla_signatures(args)),
    HostCheck("transformers", "attention modules call the attention their modeling file looks up in "
              "ALL_ATTENTION_FUNCTIONS, rotate queries and keys at the position_ids given, and use a boolean 4D "
              "attention_mask as given", _transformers_model,
              lambda args, uses: check_transformers_attention(args), FEATURES[0]),
    HostCheck("transformers", "a MoE block's router returns its logits first and picks the top-k of their softmax "
              "(with a routing bias: weighs them by their softmax probabilities, renormalized if norm_topk_prob); "
              "where EP or TP places its experts, they compute the weighted sum of their top-k down(act(gate) * up) "
              "from stacked gate_up_proj and down_proj", _transformers_model,
              lambda args, uses: check_transformers_experts(args, FEATURES[1] in uses, FEATURES[2] in uses)),
)


def check_host(model_args, uses: frozenset[str] = frozenset(FEATURES)) -> None:
    """Every row of ``HOST_CHECKS`` that applies to this model and to what the job ``uses`` (``FEATURES``); the
    first change found ends the job (a model whose attention does not read the registry trains, and CP or
    documents for it stop here).

    The probes draw random weights: the job's random state is left as it was (``fork_rng``).
    """
    with torch.random.fork_rng(devices=[]):
        for row in HOST_CHECKS:
            if (not row.needed_by or row.needed_by in uses) and row.applies(model_args):
                row.check(model_args, uses)
