"""Checks of a JSON-lines dataset file, read line by line."""

from __future__ import annotations

import itertools
import json
import os

from titan_ext.errors import ConfigError


def _require_file(path: str, where: str, fix: str) -> None:
    """A directory or a missing path would fail later as an obscure ``OSError``."""
    if os.path.isdir(path):
        raise ConfigError(f"{where} is a directory, not a file; {fix}")
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file; {fix}")


def _require_json_lines(path: str, where: str, option: str) -> None:
    """Files users give that are not JSON lines, named by what they are (the first line's JSON error would not)."""
    section = option.removeprefix("--").split(".")[0]
    with open(path, "rb") as f:
        head = f.read(4096)
    kind = "parquet" if head.startswith(b"PAR1") else "arrow" if head.startswith(b"ARROW1") or path.endswith(
        ".arrow") else "parquet" if path.endswith(".parquet") else ""
    if kind:
        raise ConfigError(f"{where} is a {kind} file; it is read by --{section}.dataset titan_ext_stream (this "
                          "dataset reads one JSON-lines file)")
    if head.startswith(b"\x1f\x8b"):
        raise ConfigError(f"{where} is gzip-compressed; decompress it (gunzip), or give it uncompressed")
    first = next((line for line in head.splitlines() if line.strip()), b"").strip()
    if first in (b"[", b"{") or (first.startswith(b"[") and not first.endswith(b"]")):
        raise ConfigError(f"{where} holds one JSON document over many lines, not JSON lines; write one JSON "
                          "object per line")


def _jsonl_record(raw: bytes, number: int, text_field: str, where: str, fix: str) -> dict:
    """One line of a JSON-lines dataset, parsed: an object with a string text field."""
    try:
        record = json.loads(raw)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        raise ConfigError(f"{where}: line {number} is not JSON; {fix}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: line {number} is a JSON {type(record).__name__}, not an object; {fix}")
    if text_field not in record:
        raise ConfigError(f"{where}: line {number} has no {text_field!r} field; {fix}")
    if not isinstance(record[text_field], str):
        kind = type(record[text_field]).__name__
        raise ConfigError(f"{where}: line {number} has a {text_field!r} field of type {kind}, not a string; {fix}")
    return record


def _jsonl_records(path: str, text_field: str, option: str, max_lines: int | None):
    """Yield the checked records of the first ``max_lines`` lines (all when None); blank lines are skipped."""
    where = f"{option}={path!r}"
    fix = f"give a JSON-lines file whose every line is a JSON object with a string {text_field!r} field"
    if os.path.isdir(path):  # a folder of shards is what the streaming dataset reads
        section = option.removeprefix("--").split(".")[0]
        raise ConfigError(f"{where} is a directory; a folder of shards is read by --{section}.dataset "
                          f"titan_ext_stream (parquet, JSON lines or arrow), or give one JSON-lines file")
    _require_file(path, where, fix)
    _require_json_lines(path, where, option)
    with open(path, "rb") as f:
        for number, raw in enumerate(itertools.islice(f, max_lines), start=1):
            if raw.strip():
                yield _jsonl_record(raw, number, text_field, where, fix)


def _require_records(count: int, path: str, text_field: str, option: str) -> None:
    """An empty dataset makes torchtitan's infinite data loader spin forever without a batch."""
    if count == 0:
        raise ConfigError(
            f"{option}={path!r} holds no records (no non-blank line); "
            f"give a JSON-lines file with at least one object with a string {text_field!r} field"
        )


def check_jsonl_dataset(
    path: str, text_field: str = "text", option: str = "--training.dataset_path", max_lines: int | None = 1000
) -> None:
    """Preflight a JSON-lines dataset: its first ``max_lines`` lines (None: all) must be records."""
    count = sum(1 for _ in _jsonl_records(path, text_field, option, max_lines))
    _require_records(count, path, text_field, option)


def load_jsonl_records(path: str, text_field: str = "text", option: str = "--training.dataset_path") -> list[dict]:
    """Every record of a JSON-lines dataset; the first bad line (or no line) is a ``ConfigError``."""
    records = list(_jsonl_records(path, text_field, option, None))
    _require_records(len(records), path, text_field, option)
    return records
