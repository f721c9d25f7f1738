"""Document masking (``[titan_ext] document_mask``): a packed window trains as its separate documents.

Without it, a window of ``seq_len`` tokens packed from several documents is
one sequence: attention looks across document boundaries, a recurrent state
carries one document into the next, and a document's last token is asked to
predict the next document's first.

With it, the dataloader emits ``document_positions`` next to ``input``: each token's
index within its document, restarting at 0 at every document start and at
the first token of every window (a document cut by a window edge continues
in the next window as a new segment). The label of a token whose successor
starts another document is ``-100`` (ignored; the trainer's token count
leaves it out). The models read the boundaries from ``document_positions``
(torchtitan's own ``positions`` are its context parallelism's):

* fla models (GLA, the fla transformer): the batch is flattened to one row
  and the boundaries become ``cu_seqlens``, fla's packed layout: recurrent
  states reset, short convolutions and softmax attention stay inside each
  document, rotary positions restart;
* transformers models (Llama): ``position_ids`` (rotary positions restart)
  and a block-causal attention mask.

Shapes stay fixed from batch to batch: only ``cu_seqlens``' length follows the
number of documents, and it is marked dynamic so compiled blocks do not
recompile for it.
"""

from __future__ import annotations

import torch

from titan_ext.errors import ConfigError, HostChanged

OPTION = "--titan_ext.document_mask"
IGNORE_INDEX = -100


def enabled(job_config) -> bool:
    return bool(getattr(getattr(job_config, "titan_ext", None), "document_mask", False))


def window_sample(window: torch.Tensor, starts: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``({"input", "document_positions"}, labels)`` of one ``seq_len + 1`` token window whose documents begin at ``starts``."""
    begins = torch.zeros(len(window), dtype=torch.bool)
    begins[starts] = True
    begins[0] = True  # a window's first token starts a segment, whatever came before it
    index = torch.arange(len(window))
    positions = index - torch.cummax(torch.where(begins, index, 0), dim=0).values
    labels = window[1:].clone()
    labels[begins[1:]] = IGNORE_INDEX  # a document's last token does not predict the next one's first
    return {"input": window[:-1], "document_positions": positions[:-1]}, labels


def to_every_stage(post_dataloading_process):
    """torchtitan's ``Trainer.post_dataloading_process`` with ``document_positions`` among the keyword
    arguments it hands every pipeline stage, not the extra inputs it hands the first stage only.

    Why there: torch's schedule splits those kwargs into micro-batches along the batch, as it splits the
    inputs, so each stage's forward of micro-batch ``i`` reads micro-batch ``i``'s boundaries with no
    communication and no record of which micro-batch a stage runs (torchtitan sends its own models'
    attention masks the same way). Without PP the model receives both dicts alike: nothing changes.
    """

    def process(input_dict, labels):
        inputs, labels, extra_inputs, extra_kwargs = post_dataloading_process(input_dict, labels)
        if "document_positions" in extra_inputs:
            extra_kwargs = {**extra_kwargs, "document_positions": extra_inputs.pop("document_positions")}
        return inputs, labels, extra_inputs, extra_kwargs

    return process


def apply_document_attention(model) -> None:
    """A transformers model's attention runs each packed document alone, from ``cu_seqlens``
    (``kernels.document_attention``), where its ``forward_plan.document_attention`` hands them, instead of a
    ``B x T x T`` block-causal mask. Each block's attention reads it from its modeling file's attention
    registry (as context parallelism puts its own there)."""
    import functools
    import sys

    from titan_ext.kernels import binding
    from titan_ext.kernels.cp_attention import OneAttention
    from titan_ext.kernels.document_attention import document_attention

    implementation = model.config._attn_implementation
    for index, block in model.blocks().named_children():  # a pipeline stage's keep their indices
        for mixer in model.mixers[int(index)].parts:
            if mixer.recurrent_documents or not mixer.mixes_tokens:  # its own kernels take cu_seq_lens_q; or no mixing
                continue
            attention = block.get_submodule(mixer.path)
            module = sys.modules[type(attention).__module__]
            registry = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
            fallback = registry and registry.get_interface(implementation, getattr(module, "eager_attention_forward", None))
            interface = OneAttention(functools.partial(document_attention, fallback=fallback))
            names = {module.__name__: {"ALL_ATTENTION_FUNCTIONS": interface}}
            used = binding.bind(attention, {}, key=f"documents:{implementation}", names=names)
            if (module.__name__, "ALL_ATTENTION_FUNCTIONS") not in used:  # documents would attend to each other
                raise HostChanged(
                    "transformers", f"{type(attention).__qualname__}.forward does not read ALL_ATTENTION_FUNCTIONS "
                    f"from {module.__name__}, where {OPTION} puts its per-document attention"
                )


def check_model(model_args, job_config) -> None:
    """The model can honour boundaries (``model_args.document_mask_blocker()`` says why not)."""
    if not enabled(job_config):
        return
    reason = model_args.document_mask_blocker()
    if reason:
        raise ConfigError(f"{OPTION}: {reason}")
