"""Context parallelism: two real gloo ranks against one process, and (over a fake 2-rank group, whose
collectives do nothing) what one rank sends and keeps. Training over 5 steps is the integration
matrix's (``cp2*`` rows); the state exchange alone is ``test_state_passing.py``'s."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from helpers import on_forked_ranks, plan_forward

from titan_ext import compat
from titan_ext.job_plan import CPChoice
from titan_ext.kernels.state_passing import piece_order
from titan_ext.models.adapter import build_model
from titan_ext.models.args import transformers_model
from titan_ext.models.gla import gla_flavors
from titan_ext.parallel.context_parallel import apply_cp



def gla(layers=2, short_conv=False):
    args = copy.deepcopy(gla_flavors["debugmodel"])
    args.config["num_hidden_layers"] = layers
    args.config["use_short_conv"] = short_conv
    torch.manual_seed(0)
    model = build_model(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("pieces_per_rank", [1, 2])
def test_each_gla_layer_sends_one_all_gather_of_its_states(cp_mesh, pieces_per_rank, monkeypatch):
    model = gla(layers=3)
    choice = CPChoice(2, pieces_per_rank)
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    B, T = 2, 128
    tokens = torch.randint(0, 2048, (B, T))
    sent = []
    gather = compat.all_gather_autograd
    monkeypatch.setattr(compat, "all_gather_autograd", lambda t, group: sent.append(t.nbytes) or gather(t, group))
    with CommDebugMode() as comm:
        logits = model(tokens)
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d_functional.all_gather_into_tensor": 3}, counts  # one per layer, nothing else
    H, K, V = 4, 32 // 4, 64 // 4  # debug GLA: 4 heads, key dim 32, value dim 64
    assert sent == [pieces_per_rank * B * H * K * (V + 1) * 4] * 3  # fp32 states and decays of this rank's pieces
    print(f"\nCP=2, {pieces_per_rank} piece(s) per rank, batch {B}: each layer all-gathers {sent[0]} bytes per rank")
    with CommDebugMode() as comm:
        logits.float().sum().backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d_functional.reduce_scatter_tensor": 3}, counts  # the all-gathers' backward


def saved_bytes(model, tokens) -> int:
    """Bytes autograd keeps for backward during one forward: the activation memory of a step."""
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens).float().sum()
    return total


def test_activation_memory_per_rank_halves_under_cp2(cp_mesh):
    T = 16384
    tokens = torch.randint(0, 2048, (1, T))
    whole = saved_bytes(gla(), tokens)
    model = gla()
    choice = CPChoice(2, 1)
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    piece = saved_bytes(model, tokens[:, : T // 2])  # what one CP rank holds
    ratio = piece / whole
    print(f"\nGLA debug model, {T} tokens: activations saved per rank {piece / 2**20:.1f} MiB under CP=2 "
          f"vs {whole / 2**20:.1f} MiB at CP=1 (ratio {ratio:.3f})")
    assert 0.45 < ratio < 0.6  # half, plus the exchanged states


def test_a_bound_model_is_the_only_holder_of_its_layout(cp_mesh):
    """The CP bindings' classes hold the job's layout and group: once the blocks have them, the binding cache
    keeps none, and the rest of the process (the next job, a benchmark's next row) none of the job's group."""
    import gc
    import weakref

    from titan_ext.kernels import binding

    model = gla()
    choice = CPChoice(2, 1)
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    layout = weakref.ref(model.forward_plan.cp_layout)
    assert not any(key.startswith("context_parallel:") for _, key in binding._bound_classes)
    model(torch.randint(0, 2048, (2, 128)))
    del model
    gc.collect()
    assert layout() is None


def test_short_convolutions_take_their_halo_in_one_all_gather_each(cp_mesh):
    model = gla(layers=2, short_conv=True)
    choice = CPChoice(2, 1)
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    with CommDebugMode() as comm:
        model(torch.randint(0, 2048, (2, 128)))
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    # per layer: the GLA state, and the last 3 inputs of each of the q, k and v convolutions
    assert counts == {"c10d_functional.all_gather_into_tensor": 2 * (1 + 3)}, counts


@pytest.mark.parametrize("with_documents", [False, True])
def test_gated_deltanet_layer_sends_its_state_map_and_conv_halo_once(cp_mesh, with_documents, monkeypatch):
    """Gated DeltaNet: one all-gather of each piece's [F | M] (its final state and its K x K state map) and one
    of the fused q/k/v convolution's halo per layer. Packed documents add none of their own (on packed input
    fla convolves q, k and v one by one: a halo each)."""
    from titan_ext.models.gated_deltanet import gated_deltanet_flavors

    torch.manual_seed(0)
    model = build_model(copy.deepcopy(gated_deltanet_flavors["debugmodel"]))
    model.init_weights()
    choice = CPChoice(2, 1)
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    B, T = 2, 128
    extra = {"positions": torch.arange(T, 2 * T).expand(B, T)}  # rank 1's piece
    if with_documents:
        extra["document_positions"] = (torch.arange(2 * T) % 50).expand(B, 2 * T)
    sent = []
    gather = compat.all_gather_autograd
    monkeypatch.setattr(compat, "all_gather_autograd", lambda t, group: sent.append(t.shape) or gather(t, group))
    with CommDebugMode() as comm:
        model(torch.randint(0, 2048, (B, T)), **extra)
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    HV, K, V = 4, 16, 32  # debug Gated DeltaNet: 4 heads, head dim 16, values expanded 2x
    # one piece per rank: the last 3 inputs of q, k and v (together, or one by one), its final state and state map
    convs = [(1, B, 3, HV * K), (1, B, 3, HV * K), (1, B, 3, HV * V)] if with_documents else [(1, B, 3, 2 * HV * K + HV * V)]
    state = (1, B, HV, K, V + K)
    assert counts == {"c10d_functional.all_gather_into_tensor": 2 * (len(convs) + 1)}, counts
    assert sent == (convs + [state]) * 2, sent


MLA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
       "v_head_dim": 12, "first_k_dense_replace": 2, "vocab_size": 2048, "max_position_embeddings": 512}
"""A dense DeepSeek-V3 (MLA in both layers: q and kv latents, interleaved rotary dims, values narrower than
queries and keys), the integration matrix's ``hf_deepseek_v3``."""


