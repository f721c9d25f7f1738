"""Local shards (JSON lines, parquet, arrow) read in one fixed order, split over data-parallel ranks, resumable
and re-splittable over another number of ranks.

The order is global: files sorted by name, records in file order (a record's index counts blank-free lines
or rows, bad records included). A rank reads *units*, each an arithmetic progression of one file's records
``(file, first, stride)``: with at least as many files as ranks, rank ``r`` of ``N`` reads every ``N``-th
file whole; with fewer, every file's records ``r, r + N, ...``. Its position is (unit, records of it
consumed). A rank resuming on another degree takes its share of what every old rank had left (``split``):
the rest of each old rank's current unit and its later units, dealt out whole while there are enough,
else each cut into ``world`` progressions. Every record is read once across the interrupted and the
resumed run.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from titan_ext.errors import ConfigError

BAD_RECORDS = ("stop", "skip")
BAD_RECORDS_OPTION = "--titan_ext.bad_records"

Unit = tuple[int, int, int]
"""(file index, first record, stride)."""


class BadRecords:
    """What a bad record does (``[titan_ext] bad_records``): stop the job in one line naming the file and
    line or row, or skip it with a logged count."""

    def __init__(self, policy: str = "stop", option: str = "--training.dataset_path"):
        self.policy, self.option, self.skipped = policy, option, 0
        self.in_job = ""
        """In a job, how a stop ends it: "defer" (training: at the step's end, where every rank learns of it)
        or "exit" (this rank, in one line); there the dataset pads with windows that train nothing, carrying the
        line to ``StreamDataloader``, which stops the job. "" outside a job: the ``ConfigError`` is raised."""

    def meet(self, where: str, problem: str, what: str = "record") -> None:
        """Raise (stop), or log and count (skip); ``where`` is the file and line or row (``what``: "record",
        or "file" for one that cannot be read at all)."""
        if self.policy == "stop":
            raise ConfigError(
                f"{self.option}: {where} {problem}; fix or remove the {what}, or set {BAD_RECORDS_OPTION}=skip "
                "to train past bad records (logged, counted)"
            )
        self.skipped += 1
        logging.getLogger().warning(f"titan_ext: skipped a bad record: {where} {problem} ({self.skipped} skipped so far)")


def file_records(file: str, builder: str, text_field: str, bad_records: BadRecords):
    """``(index, record)`` of every record of one shard; a bad one is met (stop raises; skip gives None).

    JSON lines are read line by line (``datasets``' chunked JSON reader names neither the file nor the
    line of a parse error), parquet and arrow by pyarrow batches."""
    if builder == "json":
        yield from _json_lines(file, text_field, bad_records)
    else:
        yield from _table_rows(file, builder, text_field, bad_records)


def _json_lines(file, text_field, bad_records):
    index = 0
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                bad_records.meet(f"{file} line {number}", f"is not JSON ({error})")
                record = None
            if record is not None and (not isinstance(record, dict) or not isinstance(record.get(text_field), str)):
                bad_records.meet(f"{file} line {number}", f"has no string {text_field!r} field")
                record = None
            yield index, record
            index += 1


def _table_rows(file, builder, text_field, bad_records):
    row = 0
    try:
        for batch in _record_batches(file, builder):
            for record in batch.to_pylist():
                if not isinstance(record.get(text_field), str):
                    bad_records.meet(f"{file} row {row + 1}", f"has no string {text_field!r} field")
                    record = None
                yield row, record
                row += 1
    except ConfigError:
        raise
    except Exception as error:  # pyarrow's: a corrupt or truncated file (skipping drops its rest)
        detail = f"{type(error).__name__}: {one_line(error)}"
        if row == 0:
            bad_records.meet(file, f"is not a readable {builder} file ({detail})", "file")
        else:
            bad_records.meet(f"{file} after row {row}", f"cannot be read ({detail})")


def one_line(error: BaseException, limit: int = 300) -> str:
    """A library's message (pyarrow's span lines) as one line."""
    return " ".join(str(error).split())[:limit]


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


def holds_no_record(file: str, builder: str) -> bool:
    """A shard that surely holds no record (0 bytes, only blank lines, 0 rows), to be left out of the split so
    that no rank is dealt only empty files. Cheap: a parquet footer, a JSON-lines file's first line, an arrow
    stream's first batches. A file that cannot be read is not empty: reading it reports it."""
    if os.path.getsize(file) == 0:
        return builder != "parquet"  # a 0-byte parquet file is no parquet file: reading it names it
    try:
        if builder == "json":
            with open(file, "rb") as f:
                return not any(raw.strip() for raw in f)
        if builder == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(file).metadata.num_rows == 0
        return not any(batch.num_rows for batch in _record_batches(file, builder))
    except Exception:  # noqa: BLE001 (pyarrow's errors for a corrupt file: reported when it is read)
        return False


def initial_units(files: int, rank: int, world: int) -> list[Unit]:
    """Rank ``rank``'s units of one pass over ``files`` files."""
    if files >= world:
        return [(f, 0, 1) for f in range(rank, files, world)]
    return [(f, rank, world) for f in range(files)]


def split(old_states: list[dict[str, Any]], rank: int, world: int) -> list[Unit]:
    """This rank's units of what the old ranks (their ``LocalRecords`` states, in rank order) had left."""
    remaining = []
    for state in old_states:
        units, current, done = [tuple(u) for u in state["units"]], state["unit"], state["done"]
        if current < len(units):
            file, first, stride = units[current]
            remaining += [(file, first + done * stride, stride), *units[current + 1:]]
    if len(remaining) >= world:
        return remaining[rank::world]
    return [(file, first + rank * stride, stride * world) for file, first, stride in remaining]


class LocalRecords:
    """One data-parallel rank's records of local shards (``units``), with its position as its state.

    A pass ends when the units are read; the next pass is the rank's own share of every file again."""

    def __init__(self, files: list[str], builder: str, text_field: str, bad_records: BadRecords, rank: int, world: int):
        self.files, self.builder, self.text_field, self.bad_records = files, builder, text_field, bad_records
        self.rank, self.world = rank, world
        self.units, self.unit, self.done, self.passes = initial_units(len(files), rank, world), 0, 0, 0

    def __iter__(self):
        if self.unit >= len(self.units):  # a new pass
            self.units, self.unit, self.done = initial_units(len(self.files), self.rank, self.world), 0, 0
            self.passes += 1
        while self.unit < len(self.units):
            file, first, stride = self.units[self.unit]
            for index, record in file_records(self.files[file], self.builder, self.text_field, self.bad_records):
                if index < first or (index - first) % stride:
                    continue
                ordinal = (index - first) // stride
                if ordinal < self.done:  # read before the checkpoint
                    continue
                self.done = ordinal + 1
                if record is not None:
                    yield record
            self.unit, self.done = self.unit + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"units": [list(u) for u in self.units], "unit": self.unit, "done": self.done, "passes": self.passes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.units = [tuple(u) for u in state["units"]]
        self.unit, self.done, self.passes = state["unit"], state["done"], state["passes"]
