"""Throughput of titan_ext_stream's data path alone (read, shuffle, tokenize, pack, batch), in one run.

A generated folder of parquet shards (the shipped corpus repeated up to ``--mb``
megabytes; ``--doc-texts`` of its texts per document: 40 make documents of about 3,000 tokens) is read
through torchtitan's dataloader as ``train_configs/gla_340M.toml`` builds it, in stream order, with the shuffle buffer,
and with the buffer and document masking (``document_positions`` and boundary
labels per window). Each row: tokens/s over ``--batches`` batches after the first,
and its ratio to the first row. The model never runs: this is the ceiling the data
path puts on training throughput.

A second table is what the training loop waits for each batch while a step of
``--step-ms`` runs (a sleep: the GPU's time, 370 ms for GLA 340M at 16 x 2048 on an
H200), with the buffer and document masking, without a dataloader worker and with the
shipped TOML's (``[training.dataloader] num_workers = 1``).

    python bench/bench_data.py               # 100 MB, 8 shards, batch 16 x 2048, documents of ~3,000 tokens
    python bench/bench_data.py --mb 30 --doc-texts 1 --batches 20   # the tiny corpus's short documents
    python bench/bench_data.py --mb 1 --batches 20 --seq 128 --batch 4   # quick check (CI)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "titan_ext" / "assets" / "tiny" / "corpus.jsonl"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="size of the generated text, in MB")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=200, help="batches timed (after the first)")
    parser.add_argument("--buffer", type=int, default=10000, help="the shuffle buffer of the buffered row")
    parser.add_argument("--doc-texts", type=int, default=40,
                        help="the shipped corpus's texts joined into each document (40: about 3,000 tokens)")
    parser.add_argument("--step-ms", type=float, default=370.0, help="the training step the wait table sleeps for")
    parser.add_argument("--wait-batches", type=int, default=20, help="batches of the wait table (after the first)")
    return parser.parse_args(argv)


def write_shards(folder: Path, mb: float, shards: int, doc_texts: int = 1) -> int:
    """Parquet shards of about ``mb`` MB of text, ``doc_texts`` corpus texts a document; returns the document count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    docs, size, i = [], 0, 0
    while size < mb * 1e6:
        text = " ".join(texts[(i + j) % len(texts)] for j in range(doc_texts))
        docs.append({"text": f"{i} {text}"})
        size += len(text) + 1
        i += 1
    for s in range(shards):
        pq.write_table(pa.Table.from_pylist(docs[s::shards]), folder / f"part-{s:03d}.parquet")
    return len(docs)


SHIPPED = REPO / "train_configs" / "gla_340M.toml"
"""A shipped GPU TOML: its dataloader worker, document masking, shuffle buffer and checkpoint interval."""


def loader(folder: Path, args, buffer: int, document_mask: bool = False, workers: int = 0):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.config import ConfigManager

    from titan_ext.data.text_stream import build_stream_dataloader

    config = ConfigManager().parse_args([
        "--job.config_file", str(SHIPPED),
        "--training.dataset", "titan_ext_stream", "--training.dataset_path", str(folder),
        "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq),
        "--titan_ext.shuffle_buffer", str(buffer), "--titan_ext." + ("" if document_mask else "no-") + "document_mask",
        "--training.dataloader.num_workers", str(workers),
    ])
    tokenizer = HuggingFaceTokenizer(str(REPO / "titan_ext" / "assets" / "tiny"))
    return build_stream_dataloader(1, 0, tokenizer, config)


def shipped_workers() -> int:
    import tomli

    with open(SHIPPED, "rb") as f:
        return tomli.load(f)["training"]["dataloader"]["num_workers"]


def measure(folder: Path, args, buffer: int, document_mask: bool = False) -> float:
    batches = iter(loader(folder, args, buffer, document_mask))
    next(batches)  # opening the stream and filling the buffer are not throughput
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    return args.batches * args.batch * args.seq / (time.perf_counter() - start)


def wait_per_batch(folder: Path, args, workers: int) -> float:
    """Median seconds the training loop waits for a batch, each after a step of ``--step-ms``."""
    import statistics

    batches = iter(loader(folder, args, args.buffer, document_mask=True, workers=workers))
    next(batches)
    waits = []
    for _ in range(args.wait_batches):
        time.sleep(args.step_ms / 1000)
        start = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - start)
    return statistics.median(waits)


def main(argv=None) -> list[tuple[str, float]]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        count = write_shards(folder, args.mb, args.shards, args.doc_texts)
        rows = [
            ("stream order", measure(folder, args, 0)),
            (f"shuffle buffer {args.buffer}", measure(folder, args, args.buffer)),
            (f"shuffle buffer {args.buffer} + document mask", measure(folder, args, args.buffer, document_mask=True)),
        ]
        waits = [(f"{workers} dataloader worker{'s' * (workers != 1)}", wait_per_batch(folder, args, workers))
                 for workers in (0, shipped_workers())]
    print(f"titan_ext_stream: {args.mb:g} MB in {args.shards} parquet shards ({count} documents of "
          f"{args.mb * 1e6 / count / 1e3:.1f} KB), batch {args.batch} x {args.seq}, {args.batches} batches timed")
    print(f"{'row':<40}{'tokens/s':>14}{'ratio':>8}")
    for name, tps in rows:
        print(f"{name:<40}{tps:>14,.0f}{tps / rows[0][1]:>8.2f}")
    print(f"the training loop's wait for a batch after a {args.step_ms:g} ms step (shuffle buffer {args.buffer} + "
          f"document mask), median of {args.wait_batches}")
    print(f"{'row':<40}{'wait ms':>14}{'ratio':>8}")
    for name, wait in waits:
        print(f"{name:<40}{wait * 1000:>14,.1f}{wait / waits[0][1]:>8.2f}")
    return rows + waits


if __name__ == "__main__":
    main()
