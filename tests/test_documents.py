"""Document masking: a packed window trains exactly as its documents one by one, compiled without recompiles."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import plan_forward
from test_text_stream import CharTokenizer, write_shards
from torch._dynamo.utils import counters

from titan_ext.data import documents
from titan_ext.data.text_stream import StreamedTextDataset
from titan_ext.models.adapter import build_model
from titan_ext.models.gated_deltanet import gated_deltanet_flavors
from titan_ext.models.gla import gla_flavors
from titan_ext.models.llama import llama_flavors
from titan_ext.models.packing import cu_seqlens
from titan_ext.models.transformer import transformer_flavors
from titan_ext.parallel.compile import apply_compile

FLAVORS = {"fla_gla": gla_flavors, "fla_gated_deltanet": gated_deltanet_flavors, "fla_transformer": transformer_flavors,
           "hf_llama": llama_flavors}
MODELS = [*FLAVORS, "fla_gla+short_conv", "hf_llama+document_attention", "fla_gla+hybrid"]
"""GLA with short convolutions: they too must stop at boundaries. Llama with its attention run per document
(``documents.apply_document_attention``, what a job with document masking runs) as well as with the
block-causal mask. A GLA hybrid (fla's softmax Attention at layer 1): both mixers keep documents apart."""


def debug_model(name: str):
    spec, _, extra = name.partition("+")
    args = copy.deepcopy(FLAVORS[spec]["debugmodel"])
    if extra == "short_conv":
        args.config["use_short_conv"] = True
    if extra == "hybrid":
        args.config["attn"] = {"layers": [1], "num_heads": 4, "num_kv_heads": 2}
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    if extra == "document_attention":
        assert plan_forward(model, document_mask=True).document_attention
        documents.apply_document_attention(model)
    return model
# two windows of 64 + 1 tokens, each exactly whole documents (a 1-token document too)
DOCUMENT_LENGTHS = [[7, 30, 1, 27], [40, 2, 23]]


def test_window_sample_marks_boundaries():
    window = torch.arange(10, 20)
    inputs, labels = documents.window_sample(window, [2, 6, 7])  # the window begins mid-document
    assert inputs["input"].tolist() == list(range(10, 19))
    assert inputs["document_positions"].tolist() == [0, 1, 0, 1, 2, 3, 0, 0, 1]
    # labels that would cross into the next document are ignored: tokens 11, 15 and 16 end documents
    assert labels.tolist() == [11, -100, 13, 14, 15, -100, -100, 18, 19]


def test_cu_seqlens_flattens_the_batch():
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]])
    assert cu_seqlens(positions).tolist() == [0, 3, 5, 6, 10]
    assert cu_seqlens(positions).dtype == torch.int32


def packed_batch(vocab: int, seed: int = 0):
    """Documents, and the batch the dataloader packs from them (positions and labels from ``window_sample``)."""
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(3, vocab, (n,), generator=g) for n in row] for row in DOCUMENT_LENGTHS]
    samples = []
    for row in docs:
        window = torch.cat(row)
        starts = torch.tensor([len(d) for d in row]).cumsum(0)[:-1].tolist()
        samples.append(documents.window_sample(window, [0, *starts]))
    batch = {key: torch.stack([s[0][key] for s in samples]) for key in ("input", "document_positions")}
    return [d for row in docs for d in row], batch, torch.stack([s[1] for s in samples])


def loss_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction="sum", ignore_index=-100)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("spec", MODELS)
def test_packed_documents_train_as_the_documents_one_by_one(spec):
    model = debug_model(spec).double()
    docs, batch, labels = packed_batch(model.config.vocab_size)

    packed = loss_sum(model(batch["input"], document_positions=batch["document_positions"]), labels)
    packed.backward()
    packed_grads = grads(model)

    model.zero_grad()
    alone = sum(loss_sum(model(doc[None, :-1]), doc[None, 1:]) for doc in docs if len(doc) > 1)
    alone.backward()
    for name, grad in grads(model).items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-6, atol=1e-12, msg=name)
    assert abs(packed.item() - alone.item()) <= 1e-6 * abs(alone.item())

    # the control: without the boundaries each row is one sequence, and later documents see earlier ones
    with torch.no_grad():
        leak = (model(batch["input"]) - model(batch["input"], document_positions=batch["document_positions"])).abs().max().item()
    assert leak > 1e-6, leak  # fp64 rounding is ~1e-14


