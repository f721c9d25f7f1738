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
import itertools
import json
import logging
import os
import random
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from titan_ext import documents
from titan_ext.errors import ConfigError, defer, exit_with

IGNORE_INDEX = -100
"""torchtitan's ignored label."""

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


BAD_RECORDS = ("stop", "skip")
BAD_RECORDS_OPTION = "--titan_ext.bad_records"


class BadRecords:
    """What a bad record does (``[titan_ext] bad_records``): stop the job in one line naming the file and
    line or row, or skip it with a logged count."""

    def __init__(self, policy: str = "stop", option: str = OPTION):
        self.policy, self.option, self.skipped = policy, option, 0
        self.in_job = ""
        """In a job, how a stop ends it: "defer" (training: at the step's end, where every rank learns of it,
        the dataset padding the step with windows that train nothing) or "exit" (this rank, in one line);
        "" outside a job: the ``ConfigError`` is raised."""

    def meet(self, where: str, problem: str) -> None:
        """Raise (stop), or log and count (skip); ``where`` is the file and line or row."""
        if self.policy == "stop":
            raise ConfigError(
                f"{self.option}: {where} {problem}; fix or remove the record, or set {BAD_RECORDS_OPTION}=skip "
                "to train past bad records (logged, counted)"
            )
        self.skipped += 1
        logging.getLogger().warning(f"titan_ext: skipped a bad record: {where} {problem} ({self.skipped} skipped so far)")


def json_lines(files: list[str], text_field: str, bad_records: BadRecords):
    """The records of JSON-lines shards, read line by line (not by ``datasets``' chunked JSON reader, whose
    parse error names neither the file nor the line): each one an object with a string ``text_field``."""
    for file in files:
        with open(file, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    bad_records.meet(f"{file} line {number}", f"is not JSON ({error})")
                    continue
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    bad_records.meet(f"{file} line {number}", f"has no string {text_field!r} field")
                    continue
                yield record


def table_rows(files: list[str], text_field: str, bad_records: BadRecords, builder: str):
    """The rows of parquet or arrow shards, read with pyarrow batch by batch: a row without a string
    ``text_field`` is named by its file and row, a file pyarrow cannot read by its name."""
    for file in files:
        row = 0
        try:
            for batch in _record_batches(file, builder):
                for record in batch.to_pylist():
                    row += 1
                    if not isinstance(record.get(text_field), str):
                        bad_records.meet(f"{file} row {row}", f"has no string {text_field!r} field")
                        continue
                    yield record
        except ConfigError:
            raise
        except Exception as error:  # pyarrow's: a corrupt or truncated file (skipping drops its rest)
            bad_records.meet(f"{file} after row {row}", f"cannot be read ({type(error).__name__}: {error})")


def _record_batches(file: str, builder: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    if builder == "parquet":
        yield from pq.ParquetFile(file).iter_batches(batch_size=1024)
        return
    with pa.memory_map(file) as source:  # datasets' arrow files are IPC streams; plain IPC files work too
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
            return
        yield from reader


def open_stream(path: str, option: str = OPTION, text_field: str = "text", bad_records: BadRecords | None = None):
    """The dataset at ``path`` (named by ``option``) as a ``datasets`` streaming ``IterableDataset``."""
    from datasets import IterableDataset, load_dataset

    if not path:
        raise ConfigError(f"{option} is empty; {STREAM_DATASET} streams the files or HF dataset it names")
    shards = local_shards(path, option)
    try:
        if shards is None:
            return load_dataset(path, split="train", streaming=True)
        builder, files = shards
        # one shard per file, as datasets' own builders: split over ranks by file, resumed by position
        bad_records = bad_records or BadRecords(option=option)
        if builder == "json":
            return IterableDataset.from_generator(json_lines, gen_kwargs={
                "files": files, "text_field": text_field, "bad_records": bad_records})
        return IterableDataset.from_generator(table_rows, gen_kwargs={
            "files": files, "text_field": text_field, "bad_records": bad_records, "builder": builder})
    except ConfigError:
        raise
    except Exception as error:  # datasets' errors for a name it cannot find or files it cannot read
        detail = " ".join(str(error).split())[:300]
        raise ConfigError(
            f"{option}={path!r} cannot be streamed ({type(error).__name__}: {detail}); "
            "give local parquet/JSON-lines/arrow shards or an HF dataset available offline"
        ) from None


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
                for _ in itertools.islice(json_lines([file], text_field, BadRecords("stop", option)), FIRST_LOOK_LINES):
                    pass
    first = next(iter(open_stream(path, option, text_field, BadRecords(bad_records, option))), None)
    if first is None:
        raise ConfigError(f"{option}={path!r} holds no record; an empty dataset would never yield a batch")
    _check_text_field(first, path, text_field, option)


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
                 seed=0, infinite=True, document_mask=False, option=OPTION, bad_records="stop"):
        from datasets.distributed import split_dataset_by_node

        self.bad_records = BadRecords(bad_records, option)
        data = split_dataset_by_node(open_stream(path, option, text_field, self.bad_records), dp_rank, dp_world_size)
        probe = open_stream(path, option, text_field, BadRecords("skip" if bad_records == "skip" else "stop", option))
        if next(iter(split_dataset_by_node(probe, dp_rank, dp_world_size)), None) is None:
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
        try:
            yield from self._windows()
        except ConfigError as error:
            if self.bad_records.in_job != "defer":
                if self.bad_records.in_job == "exit":
                    exit_with(error)
                raise
            defer(error)  # every rank stops at this step's end (titan_ext.nonfinite); until then:
            while True:  # windows whose labels are all ignored: they add no token and no gradient
                yield self._ignored_window()

    def _ignored_window(self):
        x = torch.zeros(self.seq_len, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        if self.document_mask:
            return {"input": x, "document_positions": torch.zeros_like(x)}, labels
        return {"input": x}, labels

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


def stream_options(job_config) -> tuple[str, int]:
    """``[titan_ext] text_field`` and ``shuffle_buffer``; the section's own defaults when the job has none."""
    from titan_ext.config import TitanExt

    section = getattr(job_config, "titan_ext", None) or TitanExt()
    return section.text_field, section.shuffle_buffer


def bad_records_policy(job_config) -> str:
    from titan_ext.config import TitanExt

    policy = (getattr(job_config, "titan_ext", None) or TitanExt()).bad_records
    if policy not in BAD_RECORDS:
        raise ConfigError(f"{BAD_RECORDS_OPTION}={policy!r} is not one of {BAD_RECORDS}")
    return policy


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
        bad_records=bad_records_policy(job_config),
    )
    from dataclasses import asdict

    # A bad record met in training stops every rank together at that step's end, in one line: the ranks agree
    # there on non-finite losses already (titan_ext.nonfinite); with that check off, the rank stops alone.
    from titan_ext.nonfinite import policy

    synced = section == "training" and policy(getattr(job_config, "titan_ext", None)) != "off"
    dataset.bad_records.in_job = "defer" if synced else "exit"
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
        **asdict(options.dataloader), batch_size=options.local_batch_size,
    )