def test_mla_under_masked_cp_all_gathers_its_latents_not_its_keys_and_values(cp_mesh, monkeypatch):
    """MLA with documents: one all-gather per layer of this rank's compressed keys and values (the latent's
    ``kv_lora_rank`` dims and the rotary key every head shares, per token), which each rank expands to its
    heads itself; never the heads' keys and values (here 4 x (16 + 8 + 12) dims per token, not 16 + 8). Its
    backward: one reduce-scatter of the latents' gradients per layer."""
    torch.manual_seed(0)
    model = build_model(transformers_model("deepseek_v3", **MLA))
    model.init_weights()
    choice = CPChoice(2, 2, masked_attention="--titan_ext.document_mask")
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    B, T = 2, 64
    sent = []
    gather = compat.all_gather_autograd
    monkeypatch.setattr(compat, "all_gather_autograd", lambda t, group, **kw: sent.append(t.shape) or gather(t, group, **kw))
    mine = torch.cat([torch.arange(p * 32, (p + 1) * 32) for p in piece_order(1, 2, 2)])  # rank 1's head-tail pieces
    with CommDebugMode() as comm:
        out = model(torch.randint(0, 2048, (B, T)), positions=mine.expand(B, T),
                    document_positions=(torch.arange(2 * T) % 50).expand(B, 2 * T))
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d_functional.all_gather_into_tensor": 2}, counts  # one per layer, nothing else
    assert sent == [(B, 1, T, 16 + 8)] * 2, sent
    with CommDebugMode() as comm:
        out.float().sum().backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d_functional.reduce_scatter_tensor": 2}, counts


@pytest.mark.parametrize("model_type,named,unnamed", [
    ("qwen3_5_text", "attention over all-gathered keys and values", "MLA"),
    ("deepseek_v3", "MLA's over all-gathered latents", "attention over all-gathered keys and values"),
])
def test_masked_cp_logs_the_paths_of_the_models_own_mixers(cp_mesh, caplog, model_type, named, unnamed):
    """A log line names the paths that run: Qwen3.5 has no MLA, a dense DeepSeek-V3 nothing but MLA."""
    import logging

    from test_hybrids import QWEN3_5

    config = {**QWEN3_5, "vocab_size": 2048} if model_type == "qwen3_5_text" else MLA
    model = build_model(transformers_model(model_type, **config))
    with caplog.at_level(logging.INFO):
        choice = CPChoice(2, 1, masked_attention="--titan_ext.document_mask")
        apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    (line,) = [r.getMessage() for r in caplog.records if "masked beyond causality" in r.getMessage()]
    assert named in line and unnamed not in line, line