COMPILED = [spec for spec in MODELS if spec not in ("fla_gla", "fla_transformer")]
"""The hybrid compiles GLA's layer and fla's Attention (the fla transformer's) in one model."""


@pytest.mark.parametrize("spec", COMPILED)
def test_compiled_blocks_do_not_recompile_as_the_document_count_changes(spec):
    model = debug_model(spec)
    apply_compile(model, "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    B, T = 2, 96

    def step(documents_per_row):
        positions = torch.empty(B, T, dtype=torch.long)
        for b in range(B):
            cuts = (torch.randperm(T - 1, generator=g)[: documents_per_row - 1] + 1).sort().values.tolist()
            positions[b] = torch.cat([torch.arange(end - start) for start, end in zip([0, *cuts], [*cuts, T])])
        tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
        model(tokens, document_positions=positions).float().logsumexp(-1).mean().backward()

    # fla's transformer fills its rotary cache lazily in step 1: one recompile at step 2 (test_ac_compile.py)
    warmup = 2 if spec in ("fla_transformer", "fla_gla+hybrid") else 1  # the hybrid: its attention layer
    for count in (3, 5)[:warmup]:
        step(count)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for count in (1, 2, 7, 4):
            step(count)
    assert counters["frames"]["ok"] == counters["frames"]["total"]


def test_streamed_windows_carry_positions_and_resume_with_them(tmp_path):
    folder = str(write_shards(tmp_path / "d", "jsonl"))

    def dataset(mask=True):
        return StreamedTextDataset(folder, CharTokenizer(), 32, 0, 1, shuffle_buffer=4, seed=1, document_mask=mask)

    it = iter(dataset())
    batches = [next(it) for _ in range(12)]
    for inputs, labels in batches:
        x, positions = inputs["input"], inputs["document_positions"]
        assert (positions[x == 1] == 0).all(), "every BOS starts a document"
        assert (positions[1:] - positions[:-1])[x[1:] != 1].eq(1).all(), "positions count up inside a document"
        assert not (labels == 1).any(), "no label asks for the next document's BOS"
        assert (labels == -100).sum() == (x[1:] == 1).sum() + (labels[-1] == -100)
    assert sum(int((x["document_positions"] == 0).sum()) for x, _ in batches) > 1.5 * len(batches)  # documents inside windows
    assert "document_positions" not in next(iter(dataset(mask=False)))[0]

    first = dataset()
    it = iter(first)
    for _ in range(5):
        next(it)
    resumed = dataset()
    resumed.load_state_dict(first.state_dict())
    again = iter(resumed)
    for inputs, labels in batches[5:]:
        got_inputs, got_labels = next(again)
        assert torch.equal(got_inputs["document_positions"], inputs["document_positions"]) and torch.equal(got_labels, labels)


def test_an_attention_that_does_not_read_the_registry_stops_the_job():
    """Per-document attention is put where transformers' attention modules look their function up; one that
    looks elsewhere would let documents attend to each other: the job stops in one line."""
    import types

    import torch.nn as nn

    from titan_ext.errors import HostChanged
    from titan_ext.models import mixers

    block = nn.Module()
    block.self_attn = nn.Linear(4, 4)  # its forward reads no attention registry
    model = nn.Module()
    model.arch = types.SimpleNamespace(packed_layout="position_ids")
    model.config = types.SimpleNamespace(_attn_implementation="sdpa")
    model.blocks = lambda: nn.ModuleList([block])
    model.mixers = (mixers.TransformersAttention("self_attn", block.self_attn),)
    with pytest.raises(HostChanged, match="Linear.forward does not read ALL_ATTENTION_FUNCTIONS"):
        documents.apply_document_attention(model)


def test_per_document_attention_is_decided_for_a_transformers_model_with_document_masking_only():
    """``decide_forward``: fla models take ``cu_seqlens`` as they are; a transformers model's attention runs each
    document alone only when the job masks documents (outside CP, whose attention masks them itself)."""
    llama, gla = debug_model("hf_llama"), debug_model("fla_gla")
    assert plan_forward(llama, document_mask=True).document_attention
    assert not plan_forward(llama).document_attention
    assert not plan_forward(gla, document_mask=True).document_attention
