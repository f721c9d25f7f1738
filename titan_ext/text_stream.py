"""Any text dataset, streamed: ``[training] dataset = "titan_ext_stream"``.

``--training.dataset_path`` names a local file, a directory of shards, or a
glob (parquet, JSON lines, arrow), or else an HF dataset (its ``train``
split). The ``datasets`` library streams it (nothing is read whole);
``split_dataset_by_node`` gives each data-parallel rank its own shards or
examples; a seeded shuffle buffer mixes documents. Documents are tokenized
with BOS/EOS and packed into ``seq_len + 1`` windows, as torchtitan's text
datasets do. With ``[titan_ext] document_mask`` each window also carries
its document boundaries (``titan_ext.documents``).

Resuming is exact: the checkpointed state holds the stream position, the
shuffle buffer and its RNG, and the partial token window. (``datasets``' own
shuffle buffer is not part of its state, so a resumed run would see other
documents.)
"""

from __future__ import annotations

import glob
import logging
import os
import random
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from titan_ext import documents
from titan_ext.errors import ConfigError

STREAM_DATASET = "titan_ext_stream"
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
OPTION = "--training.dataset_path"


def local_shards(path: str, option: str = OPTION) -> tuple[str, list[str]] | None:
    """(``datasets`` builder, files) for a local file, directory or glob; None for an HF dataset name.
    ``option`` is the config option that named ``path`` (errors name it)."""
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
        where = f"the directory {path!r}"
    elif glob.has_magic(path):
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise ConfigError(f"{option}={path!r} matches no file; fix the pattern")
        where = f"the files {path!r} matches"
    elif os.path.isfile(path):
        files, where = [path], f"{path!r}"
    else:
        return None
    formats = {FORMATS.get(os.path.splitext(f)[1]) for f in files} - {None}
    if not formats:
        raise ConfigError(
            f"{option}={path!r}: {where} holds no {'/'.join(sorted(FORMATS))} file; "
            "point it at text shards in one of those formats"
        )
    if len(formats) > 1:
        raise ConfigError(f"{option}={path!r} mixes {sorted(formats)} shards; keep one format per dataset")
    (builder,) = formats
    files = [f for f in files if FORMATS.get(os.path.splitext(f)[1]) == builder]
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError(f"{option}={path!r} holds no record (empty files); an empty dataset would never yield a batch")
    return builder, files


def open_stream(path: str, option: str = OPTION):
    """The dataset at ``path`` (named by ``option``) as a ``datasets`` streaming ``IterableDataset``."""
    from datasets import load_dataset

    if not path:
        raise ConfigError(f"{option} is empty; {STREAM_DATASET} streams the files or HF dataset it names")
    shards = local_shards(path, option)
    try:
        if shards is None:
            return load_dataset(path, split="train", streaming=True)
        builder, files = shards
        return load_dataset(builder, data_files=files, split="train", streaming=True)
    except ConfigError:
        raise
    except Exception as error:  # datasets' errors for a name it cannot find or files it cannot read
        detail = " ".join(str(error).split())[:300]
        raise ConfigError(
            f"{option}={path!r} cannot be streamed ({type(error).__name__}: {detail}); "
            "give local parquet/JSON-lines/arrow shards or an HF dataset available offline"
        ) from None


def check_stream(path: str, text_field: str, option: str = OPTION) -> None:
    """Preflight: the stream opens, is not empty, and its first record has a string ``text_field``."""
    first = next(iter(open_stream(path, option)), None)
    if first is None:
        raise ConfigError(f"{option}={path!r} holds no record; an empty dataset would never yield a batch")
    if not isinstance(first.get(text_field), str):
        raise ConfigError(
            f"{option}={path!r}: records have no string {text_field!r} field (fields: {sorted(first)}); "
            "set [titan_ext] text_field to the field holding the text"
        )


class ShuffledStream:
    """A seeded shuffle buffer over a ``datasets`` stream, with its buffer and RNG in the state."""

    def __init__(self, data, size: int, seed: int):
        self.data, self.size = data, size
        self.buffer: list[dict] = []
        self.rng = random.Random(seed)

    def __iter__(self):
        for sample in self.data:
            if len(self.buffer) < self.size:
                self.buffer.append(sample)
                continue
            index = self.rng.randrange(self.size)
            out, self.buffer[index] = self.buffer[index], sample
            yield out
        while self.buffer:  # the stream ended: drain in random order
            yield self.buffer.pop(self.rng.randrange(len(self.buffer)))

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "buffer": list(self.buffer), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.buffer = list(state["buffer"])
        self.rng.setstate(state["rng"])