CASES = [("fla_gla", 1, 1e-5), ("fla_gla", 2, 1e-5), ("hf_llama", 2, 1e-12), ("hf_llama+alltoall", 1, 1e-12),
         ("fla_transformer", 1, 1e-12), ("fla_transformer+alltoall", 2, 1e-12),
         ("fla_transformer+window", 2, 1e-12), ("fla_gated_deltanet", 2, 1e-12),
         ("fla_gla+docs", 2, 1e-5), ("fla_gated_deltanet+docs", 1, 1e-12), ("hf_llama+docs", 1, 1e-12),
         ("fla_transformer+docs", 2, 1e-12), ("fla_transformer+window+docs", 1, 1e-12),
         ("fla_gated_deltanet_hybrid", 2, 1e-12), ("fla_gla_hybrid+docs", 1, 1e-5), ("hf_qwen3_5", 2, 1e-6),
         ("hf_qwen3_5+docs", 1, 1e-6), ("hf_deepseek_v3+docs", 2, 1e-12)]
"""(spec, pieces per rank, tolerance): GLA with short convolutions in fp32 (fla takes fp32 states);
Gated DeltaNet (its q/k/v convolution fused), Llama and the fla transformer in fp64: torch's ring
attention (rotating keys and values by all-gather, or ``+alltoall`` rank to rank), or with a sliding
window or ``+docs`` (packed documents, document masking on both sides) all-gathered keys and values.
``_hybrid``: layer 1 is fla's softmax Attention (fla's ``attn`` config), on the same CP mesh as layer 0's
state passing; ``hf_qwen3_5``: transformers' Gated DeltaNet (layer 0) and gated attention (layer 1), in fp64 but
for its RMSNorms, which compute in fp32 (their weights' gradients, summed over other tokens per rank, differ
by ~1e-7; every other gradient by 1e-12); ``hf_deepseek_v3+docs``: MLA's latents all-gathered and expanded on each rank.
Each spec runs with contiguous pieces (1 per rank) and head-tail ones (2) in one case or another."""

DOCUMENT_STARTS = [0, 13, 40, 41, 80, 100, 150]
"""In a row of 160: across the pieces of 40 and 80, one at a piece start, a 1-token document."""


def _two_ranks(rank, mesh):
    """One of two gloo ranks: each case's model under CP=2 on this rank's pieces vs one process on the whole batch."""
    from titan_ext.host import cpu_patches

    cpu_patches.apply_cpu_mode()  # torch's ring on the CPU (this forked rank's own copy of torch)
    compat.torch_cp_options()._cp_options.convert_to_f32 = False  # the ring merges fp64 blocks in fp64
    from titan_ext.kernels import cp_attention

    cp_attention.QUERY_BLOCK = 16  # documents of up to 50 tokens: per-document attention in several query blocks
    results = {}
    for spec, pieces_per_rank, _ in CASES:
        torch.set_default_dtype(torch.float32 if spec.startswith("fla_gla") else torch.float64)
        results[spec, pieces_per_rank] = _compare(spec, pieces_per_rank, rank, mesh)
    return results


