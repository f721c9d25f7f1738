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

from titan_ext import compat
from titan_ext.errors import ConfigError

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


def cu_seqlens(positions: torch.Tensor) -> torch.Tensor:
    """fla's ``cu_seqlens`` of a ``[B, T]`` batch flattened to one row: every position 0 starts a sequence.

    Its length follows the number of documents; it is marked dynamic, so a
    compiled block traces it once for any count.
    """
    flat = positions.reshape(-1)
    starts = (flat == 0).nonzero().squeeze(1)
    bounds = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    compat.maybe_mark_dynamic(bounds, 0)
    return bounds


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]``, True where a token may attend: earlier or itself, in its own document.

    transformers derives the same mask from ``position_ids``, but only when
    some row holds two documents: a batch of one document per row would get
    plain causal attention instead, and compiled blocks a second graph.
    """
    document = (positions == 0).cumsum(dim=1)
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def check_dataset(job_config) -> None:
    """The job's data (and validation data) can carry boundaries: only titan_ext's own datasets emit them."""
    from titan_ext.data import TINY_DATASET, sections
    from titan_ext.text_stream import STREAM_DATASET

    if not enabled(job_config):
        return
    for section in sections(job_config):
        dataset = getattr(job_config, section).dataset
        if dataset not in (TINY_DATASET, STREAM_DATASET):
            raise ConfigError(
                f"{OPTION} needs document boundaries from the dataloader, which --{section}.dataset="
                f"{dataset!r} does not emit; use dataset {STREAM_DATASET!r} (any text shards) "
                f"or {TINY_DATASET!r}, or turn document_mask off"
            )


def check_model(model_args, job_config) -> None:
    """The model can honour boundaries (``model_args.document_mask_blocker()`` says why not)."""
    if not enabled(job_config):
        return
    reason = model_args.document_mask_blocker()
    if reason:
        raise ConfigError(f"{OPTION}: {reason}")
