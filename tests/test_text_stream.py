"""``dataset = "titan_ext_stream"``: shard folders streamed, split across ranks, shuffled, resumed exactly."""

import json

import pytest
from helpers import job_config

from titan_ext.data.text_stream import ShuffledStream, StreamedTextDataset, check_stream, open_stream
from titan_ext.errors import ConfigError

DOCS = [f"document {i} " + "word " * (i % 7) for i in range(120)]


class CharTokenizer:
    """Enough of torchtitan's tokenizer for packing: one id per character, BOS 1, EOS 2."""

    def encode(self, text, add_bos=False, add_eos=False):
        return [1] * add_bos + [3 + ord(c) % 50 for c in text] + [2] * add_eos


def write_shards(folder, fmt, docs=DOCS, shards=4, field="text"):
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        part = [{field: d, "id": i} for i, d in enumerate(docs) if i % shards == s]
        if fmt == "jsonl":
            (folder / f"part-{s}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(part), folder / f"part-{s}.parquet")
    return folder


def texts(dataset, n):
    it = iter(dataset)
    return [next(it)[0]["input"].tolist() for _ in range(n)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_shard_folder_streams_every_document_once(tmp_path, fmt):
    folder = write_shards(tmp_path / fmt, fmt)
    assert sorted(r["text"] for r in open_stream(str(folder))) == sorted(DOCS)
    assert sorted(r["text"] for r in open_stream(str(folder / f"*.{fmt}"))) == sorted(DOCS)  # a glob
    check_stream(str(folder), "text")


def test_ranks_see_disjoint_documents(tmp_path):
    folder = str(write_shards(tmp_path / "d", "jsonl"))

    def ids(rank):
        data = StreamedTextDataset(folder, CharTokenizer(), 16, rank, 2, shuffle_buffer=0, infinite=False).documents
        return [r["id"] for r in data]

    zero, one = ids(0), ids(1)
    assert zero and one and not set(zero) & set(one) and sorted(zero + one) == list(range(len(DOCS)))


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_replays_exactly_with_the_shuffle_buffer(tmp_path, rank):
    folder = str(write_shards(tmp_path / "d", "parquet"))

    def dataset():
        return StreamedTextDataset(folder, CharTokenizer(), 32, rank, 2, shuffle_buffer=8, seed=3)

    straight = texts(dataset(), 40)  # past one epoch of this rank's documents: the re-loop too
    first = dataset()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    resumed = dataset()
    resumed.load_state_dict(state)
    assert texts(resumed, 35) == straight[5:]
    assert straight[:5] != texts(StreamedTextDataset(folder, CharTokenizer(), 32, rank, 2, shuffle_buffer=0), 5)


def test_the_shuffle_buffer_alone_is_a_seeded_permutation():
    class Stream(list):
        def state_dict(self):
            return {}

    order = list(ShuffledStream(Stream(range(50)), 10, seed=0))
    assert sorted(order) == list(range(50)) and order != list(range(50))
    assert order == list(ShuffledStream(Stream(range(50)), 10, seed=0))


@pytest.mark.parametrize(
    "setup,path,phrase",
    [
        ("empty dir", "{tmp}/empty", "holds no .arrow/.json/.jsonl/.parquet file"),
        ("glob", "{tmp}/nothing/*.parquet", "matches no file"),
        ("no text field", "{tmp}/body", "records have no string 'text' field (fields: ['body', 'id'])"),
        ("empty shards", "{tmp}/blank", "its 2 json file(s) hold no record"),
        ("parquet shards of 0 rows", "{tmp}/no_rows", "its 2 parquet file(s) hold no record"),
        ("mixed", "{tmp}/mixed", "mixes ['json', 'parquet'] shards"),
        ("missing", "", "is empty"),
        ("parquet without the text column", "{tmp}/body_parquet", "records have no string 'text' field (fields: ['body', 'id'])"),
        ("zero-byte parquet", "{tmp}/zero_byte", "zero_byte/part-1.parquet is not a readable parquet file (ArrowInvalid"),
        ("corrupt parquet past the first", "{tmp}/corrupt", "corrupt/part-3.parquet is not a readable parquet file"),
        ("a DatasetDict folder", "{tmp}/dataset_dict", "is a DatasetDict saved by datasets (splits: train, test); "
                                                       "point it at one split's folder, e.g. '{tmp}/dataset_dict/train'"),
    ],
)
def test_bad_stream_inputs_are_one_line(tmp_path, setup, path, phrase):
    (tmp_path / "empty").mkdir()
    write_shards(tmp_path / "body", "jsonl", field="body")
    write_shards(tmp_path / "body_parquet", "parquet", field="body")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.jsonl").write_text("")
    (tmp_path / "blank" / "b.jsonl").write_text("\n  \n")
    write_shards(tmp_path / "no_rows", "parquet", docs=[], shards=2)
    write_shards(tmp_path / "mixed", "jsonl", shards=1)
    write_shards(tmp_path / "mixed", "parquet", shards=1)
    write_shards(tmp_path / "zero_byte", "parquet")
    (tmp_path / "zero_byte" / "part-1.parquet").write_bytes(b"")
    write_shards(tmp_path / "corrupt", "parquet")
    data = (tmp_path / "corrupt" / "part-3.parquet").read_bytes()
    (tmp_path / "corrupt" / "part-3.parquet").write_bytes(data[: len(data) // 2])  # an interrupted copy
    (tmp_path / "dataset_dict" / "train").mkdir(parents=True)
    (tmp_path / "dataset_dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(ConfigError) as e:
        check_stream(path.replace("{tmp}", str(tmp_path)), "text")
    phrase = phrase.replace("{tmp}", str(tmp_path))
    assert phrase in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_empty_shards_among_good_ones_leave_no_rank_without_documents(tmp_path):
    """Shards of 0 rows, 0 bytes or blank lines hold nothing to split: the ranks share the others (dealt
    file by file, rank 1 of 2 would get parts 1 and 3, both empty)."""
    for fmt in ("jsonl", "parquet"):
        folder = write_shards(tmp_path / fmt, fmt, shards=4)
        for empty in (1, 3):
            (folder / f"part-{empty}.{fmt}").unlink()
        if fmt == "jsonl":
            (folder / "part-1.jsonl").write_text("")
            (folder / "part-3.jsonl").write_text("\n\n")
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            for empty in (1, 3):  # the text column, no row
                pq.write_table(pa.table({"text": pa.array([], pa.string())}), folder / f"part-{empty}.parquet")
        seen = []
        for rank in (0, 1):
            tokenizer = RecordingTokenizer()
            list(StreamedTextDataset(str(folder), tokenizer, 8, rank, 2, infinite=False))
            assert tokenizer.seen, f"{fmt}: rank {rank} got no document"
            seen += tokenizer.seen
        assert sorted(seen) == sorted(d for i, d in enumerate(DOCS) if i % 4 in (0, 2)), fmt


def test_a_saved_dataset_folder_streams(tmp_path):
    """``Dataset.save_to_disk``: arrow shards next to datasets' own state.json and dataset_info.json."""
    from datasets import Dataset

    Dataset.from_list([{"text": d} for d in DOCS]).save_to_disk(str(tmp_path / "saved"))
    tokenizer = RecordingTokenizer()
    check_stream(str(tmp_path / "saved"), "text")
    list(StreamedTextDataset(str(tmp_path / "saved"), tokenizer, 8, 0, 1, infinite=False))
    assert tokenizer.seen == DOCS


def test_preflight_checks_the_stream_and_its_options(tmp_path):
    from titan_ext.host import preflight

    folder = write_shards(tmp_path / "d", "jsonl", field="body")
    config = job_config("--training.dataset", "titan_ext_stream", "--training.dataset_path", str(folder))
    with pytest.raises(ConfigError, match="set \\[titan_ext\\] text_field"):
        preflight.check_job_config(config, world_size=1)
    config = job_config("--training.dataset", "titan_ext_stream", "--training.dataset_path", str(folder),
                        "--titan_ext.text_field", "body")  # fmt: skip
    preflight.check_job_config(config, world_size=1)
    config = job_config("--training.dataset", "titan_ext_stream", "--training.dataset_path", str(folder),
                        "--titan_ext.text_field", "body", "--titan_ext.shuffle_buffer", "-1")  # fmt: skip
    with pytest.raises(ConfigError, match="--titan_ext.shuffle_buffer=-1 is negative"):
        preflight.check_job_config(config, world_size=1)
    for data in (("titan_ext_stream", "--training.dataset_path", str(folder)), ("titan_ext_tiny",)):
        config = job_config("--training.dataset", *data, "--titan_ext.text_field", "body",
                            "--training.dataloader.num_workers", "2")  # every worker would read the whole stream
        with pytest.raises(ConfigError, match=f"--training.dataloader.num_workers=2: {data[0]} reads one stream .* use 1"):
            preflight.check_job_config(config, world_size=1)


def test_a_rank_without_documents_stops_instead_of_spinning(tmp_path):
    folder = write_shards(tmp_path / "one", "jsonl", docs=["only one document"], shards=1)
    with pytest.raises(ConfigError, match="data-parallel rank 1 of 2 gets no document"):  # before any batch
        StreamedTextDataset(str(folder), CharTokenizer(), 8, 1, 2)  # rank 1 of 2: nothing left for it
    StreamedTextDataset(str(folder), CharTokenizer(), 8, 0, 2)
    emptied = StreamedTextDataset(str(folder), CharTokenizer(), 8, 0, 2)
    emptied.documents = []  # a stream that ran dry after the check: a pass without documents stops too
    with pytest.raises(ConfigError, match="got no document"):
        next(iter(emptied))


def test_a_job_without_the_titan_ext_section_gets_the_documented_defaults():
    from types import SimpleNamespace

    from titan_ext.data.text_stream import stream_options

    assert stream_options(SimpleNamespace()) == ("text", 10000)  # README.md: text_field "text", shuffle_buffer 10000


def write_with_bad_line(folder, line_number, bad='{"text": "cut off'):
    """One JSON-lines shard of 30 documents whose line ``line_number`` is ``bad``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"document {i} " + "word " * 5, "id": i}) for i in range(30)]
    lines[line_number - 1] = bad
    (folder / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


@pytest.mark.parametrize("bad,problem", [('{"text": "cut off', "line 12 is not JSON"),
                                         ('{"body": "x"}', "line 12 has no string 'text' field"),
                                         ('["text"]', "line 12 has no string 'text' field")])
def test_a_bad_record_names_its_file_and_line(tmp_path, bad, problem):
    path = write_with_bad_line(tmp_path / "d", 12, bad)
    with pytest.raises(ConfigError) as error:  # the preflight's first look
        check_stream(path, "text")
    assert f"part-0.jsonl {problem}" in str(error.value) and "--titan_ext.bad_records=skip" in str(error.value)
    dataset = StreamedTextDataset(path, CharTokenizer(), 16, 0, 1, infinite=False)
    with pytest.raises(ConfigError, match=problem):  # met while training (past the first look)
        list(dataset)


def test_skipped_bad_records_are_counted_and_the_rest_trains(tmp_path, caplog):
    path = write_with_bad_line(tmp_path / "d", 12)
    check_stream(path, "text", bad_records="skip")  # no first look: the records are skipped instead
    dataset = StreamedTextDataset(path, CharTokenizer(), 16, 0, 1, infinite=False, shuffle_buffer=0, bad_records="skip")
    ids = [r["id"] for r in dataset.documents]
    assert ids == [i for i in range(30) if i != 11] and dataset.bad_records.skipped == 1
    assert "part-0.jsonl line 12 is not JSON" in caplog.text and "(1 skipped so far)" in caplog.text


@pytest.mark.parametrize("workers", [0, 1])
def test_in_a_training_job_a_bad_record_pads_the_step_and_defers_the_stop(tmp_path, workers):
    """The rank that meets it keeps the step's collectives company with windows that train nothing; the loader, in
    the training loop's process (the dataset may run in a worker, whose own deferral nobody reads), defers the
    stop to the step's end (titan_ext.host.nonfinite's per-step agreement), or stops this rank alone."""
    from titan_ext import errors
    from titan_ext.data import text_stream

    errors.take_deferred()
    for policy in ("defer", "exit"):
        dataset = StreamedTextDataset(write_with_bad_line(tmp_path / "d", 12), CharTokenizer(), 16, 0, 1, infinite=False)
        dataset.bad_records.in_job = policy
        stopped = []
        batches = iter(text_stream.StreamDataloader(dataset, dp_rank=0, dp_world_size=1, batch_size=4, num_workers=workers))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(text_stream, "exit_with", stopped.append)  # the process would end here, in one line
            for _ in range(40):  # past the bad line: padding windows from then on
                inputs, labels = next(batches)
                assert set(inputs) == {"input"}  # nothing but the batch reaches the model
                stopped += [error for error in [errors.take_deferred()] if error is not None]
                if stopped:
                    break
        assert stopped and "part-0.jsonl line 12 is not JSON" in str(stopped[0]), policy
        assert (labels[-1] == -100).all()
        del batches


def loader_of(folder, workers, document_mask=True):
    from titan_ext.data.text_stream import StreamDataloader

    dataset = StreamedTextDataset(folder, CharTokenizer(), 16, 0, 1, shuffle_buffer=5, seed=3, infinite=False,
                                  document_mask=document_mask)
    return StreamDataloader(dataset, dp_rank=0, dp_world_size=1, batch_size=2, num_workers=workers)


def as_lists(batch):
    inputs, labels = batch
    return [inputs["input"].tolist(), inputs["document_positions"].tolist(), labels.tolist()]


@pytest.mark.parametrize("saved_with,resumed_with", [(1, 1), (1, 0), (0, 1)])
def test_a_worker_gives_the_same_batches_and_a_resume_across_worker_counts_replays_them(tmp_path, saved_with, resumed_with):
    """``[training.dataloader] num_workers = 1`` reads ahead in a worker: the batches
    are the training loop's own, and a position saved with 0 or 1 worker resumes with either (torchdata alone
    refuses another count)."""
    folder = str(write_shards(tmp_path / "d", "parquet"))
    reference = [as_lists(batch) for batch in loader_of(folder, 0)]
    first = loader_of(folder, saved_with)
    batches = iter(first)
    head = [as_lists(next(batches)) for _ in range(5)]
    saved = first.state_dict()
    del batches
    second = loader_of(folder, resumed_with)
    second.load_state_dict(saved)
    assert head + [as_lists(batch) for batch in second] == reference


def test_a_workers_saved_position_is_the_datasets_as_without_a_worker(tmp_path):
    """What a resume over another number of ranks re-splits (``load_resharded``) is read from either layout."""
    import pickle

    from titan_ext.compat import dataloader_dataset_state

    folder = str(write_shards(tmp_path / "d", "jsonl"))
    states = []
    for workers in (0, 1):
        data = loader_of(folder, workers)
        batches = iter(data)
        for _ in range(4):
            next(batches)
        states.append(dataloader_dataset_state(pickle.loads(data.state_dict()["dp_rank_0"])))
        del batches
    (without, none), (within, one) = states
    assert (none, one) == (0, 1) and within == without and without["tokens"]


def test_the_shuffle_buffers_state_changes_by_group_and_older_list_states_load():
    """A worker sends its dataset's state with every batch as the dict entries that changed: replacing one
    document changes one group of slots, not the whole buffer."""
    from titan_ext.data.text_stream import BUFFER_SLOTS_PER_ENTRY, buffer_state, buffered_documents

    docs = [{"text": str(i)} for i in range(40)]
    replaced = list(docs)
    replaced[17] = {"text": "new"}
    before, after = buffer_state(docs), buffer_state(replaced)
    assert [group for group in after if after[group] != before[group]] == [17 // BUFFER_SLOTS_PER_ENTRY]
    assert buffered_documents({"buffer": after}) == replaced
    assert buffered_documents({"buffer": docs}) == docs and buffered_documents({"buffer": {}}) == []

    class Stream(list):
        def state_dict(self):
            return {}

    stream = ShuffledStream(Stream(range(100)), 64, seed=0)
    taken = iter(stream)
    for _ in range(40):  # the stream has ended: the buffer drains
        next(taken)
    for _ in range(20):
        before = buffer_state(stream.buffer)
        next(taken)
        after = buffer_state(stream.buffer)
        assert len({group for group in before if after.get(group) != before[group]}) <= 2


def test_a_parquet_row_without_text_is_a_bad_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "p"
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist([{"text": "fine " * 9}, {"text": None}, {"text": "also fine " * 5}]),
                   folder / "part-0.parquet")
    with pytest.raises(ConfigError, match="part-0.parquet row 2 has no string 'text' field"):
        list(StreamedTextDataset(str(folder), CharTokenizer(), 8, 0, 1, infinite=False))
    dataset = StreamedTextDataset(str(folder), CharTokenizer(), 8, 0, 1, infinite=False, bad_records="skip")
    assert len(list(dataset)) > 0 and dataset.bad_records.skipped == 1


def test_a_corrupt_parquet_shard_is_named(tmp_path):
    folder = write_shards(tmp_path / "p", "parquet")
    data = (folder / "part-1.parquet").read_bytes()
    (folder / "part-1.parquet").write_bytes(data[:4] + b"\0" * 64 + data[68:])  # a page header overwritten
    with pytest.raises(ConfigError, match=r"part-1.parquet is not a readable parquet file .*; fix or remove the file") as e:
        list(StreamedTextDataset(str(folder), CharTokenizer(), 16, 0, 1, infinite=False))
    assert "\n" not in str(e.value)  # pyarrow's message spans lines


class RecordingTokenizer(CharTokenizer):
    """Notes every document it tokenizes: the documents that entered a rank's token stream."""

    def __init__(self):
        self.seen = []

    def encode(self, text, add_bos=False, add_eos=False):
        self.seen.append(text)
        return super().encode(text, add_bos, add_eos)


def loader(path, rank, world, tokenizer, saved_degree=None, document_mask=False):
    from titan_ext.data.text_stream import StreamDataloader

    dataset = StreamedTextDataset(path, tokenizer, 16, rank, world, shuffle_buffer=5, seed=3, infinite=False,
                                  document_mask=document_mask)
    return StreamDataloader(dataset, dp_rank=rank, dp_world_size=world, saved_degree=saved_degree, batch_size=2)


# fewer ranks after (from more ranks than files) and more after (from one file), each format once
@pytest.mark.parametrize("fmt,files,before,after", [("parquet", 3, 4, 2), ("jsonl", 1, 2, 3)])
def test_resuming_on_another_number_of_ranks_reads_every_document_once(tmp_path, fmt, files, before, after):
    """``before`` ranks train a few steps and checkpoint (DCP, as torchtitan saves the dataloader); ``after``
    ranks resume from it and read to the end: across both runs every document entered exactly one rank's token
    stream exactly once (by document text, unique per document), shuffle buffers and partial windows included."""
    import torch.distributed.checkpoint as dcp

    folder = str(write_shards(tmp_path / "d", fmt, shards=files))
    seen, saved = [], {}
    for rank in range(before):
        tokenizer = RecordingTokenizer()
        data = loader(folder, rank, before, tokenizer, document_mask=True)
        batches = iter(data)
        for _ in range(3 + rank):  # ranks stop at different points of their streams
            next(batches)
        saved.update(data.state_dict())
        seen += tokenizer.seen
    dcp.save({"dataloader": saved}, checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
    for rank in range(after):
        tokenizer = RecordingTokenizer()
        data = loader(folder, rank, after, tokenizer, saved_degree=before, document_mask=True)
        template = {"dataloader": data.state_dict()}
        assert sorted(template["dataloader"]) == sorted([f"dp_rank_{r}" for r in range(before)] + ["world_size"])
        dcp.load(template, checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
        data.load_state_dict(template["dataloader"])
        for _ in data:
            pass
        seen += tokenizer.seen
        assert list(data.state_dict()) == [f"dp_rank_{rank}", "world_size"]  # later saves: its own position
    assert sorted(seen) == sorted(DOCS), (len(seen), len(set(seen)), len(DOCS))


def test_the_resumed_shuffle_is_deterministic(tmp_path):
    folder = str(write_shards(tmp_path / "d", "jsonl"))
    old = []
    for rank in range(2):
        dataset = StreamedTextDataset(folder, CharTokenizer(), 16, rank, 2, shuffle_buffer=5, seed=3, infinite=False)
        windows = iter(dataset)
        next(windows)
        old.append(dataset.state_dict())

    def resumed():
        dataset = StreamedTextDataset(folder, RecordingTokenizer(), 16, 0, 1, shuffle_buffer=5, seed=3, infinite=False)
        dataset.load_resharded(old)
        list(dataset)
        return dataset.tokenizer.seen

    assert resumed() == resumed()


def test_a_jobs_close_ends_its_dataloader_worker_while_the_loop_still_holds_its_iterator(tmp_path):
    """torchdata keeps a dataloader's last iterator: without ``Trainer.close`` ending it, the worker forked in
    a process that runs jobs one after another outlived its job (``titan_ext.data.ending_dataloader_workers``)."""
    import os
    import types

    from titan_ext.data import ending_dataloader_workers

    loader = loader_of(str(write_shards(tmp_path / "d", "parquet")), 1)
    batches = iter(loader)  # what the training loop's frame (or a traceback) holds
    next(batches)
    workers = [w.pid for w in loader._iterator._workers]
    trainer = types.SimpleNamespace(dataloader=loader, closed=[])
    trainer.close = types.MethodType(lambda self: self.closed.append(True), trainer)
    ending_dataloader_workers(trainer.close)()
    assert trainer.closed == [True] and workers
    for pid in workers:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{pid}") else "gone"
        assert state in ("Z", "gone"), (pid, state)
    del batches