def _compare(spec, pieces_per_rank, rank, mesh):
    name = spec.split("+")[0]
    if name == "hf_llama":
        from titan_ext.models.llama import llama_flavors

        args = copy.deepcopy(llama_flavors["debugmodel"])
    elif name == "fla_transformer":
        from titan_ext.models.transformer import transformer_flavors

        args = copy.deepcopy(transformer_flavors["debugmodel"])
        args.config["window_size"] = 24 if "+window" in spec else None  # reaches across pieces of 40
    elif name == "hf_deepseek_v3":
        args = transformers_model("deepseek_v3", **MLA)
    elif name == "hf_qwen3_5":
        from test_hybrids import QWEN3_5

        args = transformers_model("qwen3_5_text", **{**QWEN3_5, "vocab_size": 2048})
    elif name.startswith("fla_gated_deltanet"):
        from titan_ext.models.gated_deltanet import gated_deltanet_flavors

        args = copy.deepcopy(gated_deltanet_flavors["debugmodel"])
    else:
        args = copy.deepcopy(gla_flavors["debugmodel"])
        args.config["use_short_conv"] = True
    if name.endswith("_hybrid"):
        args.config["attn"] = {"layers": [1], "num_heads": 4, "num_kv_heads": 2}
    torch.manual_seed(0)
    whole = build_model(args)
    whole.init_weights()
    whole.to(torch.get_default_dtype())  # also the parameters fla keeps in fp32 (Gated DeltaNet's A_log)
    model = copy.deepcopy(whole)
    masks = [mask for mask in ("+window", "+docs") if mask in spec]
    rotate = "alltoall" if "+alltoall" in spec else "allgather"
    choice = CPChoice(2, pieces_per_rank, masked_attention=", ".join(masks) or None, rotate_method=rotate)
    apply_cp(model, mesh, choice, plan_forward(model, cp=choice, cp_mesh=mesh).cp_layout)
    compat.torch_cp_options()._cp_options.enable_load_balance = pieces_per_rank > 1  # as torchtitan's input sharding
    tokens = torch.randint(0, 2048, (2, 160), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(160).expand(2, 160)
    extra = {}
    if spec.endswith("+docs"):  # row 1's documents start 9 tokens later than row 0's
        starts = torch.zeros(2, 160, dtype=torch.bool)
        starts[0, DOCUMENT_STARTS] = True
        starts[1, [0] + [s + 9 for s in DOCUMENT_STARTS[1:]]] = True
        index = torch.arange(160).expand(2, 160)
        extra["document_positions"] = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    size = 160 // (2 * pieces_per_rank)
    mine = torch.cat([torch.arange(p * size, (p + 1) * size) for p in piece_order(rank, 2, pieces_per_rank)])
    whole(tokens, **extra).sum().backward()
    out = model(tokens[:, mine], positions=positions[:, mine], **extra)
    out.sum().backward()
    worst = 0.0
    for p, q in zip(model.parameters(), whole.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # FSDP's sum over the CP ranks
        worst = max(worst, ((grad - q.grad).norm() / q.grad.norm()).item())
    with torch.no_grad():
        forward = ((out - whole(tokens, **extra)[:, mine]).norm() / out.norm()).item()
    return forward, worst


def test_two_ranks_equal_one_process():
    """Logits and summed gradients of CP=2 on real gloo ranks equal one process over the whole sequence,
    for contiguous and head-tail pieces."""
    results = on_forked_ranks(2, _two_ranks)
    for spec, pieces_per_rank, tol in CASES:
        for rank in (0, 1):
            forward, grads = results[rank][spec, pieces_per_rank]
            print(spec, pieces_per_rank, rank, f"{forward:.1e} {grads:.1e}")
    for spec, pieces_per_rank, tol in CASES:
        for rank in (0, 1):
            forward, grads = results[rank][spec, pieces_per_rank]
            assert forward <= tol and grads <= tol, (spec, pieces_per_rank, rank, forward, grads)


@pytest.fixture
def ring_on_cpu():
    """torch's ring attention with titan_ext's CPU handlers (``host.cpu_patches.CPU_MODE``), in this process only
    for the test; torch's CP dispatcher (turned on by ``apply_cp``) is turned off after it."""
    from torch.distributed.tensor.experimental._attention import _disable_context_parallel_dispatcher

    from titan_ext.host import cpu_patches

    undo = next(p for p in cpu_patches.CPU_MODE if p.target.endswith(":custom_ops")).apply()
    options = compat.torch_cp_options()._cp_options
    saved = (options.enable_load_balance, options.rotate_method)
    try:
        yield options
    finally:
        _disable_context_parallel_dispatcher()
        options.enable_load_balance, options.rotate_method = saved
        undo()


@pytest.mark.parametrize("pieces_per_rank", [1, 2])
def test_ring_attention_passes_each_layers_keys_and_values_once(cp_mesh, ring_on_cpu, pieces_per_rank, monkeypatch):
    """Llama under CP: torch's ring (``allgather`` rotation) all-gathers each layer's local keys and values
    in one buffer; nothing else is sent in the forward."""
    from torch.distributed import _functional_collectives as funcol

    from titan_ext.models.llama import llama_flavors

    sent, depth = [], [0]  # what the ring sends, through the functional collectives torch's rotaters call

    def counted(name, collective):
        def send(tensor, *args, **kwargs):  # the outermost call only: one collective may call another
            if depth[0] == 0:
                sent.append(("all_gather" if name.startswith("all_gather") else name, tensor.nbytes))
            depth[0] += 1
            try:
                return collective(tensor, *args, **kwargs)
            finally:
                depth[0] -= 1
        return send

    # torch 2.13's allgather rotater calls all_gather_single, torch 2.11's all_gather_tensor
    for name in ("all_gather_single", "all_gather_tensor", "permute_tensor", "all_gather_tensor_autograd"):
        if hasattr(funcol, name):
            monkeypatch.setattr(funcol, name, counted(name, getattr(funcol, name)))

    torch.manual_seed(0)
    model = build_model(copy.deepcopy(llama_flavors["debugmodel"]))
    model.init_weights()
    choice = CPChoice(2, pieces_per_rank)
    apply_cp(model, cp_mesh, choice, plan_forward(model, cp=choice, cp_mesh=cp_mesh).cp_layout)
    ring_on_cpu.enable_load_balance = pieces_per_rank > 1  # as torchtitan's input sharding sets it
    B, T = 2, 64
    # (not CommDebugMode: its module tracker loses its place around the hooks torch's CP puts on RingSDPA)
    model(torch.randint(0, 2048, (B, T)), positions=torch.arange(T, 2 * T).expand(B, T))
    H, D = 4, 64 // 4  # debug Llama: 4 query heads (2 key/value heads, repeated for the ring), head dim 16
    assert sent == [("all_gather", 2 * B * H * T * D * 4)] * 2, sent  # keys and values, one buffer per layer
    print(f"\nring attention, batch {B}, {T} local tokens: each layer all-gathers {sent[0][1]} bytes per rank")


@pytest.mark.parametrize("config,flags,masked", [
    ("debug_llama.toml", [], None),
    ("debug_llama.toml", ["--parallelism.context_parallel_rotate_method", "alltoall"], None),
    ("debug_llama.toml", ["--titan_ext.document_mask"], "--titan_ext.document_mask"),
    ("debug_transformer.toml", ["--titan_ext.hf_config", "{window}"], "window_size=64"),
])
def test_attention_takes_the_ring_unless_masked(tmp_path, monkeypatch, config, flags, masked):
    """The job plan: torch's ring for causal attention; all-gathered keys where a mask does more."""
    from helpers import REPO, job_config
    from torchtitan.protocols.train_spec import get_train_spec


    (tmp_path / "window.json").write_text('{"window_size": 64}')
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = [f.replace("{window}", str(tmp_path / "window.json")) for f in flags]
    config = job_config(*flags, "--parallelism.context_parallel_degree", "2",
                        "--parallelism.data_parallel_shard_degree", "1", config_file=REPO / "train_configs" / config)
    args = get_train_spec(config.model.name).model_args[config.model.flavor]
    args.update_from_config(config)
    choice = args.plan.cp
    assert choice.masked_attention == masked
    assert choice.rotate_method == ("alltoall" if "alltoall" in flags else "allgather")


def test_a_sliding_window_alone_attends_in_blocks_without_a_sequence_wide_mask(monkeypatch):
    """A window without documents: each block of queries over the keys the window reaches, equal (fp64) to one
    masked SDPA over the whole row, and no mask wider than a block plus the window (issue 41)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from titan_ext.kernels import cp_attention

    B, H, D, T, window, block = 2, 2, 8, 64, 6, 4
    g = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    positions = torch.cat([torch.arange(0, 16), torch.arange(48, 64)]).expand(B, -1)  # rank 0's head-tail pieces
    distance = positions[:, None, :, None] - torch.arange(T)[None, None, None, :]
    want = F.scaled_dot_product_attention(query[:, :, positions[0]], keys, values,
                                          attn_mask=(distance >= 0) & (distance < window))
    sdpa, masks = F.scaled_dot_product_attention, []

    def recording(q, k, v, attn_mask=None, **kwargs):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(cp_attention, "QUERY_BLOCK", block)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    layout = SimpleNamespace(positions=positions, document_positions=None)
    got = cp_attention.per_document_sdpa(query[:, :, positions[0]], keys, values, layout, window=window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(masks) == B * 32 // block and all(m is None or m[-1] <= block + window - 1 for m in masks), masks
