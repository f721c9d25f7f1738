"""Any text dataset, streamed: ``[training] dataset = "titan_ext_stream"``.

``--training.dataset_path`` names a local file, a directory of shards, or a
glob (parquet, JSON lines, arrow), or else an HF dataset (its ``train``
split). The ``datasets`` library streams it (nothing is read whole);
``split_dataset_by_node`` gives each data-parallel rank its own shards or
examples; a seeded shuffle buffer mixes documents. Documents are tokenized
with BOS/EOS and packed into ``seq_len + 1`` windows, as torchtitan's text
datasets do. With ``[titan_ext] document_mask`` each window also carries
its document boundaries (``titan_ext.data.documents``).

Resuming is exact: the checkpointed state holds the stream position, the
shuffle buffer and its RNG, and the partial token window. (``datasets``' own
shuffle buffer is not part of its state, so a resumed run would see other
documents.)
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
import random
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from titan_ext.data import documents
from titan_ext.errors import ConfigError, defer, exit_with
from titan_ext.data.shards import (
    BAD_RECORDS, BAD_RECORDS_OPTION, BadRecords, LocalRecords, file_records, holds_no_record, one_line, split,
)

STREAM_DATASET = "titan_ext_stream"
BAD_RECORD = "titan_ext_bad_record"
"""The window key carrying a bad record's one line from the dataset, which may run in a dataloader worker,
to ``StreamDataloader`` in the training loop's process, which stops the job with it."""
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
OPTION = "--training.dataset_path"


def local_shards(path: str, option: str = OPTION) -> tuple[str, list[str]] | None:
    """(``datasets`` builder, files) for a local file, directory or glob; None for an HF dataset name.
    ``option`` is the config option that named ``path`` (errors name it)."""
    if os.path.isdir(path):
        _check_not_dataset_dict(path, option)
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))
        if any(f.endswith(".arrow") for f in files):  # a ``save_to_disk`` folder: its JSON files describe it
            files = [f for f in files if os.path.basename(f) not in SAVED_DATASET_METADATA]
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
    shards = [f for f in files if FORMATS.get(os.path.splitext(f)[1]) == builder]
    files = [f for f in shards if not holds_no_record(f, builder)]  # the others are read; empty ones add nothing
    if not files:
        raise ConfigError(f"{option}={path!r}: its {len(shards)} {builder} file(s) hold no record; "
                          "an empty dataset would never yield a batch: point it at shards with records")
    return builder, files


SAVED_DATASET_METADATA = ("state.json", "dataset_info.json")
"""What ``datasets``' ``save_to_disk`` writes next to its arrow shards."""


def _check_not_dataset_dict(path: str, option: str) -> None:
    """A ``DatasetDict.save_to_disk`` folder holds one folder per split: reading them all would mix them."""
    index = os.path.join(path, "dataset_dict.json")
    if not os.path.isfile(index):
        return
    try:
        with open(index) as f:
            splits = list(json.load(f)["splits"])
    except (ValueError, KeyError, TypeError):
        splits = []
    first = os.path.join(path, splits[0]) if splits else os.path.join(path, "train")
    raise ConfigError(f"{option}={path!r} is a DatasetDict saved by datasets (splits: {', '.join(splits) or '?'}); "
                      f"point it at one split's folder, e.g. {first!r}")


