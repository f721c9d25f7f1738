"""torchtitan's model contract over a Hugging Face causal LM class.

An adapted model keeps the HF parameter names (so HF checkpoints load with an
identity mapping) and adds what torchtitan's trainer calls: construction from
a model-args dataclass on the meta device, ``init_weights`` after
``to_empty``, and ``forward(tokens, document_positions=None, positions=None) -> logits``
(``document_positions`` come from the dataloader with document masking:
``titan_ext.data.documents``; ``positions`` from torchtitan's context parallelism; both packed by ``models.packing``). Labels are never passed to
the HF forward: torchtitan's labels are already shifted, and its loss is a
sum over tokens that the trainer normalizes. fla models get their kernels
bound at construction (``titan_ext.kernels``).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan_ext import compat, kernels
from titan_ext.errors import ConfigError, HostChanged, defer
from titan_ext.models import packing
from titan_ext.models.architecture import library_of
from titan_ext.models.args import HFModelArgs
from titan_ext.models.forward_plan import ForwardPlan
from titan_ext.models.structure import structure_of, ties_embeddings


class TitanCausalLM:
    """Mixin placed before an HF ``*ForCausalLM`` class in the bases (``titan_class`` does it)."""

    def __init__(self, model_args: HFModelArgs):
        with model_args.build_context():
            super().__init__(model_args.to_hf_config())
        self.model_args = model_args
        self.arch = model_args.arch
        self.structure = structure_of(self)
        self.mixers = self.structure.mixers  # each layer's token mixer, by index, recognised from its modules
        # a mixer's own forward imports the fla kernels it calls (LFM2's convolution: whether or not the model did)
        forwards = {part.module_class.forward: forward for mixer in self.mixers for part in mixer.parts
                    if (forward := part.training_forward()) is not None}
        if "fla" in sys.modules:  # only fla's kernels are replaced, and only a process that imported fla calls them
            kernels.bind(self, model_args.kernels_to_bind, training=True, forwards=forwards)
        if self.structure.tied:
            self.register_state_dict_post_hook(_without_tied_head)

    def blocks(self) -> nn.Module:
        """The layer stack (a pipeline stage's: its own blocks, under their indices)."""
        return self.get_submodule(self.structure.layers)

    def final_norm(self) -> nn.Module | None:
        """The final norm, where this model (or pipeline stage) holds one."""
        if self.structure.final_norm is None:
            return None
        try:
            return self.get_submodule(self.structure.final_norm)
        except AttributeError:  # a pipeline stage without it
            return None

    forward_plan = ForwardPlan()
    """What the job's features decided for this model's forward, once (``models.forward_plan``)."""

    def forward(
        self, tokens: torch.Tensor, document_positions: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` (hidden states ``[B, T, D]`` under the chunked loss); ``document_positions`` (document masking) keeps each document to itself.

        ``positions`` come from torchtitan under context parallelism: each token's place in the whole
        row. A pipeline stage without the embedding takes hidden states ``[B, T, D]`` instead of
        tokens, and one without the head returns hidden states (``titan_ext.parallel.pipeline``).
        """
        plan = self.forward_plan
        if not self.structure.takes_hidden_states:
            first = {"input_ids": tokens}
        else:  # a later pipeline stage: hidden states in
            if plan.residual_layout is not None:
                tokens = DTensor.from_local(tokens, *plan.residual_layout, run_check=False)
            first = {"inputs_embeds": tokens}
        if plan.cp_layout is not None:
            inputs = packing.step_inputs(self, first, positions, document_positions)
        elif document_positions is None:
            inputs = first
        elif self.arch.packed_layout == "cu_seqlens":  # fla: one row, sequences at cu_seqlens
            inputs = {name: x.reshape(1, -1, *x.shape[2:]) for name, x in first.items()}
            inputs["cu_seqlens"] = packing.cu_seqlens(document_positions)
        elif plan.document_attention:  # transformers: rotary positions from position_ids, attention per document
            inputs = {**first, **packing.document_attention_inputs(document_positions)}
        else:  # transformers: rotary positions from position_ids, and a block-causal mask
            mask = packing.block_causal_mask(document_positions)
            inputs = {**first, "position_ids": document_positions, "attention_mask": mask}
            if any(part.cp_kernels or part.cp_halos for mixer in self.mixers for part in mixer.parts):  # recurrent or
                # convolution layers: one packed row
                inputs["cu_seq_lens_q"] = packing.cu_seqlens(document_positions)
        base = self.get_submodule(self.structure.layers.partition(".")[0])  # the model under the head (Llama 4's too)
        hidden = base(**inputs, use_cache=False, return_dict=True).last_hidden_state
        if plan.cp_layout is not None and (missed := plan.cp_layout.check_paths()):
            # every rank stops at this step's end, together, in one line (``errors.defer``)
            defer(HostChanged(
                "flash-linear-attention" if library_of(type(self.config)) == "fla" else "transformers",
                f"under context parallelism a layer's path did not run in step 1's forward ({missed}): that layer "
                "would see only this rank's piece of the sequence",
            ))
        head = self.get_output_embeddings()
        if head is None:  # an earlier pipeline stage: hidden states out, as this rank's shard
            return hidden.to_local() if isinstance(hidden, DTensor) else hidden
        if plan.head_in_loss:  # the chunked loss applies the head (titan_ext.models.loss)
            return hidden
        return head(hidden).view(*tokens.shape[:2], -1)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialize every parameter and buffer in place (also on DTensor shards).

        HF's own initializer skips modules it marks as initialized; torchtitan
        calls this after ``to_empty``, when every tensor holds garbage, so each
        module's ``_init_weights`` runs unconditionally. HF's constructor calls it
        too (``post_init``): on the meta device, where torchtitan builds, there is
        nothing to set (HF's own ``init_weights`` skips it there), and each of torch's
        meta initializers is a Python decomposition (two thirds of a 7B model's build).
        """
        if all(p.is_meta for p in self.parameters()):
            if ties_embeddings(self.config):
                self.tie_weights()
            return
        _forget_initialized(self)
        for owner, module in _with_initializer(self, self):
            try:
                owner._init_weights(module)
            except RuntimeError:
                if not _sharded_parameters(module):
                    raise
                self._init_on_whole_tensors(owner, module)
            # state titan_ext adds to a module (the routing bias: titan_ext.models.moe.bias_router)
            if hasattr(module, "init_titan_ext_buffers"):
                module.init_titan_ext_buffers()
        if ties_embeddings(self.config) and None not in (self.get_input_embeddings(), self.get_output_embeddings()):
            self.tie_weights()  # a pipeline stage may hold the embedding alone
        if buffer_device is not None:
            move_buffers(self, buffer_device)

    def _init_on_whole_tensors(self, owner: nn.Module, module: nn.Module) -> None:
        """``_init_weights`` of a module whose initializer mixes its DTensor parameters with plain tensors
        (Qwen3.5's ``A_log``: ``init.copy_(A_log, torch.empty(...).uniform_(...))``): on whole plain tensors,
        each then distributed as its parameter is (rank 0's values, one scatter each, on every rank in turn)."""
        from torch.distributed.tensor import distribute_tensor

        sharded = _sharded_parameters(module)
        for name, p in sharded.items():
            module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device))
        try:
            owner._init_weights(module)
        finally:
            with torch.no_grad():
                for name, p in sharded.items():
                    whole = module._parameters[name].detach()
                    module._parameters[name] = p
                    p.copy_(distribute_tensor(whole, p.device_mesh, p.placements))


def unset_by_initializers(model: nn.Module) -> list[str]:
    """The parameters of ``model`` (a small copy, on the CPU) that no ``_init_weights`` sets: those its modules'
    constructors alone set (Apertus's xIELU activation), lost in torchtitan's meta-device build."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        _forget_initialized(model)
        for owner, module in _with_initializer(model, model):
            owner._init_weights(module)
    return [name for name, p in model.named_parameters() if torch.isnan(p).any()]


def _forget_initialized(model: nn.Module) -> None:
    """Clear the marks initializers leave so that they skip a tensor next time (transformers' and fla's
    ``_is_hf_initialized``): the marks survive ``to_empty``, whose tensors hold garbage (fla's KDA ``dt_bias``
    was left so)."""
    for item in (*model.modules(), *model.parameters(), *model.buffers()):
        if getattr(item, "_is_hf_initialized", False):
            item._is_hf_initialized = False


def _with_initializer(owner: nn.Module, module: nn.Module):
    """(the innermost HF model holding it, module) for ``module`` and everything beneath it: each module is
    initialized by its own model's ``_init_weights``, as transformers does (xLSTM's and Gemma3n's base models
    read their own attributes there)."""
    from transformers import PreTrainedModel

    yield owner, module
    for child in module.children():
        yield from _with_initializer(child if isinstance(child, PreTrainedModel) else owner, child)


def _sharded_parameters(module: nn.Module) -> dict[str, DTensor]:
    return {name: p for name, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}


def _without_tied_head(model: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A tied head's weight is the embedding's: state dicts (and so DCP checkpoints) hold it once, under the
    embedding's name, as HF checkpoints do; loading the embedding loads the head. A pipeline stage holding
    the head holds the embedding too (``titan_ext.parallel.pipeline``), so every stage and one process agree."""
    head = model.get_output_embeddings()
    if head is not None and model.get_input_embeddings() is not None:
        name = next(name for name, module in model.named_modules() if module is head)
        state_dict.pop(f"{prefix}{name}.weight", None)


@functools.cache
def titan_class(hf_class: type) -> type:
    """``TitanCausalLM`` + an HF causal-LM class, e.g. ``GLAForTitan``; an MoE's experts run as in
    ``hf_class`` (transformers' grouped GEMM, not its loop over the experts: ``compat.experts_dispatch_of``)."""
    name = hf_class.__name__.replace("ForCausalLM", "ForTitan")
    name = name if name != hf_class.__name__ else f"{name}ForTitan"  # GPT2LMHeadModel
    return type(name, (TitanCausalLM, hf_class), {"__module__": __name__, **compat.experts_dispatch_of(hf_class)})


def build_model(model_args: HFModelArgs) -> nn.Module:
    """A train spec's ``model_cls``: the adapted model for these args."""
    return titan_class(model_args.hf_model_class)(model_args)


def meta_model(model_args: HFModelArgs) -> nn.Module:
    """The model these args build, on the meta device (nothing allocated): for checks before the real build.

    A config the model's own library refuses (fla asserts, transformers raises)
    is a ``ConfigError`` here, one line, rather than a trace from every rank later.
    """
    try:
        with torch.device("meta"):
            return build_model(model_args)
    except ConfigError:
        raise
    except Exception as error:  # whatever the library raises: its message is the diagnosis
        name = model_args.hf_model_class.__name__
        detail = " ".join(str(error).split()) or "no message"
        raise ConfigError(
            f"{name} cannot be built from this config ({type(error).__name__}: {detail}); "
            "fix the model config (--model.flavor, [titan_ext] hf_config)"
        ) from None


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Put every buffer (e.g. rotary ``inv_freq``) on ``device``: with CPU offload, parameters
    stay on the CPU while buffers must sit where the forward runs."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))
