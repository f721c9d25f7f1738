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


def parameters(fn) -> str:
    """``fn``'s parameters as ``name=default`` (no annotations: they change without changing a call)."""
    parts = []
    for p in inspect.signature(fn).parameters.values():
        name = {p.VAR_POSITIONAL: f"*{p.name}", p.VAR_KEYWORD: f"**{p.name}"}.get(p.kind, p.name)
        parts.append(name if p.default is p.empty else f"{name}={p.default!r}")
    return ", ".join(parts)


def check_fla_signatures(model_args) -> None:
    """Each function titan_ext's kernels replace or call by keyword still takes the parameters they were written
    against (each kernel module's ``SIGNATURES``; checked with flash-linear-attention 0.6.0, and transformers 5.17
    and 5.24 for Qwen3.5's, Qwen3-Next's and Kimi Linear's layers; fla's ``(*args, **kwargs)`` activations and its
    deprecated ``fused_chunk_gla(**kwargs)`` carry none to compare)."""
    from titan_ext import kernels
    from titan_ext.compat import resolve

    for target, expected in kernels.signatures().items():
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
    from titan_ext.models.moe.bias_router import ROUTER_FIELDS, bias_router
    from titan_ext.models.moe.blocks import moe_blocks, router_of, stacked_plainly

    model = tiny_copy(model_args, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    blocks = moe_blocks(model) if model is not None else []
    if not blocks:
        return
    block = blocks[0]
    router = router_of(block)
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        try:
            logits, weights, index = router(x)
        except Exception as error:  # noqa: BLE001  (another contract: MiniMax-M2's takes its bias, Zaya's [B, T, D])
            raise ConfigError(
                f"{model_args.model_type!r} models' MoE router {type(router).__qualname__} is not called as "
                f"router(hidden_states) -> (logits, weights, experts), which titan_ext's MoE support reads "
                f"({type(error).__name__}: {error}); train a MoE model whose router is"
            ) from None
        stacked = getattr(block.experts, "gate_up_proj", None)
        count = stacked.shape[0] if stacked is not None else getattr(router, "num_experts", None)
        if count is not None and logits.shape[-1] != count:  # Zaya's and LongCat's score computeless experts too
            raise ConfigError(
                f"{model_args.model_type!r} models' MoE router {type(router).__qualname__} scores "
                f"{logits.shape[-1]} choices for {count} experts, which titan_ext's balancing loss cannot "
                "count; train a MoE model whose router scores its experts"
            )
        if not torch.equal(logits.float().softmax(-1).topk(router.top_k, -1).indices.sort(-1).values,
                           index.sort(-1).values):
            raise HostChanged("transformers", f"{type(router).__qualname__} no longer returns its logits first or no "
                                              "longer picks the top-k of their softmax, which the balancing loss reads")
        if bias and all(hasattr(router, name) for name in ROUTER_FIELDS):  # what moe_balance = "bias" recomputes
            _, biased_weights, biased_index = bias_router(copy.deepcopy(router))(x)
            if not (torch.equal(biased_index, index) and torch.allclose(biased_weights, weights)):
                raise HostChanged("transformers", f"{type(router).__qualname__} no longer weighs its top-k experts by "
                                                  "their softmax probabilities (renormalized if norm_topk_prob), which "
                                                  "titan_ext's biased router (moe_balance = 'bias') computes")
        if not placed or not stacked_plainly(block.experts):  # other experts: refused by name (moe_plan.check_moe)
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

        kernels.bind(model, model_args.kernels_to_bind)
    return model


def _transformers_model(model_args) -> bool:
    from titan_ext.models.architecture import library_of

    return library_of(model_args.hf_config_class) == "transformers"


def _may_call_fla_kernels(model_args) -> bool:
    """An fla model, or one with a token mixer other than softmax attention (whose kernels may be fla's)."""
    from titan_ext.models.mixers import TransformersAttention

    return not _transformers_model(model_args) or any(
        part.mixes_tokens and not isinstance(part, TransformersAttention)
        for mixer in model_args.layer_mixers() for part in mixer.parts
    )


HOST_CHECKS: tuple[HostCheck, ...] = (
    HostCheck("torchtitan", "the trainer backpropagates the loss function's sum divided by the step's global "
              "count of valid tokens", lambda args: True, lambda args, uses: check_torchtitan_loss_scaling(args)),
    HostCheck("flash-linear-attention", "the parameters (names and defaults) of every fla kernel titan_ext "
              "replaces or calls", _may_call_fla_kernels, lambda args, uses: check_fla_signatures(args)),
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