def open_stream(path: str, option: str = OPTION, text_field: str = "text", bad_records: BadRecords | None = None,
                rank: int = 0, world: int = 1):
    """Data-parallel rank ``rank`` of ``world``'s records of the dataset at ``path`` (named by ``option``):
    local shards as ``shards.LocalRecords`` (a fixed order, re-splittable on resume), an HF dataset name as a
    ``datasets`` stream split by ``split_dataset_by_node``."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    if not path:
        raise ConfigError(f"{option} is empty; {STREAM_DATASET} streams the files or HF dataset it names")
    shards = local_shards(path, option)
    if shards is not None:
        builder, files = shards
        return LocalRecords(files, builder, text_field, bad_records or BadRecords(option=option), rank, world)
    try:
        data = load_dataset(path, split="train", streaming=True)
    except Exception as error:  # datasets' errors for a name it cannot find
        detail = " ".join(str(error).split())[:300]
        raise ConfigError(
            f"{option}={path!r} cannot be streamed ({type(error).__name__}: {detail}); "
            "give local parquet/JSON-lines/arrow shards or an HF dataset available offline"
        ) from None
    return split_dataset_by_node(data, rank, world) if world > 1 else data


FIRST_LOOK_FILES, FIRST_LOOK_LINES = 8, 1000


def check_stream(path: str, text_field: str, option: str = OPTION, bad_records: str = "stop") -> None:
    """Preflight: the stream opens, is not empty, and its first record has a string ``text_field``; unless bad
    records are skipped, a first look at the first lines of the first JSON-lines shards (a bad one named with
    its file and line; later ones stop the job at the step that meets them)."""
    shards = local_shards(path, option) if path else None
    if shards is not None and shards[0] == "json":
        _check_text_field(_first_json_object(shards[1]), path, text_field, option)  # the wrong field, not a bad record
        if bad_records == "stop":
            for file in shards[1][:FIRST_LOOK_FILES]:
                for _ in itertools.islice(file_records(file, "json", text_field, BadRecords("stop", option)),
                                          FIRST_LOOK_LINES):
                    pass
    if shards is not None and shards[0] == "parquet":
        _check_parquet_footers(shards[1], path, text_field, option, bad_records)
    first = next(iter(open_stream(path, option, text_field, BadRecords(bad_records, option))), None)
    if first is None:
        raise ConfigError(f"{option}={path!r} holds no record; an empty dataset would never yield a batch")
    _check_text_field(first, path, text_field, option)


def _check_parquet_footers(files: list[str], path: str, text_field: str, option: str, bad_records: str) -> None:
    """Every footer (cheap): a broken file past the first is named now, not mid-run; the text column is in
    the schema (a wrong [titan_ext] text_field is not a bad record)."""
    import pyarrow.parquet as pq

    columns = None
    for file in files:
        try:
            schema = pq.ParquetFile(file).schema_arrow
        except Exception as error:  # noqa: BLE001 (pyarrow's errors for a corrupt, truncated or 0-byte file)
            if bad_records == "stop":
                BadRecords("stop", option).meet(
                    file, f"is not a readable parquet file ({type(error).__name__}: {one_line(error)})", "file")
            continue
        columns = schema.names if columns is None else columns
    if columns is not None:
        _check_text_field(dict.fromkeys(columns, ""), path, text_field, option)  # names only


def _first_json_object(files: list[str]) -> dict | None:
    """The first line of the first non-empty JSON-lines shard, if it is a JSON object."""
    for file in files:
        with open(file, "rb") as f:
            line = next((raw for raw in f if raw.strip()), None)
        if line is not None:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None
            return record if isinstance(record, dict) else None
    return None


def _check_text_field(first: dict | None, path: str, text_field: str, option: str) -> None:
    if first is not None and not isinstance(first.get(text_field), str):
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
        while len(self.buffer) > self.size:  # buffers merged on a resume over fewer ranks: back to size first
            yield self._take(self.rng.randrange(len(self.buffer)))
        for sample in self.data:
            if len(self.buffer) < self.size:
                self.buffer.append(sample)
                continue
            index = self.rng.randrange(self.size)
            out, self.buffer[index] = self.buffer[index], sample
            yield out
        while self.buffer:  # the stream ended: drain in random order
            yield self._take(self.rng.randrange(len(self.buffer)))

    def _take(self, index: int) -> dict:
        """Slot ``index``'s document, the last slot's moved into it: two slots change, not every slot after it
        (``buffer_state``)."""
        self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
        return self.buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict(), "buffer": buffer_state(self.buffer), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.buffer = buffered_documents(state)
        self.rng.setstate(state["rng"])


BUFFER_SLOTS_PER_ENTRY = 16


def buffer_state(buffer: list[dict]) -> dict[int, tuple]:
    """A shuffle buffer as state: its slots in groups of ``BUFFER_SLOTS_PER_ENTRY``, keyed by group.

    A dataloader worker sends its dataset's state with every batch, as the entries of its dicts that changed
    (torchdata diffs dicts, not lists): a batch replaces a few slots, so a few groups travel instead of the
    whole buffer (a 10,000-document buffer of 8 KB documents is 66 MB). Groups, not single slots: the
    training loop's process rebuilds the state from its entries every batch, at a cost per entry."""
    size = BUFFER_SLOTS_PER_ENTRY
    return {group: tuple(buffer[group * size:(group + 1) * size]) for group in range(-(-len(buffer) // size))}


def buffered_documents(state: dict[str, Any]) -> list[dict]:
    """The shuffle buffer of a ``ShuffledStream`` state (a plain list in checkpoints before 2026-11-27)."""
    buffer = state.get("buffer") or []
    return [doc for group in sorted(buffer) for doc in buffer[group]] if isinstance(buffer, dict) else list(buffer)


class StreamedTextDataset(IterableDataset, Stateful):
    """Packed ``(input, label)`` windows of ``seq_len`` tokens from one data-parallel rank's stream."""

    def __init__(self, path, tokenizer, seq_len, dp_rank, dp_world_size, text_field="text", shuffle_buffer=0,
                 seed=0, infinite=True, document_mask=False, option=OPTION, bad_records="stop"):
        self.bad_records = BadRecords(bad_records, option)
        data = open_stream(path, option, text_field, self.bad_records, dp_rank, dp_world_size)
        probe = open_stream(path, option, text_field, BadRecords(bad_records, option), dp_rank, dp_world_size)
        if next(iter(probe), None) is None:
            raise ConfigError(  # a probe on its own stream: ``data``'s position stays at the start
                f"{option}={path!r}: data-parallel rank {dp_rank} of {dp_world_size} gets no document; "
                "give the dataset at least one record (better: one shard) per data-parallel rank"
            )
        self.documents = ShuffledStream(data, shuffle_buffer, seed) if shuffle_buffer > 0 else data
        self.seed = seed
        self.tokenizer, self.seq_len, self.text_field, self.infinite = tokenizer, seq_len, text_field, infinite
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.document_mask, self.option = document_mask, option
        self.tokens: list[int] = []
        self.starts: list[int] = []  # with document masking: where in ``tokens`` each document begins

    def __iter__(self):
        try:
            yield from self._windows()
        except GeneratorExit:  # closed (at exit, too, when this module's names may be gone already)
            raise
        except ConfigError as error:
            if not self.bad_records.in_job:
                raise
            # In a job the loader stops it (StreamDataloader, in the training loop's process: this may run in a
            # dataloader worker); until then, windows whose labels are all ignored add no token and no gradient.
            while True:
                yield self._ignored_window(str(error))

    def _ignored_window(self, bad_record: str):
        x = torch.zeros(self.seq_len, dtype=torch.long)
        labels = torch.full((self.seq_len,), documents.IGNORE_INDEX, dtype=torch.long)
        window = {"input": x, BAD_RECORD: bad_record}
        if self.document_mask:
            window["document_positions"] = torch.zeros_like(x)
        return window, labels

    def _windows(self):
        window = self.seq_len + 1
        while True:
            documents = 0
            for documents, sample in enumerate(self.documents, 1):
                text = sample.get(self.text_field)
                if not isinstance(text, str):  # an HF dataset's record (local shards are checked as they are read)
                    self.bad_records.meet(f"a record of data-parallel rank {self.dp_rank}'s stream (fields "
                                          f"{sorted(sample)})", f"has no string {self.text_field!r} field")
                    continue
                if self.document_mask:
                    self.starts.append(len(self.tokens))
                self.tokens.extend(self.tokenizer.encode(text, add_bos=True, add_eos=True))
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

    def load_resharded(self, old: list[dict[str, Any]]) -> None:
        """Resume from the states of a run over another number of data-parallel ranks (``old``, in rank order):
        this rank's share of every record they had left (``shards.split``), and the shuffle buffers and
        partial windows of the old ranks ``r`` with ``r % world == rank``. No document is repeated or skipped;
        the new shuffle is seeded by the job's seed, this rank and both degrees."""
        if not isinstance(self.documents, (LocalRecords, ShuffledStream)) or (
                isinstance(self.documents, ShuffledStream) and not isinstance(self.documents.data, LocalRecords)):
            raise ConfigError(f"{self.option}: an HF dataset name streams through datasets, which cannot re-split its "
                              "position over another number of ranks; resume with the saved number of ranks")
        rank, world = self.dp_rank, self.dp_world_size
        shuffled = isinstance(self.documents, ShuffledStream)
        positions = [state["documents"]["data"] if shuffled else state["documents"] for state in old]
        local = {"units": [list(u) for u in split(positions, rank, world)], "unit": 0, "done": 0,
                 "passes": max(p["passes"] for p in positions)}
        mine = [state for r, state in enumerate(old) if r % world == rank]
        tokens, starts = [], []
        for state in mine:  # each old partial window begins a segment of its own
            head = [] if not tokens or state["starts"][:1] == [0] else [len(tokens)]
            starts += head + [len(tokens) + start for start in state["starts"]]
            tokens += state["tokens"]
        if shuffled:
            buffer = [doc for state in mine for doc in buffered_documents(state["documents"])]
            rng = random.Random(f"{self.seed}:{rank}:{len(old)}->{world}").getstate()
            documents = {"data": local, "buffer": buffer_state(buffer), "rng": rng}
        else:
            documents = local
        self.load_state_dict({"tokens": tokens, "starts": starts if self.document_mask else [], "documents": documents})


def stream_options(job_config) -> tuple[str, int]:
    """``[titan_ext] text_field`` and ``shuffle_buffer``; the section's own defaults when the job has none."""
    from titan_ext.config import TitanExt

    section = getattr(job_config, "titan_ext", None) or TitanExt()
    return section.text_field, section.shuffle_buffer


def bad_records_policy(job_config) -> str:
    from titan_ext.config import TitanExt

    policy = (getattr(job_config, "titan_ext", None) or TitanExt()).bad_records
    if policy not in BAD_RECORDS:
        raise ConfigError(f"{BAD_RECORDS_OPTION}={policy!r} is not one of {BAD_RECORDS}; use one of them")
    return policy


def build_stream_dataloader(dp_world_size, dp_rank, tokenizer, job_config, section="training", infinite=True, path=None):
    """torchtitan's data-parallel dataloader over ``StreamedTextDataset`` (of ``path``, else the dataset
    path), with the windows and batch of ``[training]`` or ``[validation]`` (which never shuffles)."""
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
        bad_records=bad_records_policy(job_config),
    )
    from dataclasses import asdict

    # A bad record met in training stops every rank together at that step's end, in one line: the ranks agree
    # there on non-finite losses already (titan_ext.host.nonfinite); with that check off, the rank stops alone.
    synced = section == "training" and getattr(getattr(job_config, "titan_ext", None), "nonfinite_loss", "stop") != "off"
    dataset.bad_records.in_job = "defer" if synced else "exit"
    from titan_ext.checkpoints.dcp_steps import dataloader_resume_degree

    saved = dataloader_resume_degree(job_config) if section == "training" else None
    return StreamDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, saved_degree=saved,
        **asdict(options.dataloader), batch_size=options.local_batch_size,
        snapshot_every_n_steps=job_config.checkpoint.interval,
    )


def _parallel_aware_dataloader():
    from torchtitan.components.dataloader import ParallelAwareDataloader

    return ParallelAwareDataloader


def collate_windows(samples):
    """torch's default collate, a bad record's line set apart first (only the windows after the record carry
    it, and the default collate drops or refuses a key that some of a batch's samples lack), and the batch's
    tensors stacked into one, ``(names, tensors, bad record or None)``: a dataloader worker sends each tensor
    through a file descriptor of its own, each a cost to the training loop (``StreamDataloader.__iter__`` takes
    the views apart)."""
    from torch.utils.data import default_collate

    bad = [inputs.pop(BAD_RECORD) for inputs, _ in samples if BAD_RECORD in inputs]
    inputs, labels = default_collate(samples)
    return tuple(inputs), torch.stack([*inputs.values(), labels]), bad[0] if bad else None


class StreamDataloader(_parallel_aware_dataloader()):
    """torchtitan's data-parallel dataloader over ``StreamedTextDataset``, in or out of one worker process.

    - A bad record's line reaches the training loop's process with the batch after it, and stops the job
      there (``errors.defer``: every rank at the step's end; or this rank alone): the dataset may run in a
      worker, whose own ``defer`` nobody would read.
    - torchtitan keeps one position per rank (``dataloader.dp_rank_<n>``) and refuses another degree. When
      the checkpoint to resume was saved by ``saved_degree`` ranks, the first ``state_dict`` (the one DCP fills
      on load) asks for all of theirs, and ``load_state_dict`` hands them to the dataset
      (``StreamedTextDataset.load_resharded``). A position saved with another number of workers (0 or 1) is
      the dataset's too, loaded into it directly (torchdata refuses it).
    - A worker sends its dataset's position with the batches of checkpoint steps only
      (``snapshot_every_n_steps``: the checkpoint interval). Sent with every batch, the shuffle buffer's changed
      groups and torchdata's rebuilding of the whole position would cost the training loop milliseconds a
      batch; a checkpoint off the interval (the last step's) is resumed by torchdata
      replaying the batches since (same degree and worker count only).
    - ``close`` ends its worker: a job's end, not the garbage collector, ends the process it forked
      (``titan_ext.host.job``: torchtitan's ``Trainer.close``)."""

    def __init__(self, dataset, dp_rank: int, dp_world_size: int, saved_degree: int | None = None, **kwargs):
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, collate_fn=collate_windows, **kwargs)
        self.saved_degree = saved_degree if saved_degree != dp_world_size else None

    def __iter__(self):
        for names, tensors, bad_record in super().__iter__():
            if bad_record is not None:
                stop = defer if self.dataset.bad_records.in_job == "defer" else exit_with
                stop(ConfigError(bad_record))
            *columns, labels = tensors.unbind()
            yield dict(zip(names, columns)), labels

    def close(self) -> None:
        from titan_ext.compat import end_dataloader_workers

        end_dataloader_workers(self)

    def state_dict(self) -> dict[str, Any]:
        if self.saved_degree:  # the load's template: every old rank's position
            return {**{f"dp_rank_{r}": b"" for r in range(self.saved_degree)}, "world_size": self.saved_degree}
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, self.saved_degree = self.saved_degree, None
        if not state_dict or (not saved and self._rank_id not in state_dict):
            return super().load_state_dict(state_dict)
        log = logging.getLogger().info
        if saved:
            old = [exact_position(state_dict[f"dp_rank_{r}"])[0] for r in range(saved)]
            self.dataset.load_resharded(old)
            log(f"titan_ext: data-parallel rank {self.dp_rank} of {self.dp_world_size} resumes its share of the "
                f"data positions of {saved} saved ranks (titan_ext_stream re-split them)")
            return
        if saved_workers(state_dict[self._rank_id]) == self.num_workers:
            return super().load_state_dict(state_dict)  # torchdata's own, which replays batches past a snapshot
        dataset_state, workers = exact_position(state_dict[self._rank_id])
        self.dataset.load_state_dict(dataset_state)
        log(f"titan_ext: data-parallel rank {self.dp_rank} resumes the data position saved with {workers} dataloader "
            f"worker(s) with {self.num_workers}")


def saved_workers(saved: bytes) -> int:
    """The number of dataloader workers a rank's saved position (torchtitan's pickled state) was taken with."""
    import pickle

    from titan_ext.compat import dataloader_dataset_state

    return dataloader_dataset_state(pickle.loads(saved))[1]


def exact_position(saved: bytes) -> tuple[Any, int]:
    """(the dataset's state, the number of workers) of a rank's saved position, which titan_ext loads into the
    dataset itself; a ConfigError when a worker's snapshot is behind it (a checkpoint off the interval)."""
    import pickle

    from titan_ext.compat import dataloader_dataset_state, dataloader_steps_since_snapshot

    state = pickle.loads(saved)
    behind = dataloader_steps_since_snapshot(state)
    if behind:
        raise ConfigError(
            f"--checkpoint.load_step: this checkpoint's data position was saved by a dataloader worker {behind} "
            "batches after its last snapshot (taken every --checkpoint.interval steps); resume it with the saved "
            "number of data-parallel ranks and dataloader workers, or resume a step that is a multiple of the interval"
        )
    return dataloader_dataset_state(state)