class StreamedTextDataset(IterableDataset, Stateful):
    """Packed ``(input, label)`` windows of ``seq_len`` tokens from one data-parallel rank's stream."""

    def __init__(self, path, tokenizer, seq_len, dp_rank, dp_world_size, text_field="text", shuffle_buffer=0,
                 seed=0, infinite=True, document_mask=False, option=OPTION):
        from datasets.distributed import split_dataset_by_node

        data = split_dataset_by_node(open_stream(path, option), dp_rank, dp_world_size)
        if next(iter(split_dataset_by_node(open_stream(path, option), dp_rank, dp_world_size)), None) is None:
            raise ConfigError(  # a probe on its own stream: ``data``'s position stays at the start
                f"{option}={path!r}: data-parallel rank {dp_rank} of {dp_world_size} gets no document; "
                "give the dataset at least one record (better: one shard) per data-parallel rank"
            )
        self.documents = ShuffledStream(data, shuffle_buffer, seed) if shuffle_buffer > 0 else data
        self.tokenizer, self.seq_len, self.text_field, self.infinite = tokenizer, seq_len, text_field, infinite
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.document_mask, self.option = document_mask, option
        self.tokens: list[int] = []
        self.starts: list[int] = []  # with document masking: where in ``tokens`` each document begins

    def __iter__(self):
        window = self.seq_len + 1
        while True:
            documents = 0
            for documents, sample in enumerate(self.documents, 1):
                if self.document_mask:
                    self.starts.append(len(self.tokens))
                self.tokens.extend(self.tokenizer.encode(sample[self.text_field], add_bos=True, add_eos=True))
                while len(self.tokens) >= window:
                    yield self._sample(window)
            if not self.infinite:
                return
            if documents == 0:  # looping again would spin forever without a batch
                raise ConfigError(
                    f"{self.option}: data-parallel rank {self.dp_rank} of {self.dp_world_size} got no document; "
                    "give the dataset at least one record (better: one shard) per data-parallel rank"
                )

    def _sample(self, window: int):
        """The next window: ``({"input"}, labels)``, or with document masking ``({"input", "document_positions"}, labels)``."""
        x = torch.tensor(self.tokens[:window], dtype=torch.long)
        self.tokens = self.tokens[window:]
        if not self.document_mask:
            return {"input": x[:-1]}, x[1:]
        inside = [start for start in self.starts if start < window]
        self.starts = [start - window for start in self.starts[len(inside):]]
        return documents.window_sample(x, inside)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "starts": list(self.starts), "documents": self.documents.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tokens, self.starts = list(state["tokens"]), list(state["starts"])
        self.documents.load_state_dict(state["documents"])


def stream_options(job_config) -> tuple[str, int]:
    """``[titan_ext] text_field`` and ``shuffle_buffer``; the section's own defaults when the job has none."""
    from titan_ext.config import TitanExt

    section = getattr(job_config, "titan_ext", None) or TitanExt()
    return section.text_field, section.shuffle_buffer


def build_stream_dataloader(dp_world_size, dp_rank, tokenizer, job_config, section="training", infinite=True, path=None):
    """torchtitan's data-parallel dataloader over ``StreamedTextDataset`` (of ``path``, else the dataset
    path), with the windows and batch of ``[training]`` or ``[validation]`` (which never shuffles)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    options = getattr(job_config, section)
    path = path or options.dataset_path
    text_field, shuffle_buffer = stream_options(job_config)
    shuffle_buffer = shuffle_buffer if section == "training" else 0
    document_mask = documents.enabled(job_config)
    logging.getLogger().info(
        f"Streaming {path} ({STREAM_DATASET} for {section}, shuffle buffer {shuffle_buffer}, "
        f"document mask {'on' if document_mask else 'off'}, data-parallel rank {dp_rank} of {dp_world_size})"
    )
    dataset = StreamedTextDataset(
        path, tokenizer, options.seq_len, dp_rank, dp_world_size,
        text_field=text_field,
        shuffle_buffer=shuffle_buffer,
        seed=job_config.debug.seed or 0,
        infinite=infinite,
        document_mask=document_mask,
        option=f"--{section}.dataset_path",
    )
    from dataclasses import asdict

    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
        **asdict(options.dataloader), batch_size=options.local_batch_size,
    )
