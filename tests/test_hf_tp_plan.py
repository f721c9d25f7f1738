"""TP plans translated from a transformers model's own ``base_model_tp_plan`` (``model_plans.hf_plan``).

The translation of Llama's plan equals one written by hand (the transformers attention mixer's own entries and
``TPPlan``'s gated MLP); on a fake 2-rank group
(see tests/test_tp_plans.py) one block of Qwen3 (per-head q/k norms), Qwen2 (q/k/v biases) and
Gemma3 (four residual norms, two of them on module outputs) issues the Megatron minimum and every
parameter trains as a DTensor; on 2 real gloo ranks the loss, gradients and AdamW steps equal one
process's.
"""

import copy
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import on_forked_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from model_plans.apply import apply_tp, resolve
from model_plans.base import IfPresent, TPOptions, TPPlan
from model_plans.hf_plan import HFTPPlan, hf_plan_class
from model_plans.validate import validate_tp

TP = 2
SEQ = 16
VOCAB = 128


def tiny_config(model_type, **overrides):
    from transformers import AutoConfig

    base = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=VOCAB, tie_word_embeddings=False, attn_implementation="sdpa")
    return AutoConfig.for_model(model_type, **{**base, **overrides})


def build(model_type, device="cpu", **overrides):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))


OPTIONS = {"sp": TPOptions(sequence_parallel=True), "no_sp": TPOptions(sequence_parallel=False, loss_parallel=False)}


# ---- the translation ------------------------------------------------------------------------------


def describe(style):
    """A style's type and layouts, comparable across instances."""
    fields = ("input_layouts", "output_layouts", "desired_input_layouts", "input_kwarg_layouts",
              "desired_input_kwarg_layouts", "with_kwargs", "use_local_output", "layout")
    return type(style), {f: getattr(style, f) for f in fields if hasattr(style, f)}


def described(plan, root):
    return {fqn: describe(style) for fqn, style in resolve(plan, root).items()}


class LlamaTPPlan(TPPlan):
    """Llama's plan by hand: HF names, the attention mixer's own entries, ``TPPlan``'s gated MLP."""

    embeddings = "model.embed_tokens"
    attn_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"

    def attn_plan(self):
        from titan_ext.models.mixers import TransformersAttention

        return TransformersAttention("self_attn").tp_entries(self)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_translated_llama_plan_equals_the_hand_written_one(options):
    model = build("llama", "meta")
    translated, hand_written = hf_plan_class(model)(OPTIONS[options]), LlamaTPPlan(OPTIONS[options])
    assert type(translated).__qualname__ == "LlamaHFTPPlan" and isinstance(translated, HFTPPlan)
    for attribute in ("embeddings", "final_norm", "lm_head", "layers"):
        assert getattr(translated, attribute) == getattr(hand_written, attribute), attribute
    assert described(translated.model_plan(), model) == described(hand_written.model_plan(), model)
    block = model.model.layers[0]
    mine, theirs = described(translated.block_plan(), block), described(hand_written.block_plan(), block)
    assert mine == theirs
    # attention takes hidden_states= by keyword, the MLP positionally (read from the decoder layer's source)
    assert mine["self_attn"][1]["input_kwarg_layouts"] and not mine["mlp"][1]["with_kwargs"]


def test_gemma3_layout_translates_with_four_residual_norms():
    plan = hf_plan_class(build("gemma3_text", "meta"))()
    roles = {module: entry.role for module, entry in plan.entries}
    assert type(plan).__qualname__ == "Gemma3TextHFTPPlan"
    assert roles == {
        "self_attn": "gather", "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise", "self_attn.o_proj": "rowwise", "self_attn.q_norm": "head_norm",
        "self_attn.k_norm": "head_norm", "mlp": "gather", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise", "input_layernorm": "residual_norm", "post_attention_layernorm": "residual_norm",
        "pre_feedforward_layernorm": "residual_norm", "post_feedforward_layernorm": "residual_norm",
    }
    head_norm = plan.block_plan()["self_attn.q_norm"]
    assert head_norm.layout.is_shard(-2) and head_norm.use_local_output


def test_a_module_only_some_blocks_have_is_optional():
    model = build("qwen3", "meta", num_hidden_layers=2)
    del model.model.layers[1].self_attn.q_norm
    plan = hf_plan_class(model)()
    assert plan.optional == {"self_attn.q_norm"}
    assert isinstance(plan.block_plan()["self_attn.q_norm"], IfPresent)
    assert not isinstance(plan.block_plan()["self_attn.k_norm"], IfPresent)


# ---- bad input ------------------------------------------------------------------------------------


def qwen3_plan(**changes):
    from transformers import Qwen3Config

    plan = {k: v for k, v in {**Qwen3Config.base_model_tp_plan, **changes}.items() if v is not None}
    return {"base_model_tp_plan": plan}


def qwen2_moe_plan(**changes):
    from transformers import Qwen2MoeConfig

    plan = {k: v for k, v in {**Qwen2MoeConfig.base_model_tp_plan, **changes}.items() if v is not None}
    return {"base_model_tp_plan": plan}


@pytest.mark.parametrize(
    "model_type,overrides,expected",
    [
        # Qwen2-MoE's shared expert takes its dense FFN's entries (matrix hf_qwen2_moe/ep2_tp2): without a rowwise one
        ("qwen2_moe", qwen2_moe_plan(**{"layers.*.mlp.down_proj": None}), "qwen2_moe: HF TP strategy 'moe_tp_experts' "
         "on model.layers.*.mlp.experts has no titan_ext translation (its block holds ['shared_expert'] beside the "
         "experts and one router, which the HF plan does not place as a shared expert"),
        ("qwen3", qwen3_plan(**{"embed_tokens": "replicate"}), "HF TP strategy 'replicate' on model.embed_tokens"),
    ],
    ids=["shared_experts", "model_level"],
)
def test_an_untranslatable_plan_is_a_one_line_error_naming_it(model_type, overrides, expected):
    if model_type == "qwen2_moe":
        try:
            hf_plan_class(build(model_type, "meta"))
        except ValueError as shipped:  # before transformers 5.21 its Qwen2-MoE plan places no experts
            pytest.skip(f"this transformers' own plan is refused already: {shipped}")
    with pytest.raises(ValueError) as e:
        hf_plan_class(build(model_type, "meta", **overrides))
    message = str(e.value)
    assert expected in message and f"@model_plans.register_tp_plan('{model_type}')" in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    "model_type,overrides,whole",
    [
        ("qwen3", qwen3_plan(**{"layers.*.mlp.gate_proj": "colwise_gather_output"}), "mlp"),  # a strategy
        ("qwen3", qwen3_plan(**{"layers.*.mlp.down_proj": None}), "mlp"),  # colwise without a rowwise output
        ("cohere", {"use_qk_norm": True}, "self_attn"),  # per-head norms the HF plan leaves out
        ("qwen3", qwen3_plan(**{f"layers.*.mlp.{p}": None for p in ("gate_proj", "up_proj", "down_proj")}), "mlp"),
    ],
    ids=["block_strategy", "unpaired", "uncovered", "left_out"],
)
def test_a_block_module_the_plan_cannot_split_is_kept_whole(model_type, overrides, whole):
    """A module of a block whose HF entries do not translate, or that the HF plan leaves out, is kept whole on
    every rank (HF's own TP leaves it so); the block's other modules are split as their entries say."""
    model = build(model_type, "meta", **overrides)
    entries = dict(hf_plan_class(model).entries)
    assert entries[whole].role == "replicated" and not any(p.startswith(f"{whole}.") for p in entries)
    other = "self_attn" if whole == "mlp" else "mlp"
    assert entries[f"{other}.o_proj" if other == "self_attn" else f"{other}.down_proj"].role == "rowwise"
    validate_tp(model, hf_plan_class(model)(), 2, 64)


MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12,
       "num_key_value_heads": 4, "first_k_dense_replace": 2, "use_cache": False}
"""DeepSeek-V2's multi-head latent attention (dense MLPs in both layers; no cache, which would mix DTensors)."""


def test_mla_kv_a_proj_translates_to_what_the_mla_mixer_does():
    """HF's ``mla_kv_a_proj``: the key-latent projection replicated with its shared rotary key's gradient summed
    (``SharedKeyLatent``), the down-projections and norms the HF plan leaves out replicated, the input gathered in
    high precision; the up-projections colwise, o_proj rowwise, as ``models.mixers.mla`` lays out MLA."""
    plan_cls = hf_plan_class(build("deepseek_v2", "meta", **MLA))
    roles = {path: entry.role for path, entry in plan_cls.entries if path.startswith("self_attn")}
    assert roles == {"self_attn": "gather", "self_attn.q_a_proj": "latent_linear",
                     "self_attn.q_a_layernorm": "latent_norm", "self_attn.q_b_proj": "colwise",
                     "self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "self_attn.kv_a_layernorm": "latent_norm",
                     "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "rowwise"}
    assert dict(plan_cls.entries)["self_attn"].high_precision and plan_cls.rope_width == 8
    assert repr(plan_cls().block_plan(0)["self_attn.kv_a_proj_with_mqa"]) == "SharedKeyLatent(8)"


def test_a_model_without_an_hf_plan_keeps_its_blocks_whole_given_its_layers():
    model = build("qwen3", "meta", base_model_tp_plan={})
    assert hf_plan_class(model) is None
    entries = dict(hf_plan_class(model, layers="layers").entries)
    assert {p: e.role for p, e in entries.items()} == {"input_layernorm": "residual_norm", "self_attn": "replicated",
                                                      "post_attention_layernorm": "residual_norm", "mlp": "replicated"}


def test_the_gather_follows_how_the_block_passes_the_input():
    """Read from the most derived source that calls the module: a subclass's call overrides its base's."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    class ByKeyword(Qwen3DecoderLayer):
        def forward(self, hidden_states, **kwargs):
            return self.mlp(x=hidden_states)

    class Unknowable(Qwen3DecoderLayer):
        def forward(self, hidden_states, **kwargs):
            return self.mlp(**{"x": hidden_states})

    model = build("qwen3", "meta")
    model.model.layers[0].__class__ = ByKeyword
    assert dict(hf_plan_class(model).entries)["mlp"].keyword == "x"
    model.model.layers[0].__class__ = Unknowable
    with pytest.raises(ValueError, match=r"qwen3: cannot tell from Unknowable's source how it passes its input to "
                                         r"model\.layers\.\*\.mlp"):
        hf_plan_class(model)


def test_a_model_without_an_hf_plan_gets_none():
    assert hf_plan_class(build("qwen3", "meta", base_model_tp_plan={})) is None
    from fla.models import GLAConfig, GLAForCausalLM

    with torch.device("meta"):
        gla = GLAForCausalLM(GLAConfig(hidden_size=64, num_heads=4, num_hidden_layers=1, vocab_size=VOCAB))
    assert hf_plan_class(gla) is None


# ---- a fake 2-rank group --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield init_device_mesh("cpu", (TP,))
    dist.destroy_process_group()


FAKE_MODELS = ["qwen3", "qwen2", "gemma3_text"]


def block_collectives(model, plan):
    """The collectives the first block issues in a forward of the whole decoder."""
    block, seen = model.get_submodule(plan.layers)[0], {}
    with CommDebugMode() as comm:
        block.register_forward_pre_hook(lambda *_: seen.update(before=dict(comm.get_comm_counts())))
        block.register_forward_hook(lambda *_: seen.update(after=dict(comm.get_comm_counts())))
        model.model(input_ids=torch.randint(0, VOCAB, (2, SEQ)))
    counts = {str(op).split(".")[-1]: n - seen["before"].get(op, 0) for op, n in seen["after"].items()}
    return {op: n for op, n in counts.items() if n}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("model_type", FAKE_MODELS)
def test_one_block_issues_the_megatron_minimum(mesh, model_type, options):
    model = build(model_type)
    plan = hf_plan_class(model)(OPTIONS[options])
    apply_tp(model, mesh, plan)
    expected = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2} if options == "sp" else {"all_reduce": 2}
    assert block_collectives(model, plan) == expected


@pytest.mark.parametrize("model_type", FAKE_MODELS)
def test_every_parameter_becomes_a_dtensor_and_trains(mesh, model_type):
    """The plan class comes from the meta-device model, as in a job, and is checked there first.

    The fake group's collectives move no data (torch 2.11's leave gathered
    buffers uninitialized), so the loss's value means nothing here: the real
    two-rank tests below check the numbers.
    """
    meta = build(model_type, "meta", num_hidden_layers=2)
    plan_cls = hf_plan_class(meta)
    for options in OPTIONS.values():
        validate_tp(meta, plan_cls(options), TP, SEQ)
        model = build(model_type, num_hidden_layers=2)
        apply_tp(model, mesh, plan_cls(options))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        loss = _loss(model, torch.randint(0, VOCAB, (2, SEQ)), options.loss_parallel)
        assert loss.shape == () and all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_validation_names_what_tp_cannot_split():
    model = build("qwen3", "meta", num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by --parallelism.tensor_parallel_degree"):
        validate_tp(model, hf_plan_class(model)(), TP, SEQ)


# ---- 2 real gloo ranks against one process --------------------------------------------------------


def _loss(model, tokens, vocab_sharded):
    """Next-token cross entropy, backpropagated; with ``vocab_sharded`` on the lm_head's vocab-sharded logits."""
    logits = model.lm_head(model.base_model(input_ids=tokens).last_hidden_state)
    with loss_parallel() if vocab_sharded else nullcontext():
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _relative_error(actual, expected):
    actual = actual.full_tensor() if isinstance(actual, DTensor) else actual
    return ((actual - expected).norm() / expected.norm()).item()


EXACT_CASES = [("qwen3", "sp"), ("qwen3", "no_sp"), ("gemma3_text", "sp"),
               ("qwen3+tied", "sp"), ("qwen3+tied", "no_sp"), ("llama+tied", "sp"),
               ("qwen3+mlp_whole", "sp"), ("qwen3+mlp_whole", "no_sp"), ("cohere+qk_norm", "sp"),
               ("gpt2+no_dropout", "sp"), ("gpt2+no_dropout", "no_sp"), ("deepseek_v2+mla", "sp"),
               ("deepseek_v2+mla", "no_sp")]
"""``+tied``: ``tie_word_embeddings`` (Llama 3.2, Qwen3 0.6-4B, Gemma): one weight, sharded once on the vocabulary,
serves the embedding and the head, with sequence and loss parallel on or off. ``+mlp_whole``: the HF plan leaves
the MLP out, ``+qk_norm``: Cohere's per-head norms, which its plan leaves out: that module kept whole on every rank.
GPT-2 (no HF plan): its position embedding beside the final norm, and its blocks' modules, kept whole.
``+mla``: DeepSeek-V2's latent attention, its HF plan's ``mla_kv_a_proj`` translated."""
VARIANTS = {"tied": {"tie_word_embeddings": True}, "qk_norm": {"use_qk_norm": True},
            "no_dropout": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}, "mla": MLA,
            "mlp_whole": qwen3_plan(**{f"layers.*.mlp.{p}": None for p in ("gate_proj", "up_proj", "down_proj")})}
STEPS = 3


def _compare(model_type, options, mesh):
    """Worst relative error of the loss, the gradients and the parameters over a few AdamW steps."""
    torch.manual_seed(0)
    name, _, variant = model_type.partition("+")
    whole = build(name, num_hidden_layers=2, **VARIANTS.get(variant, {}))
    with torch.no_grad():  # away from ones/zeros, so every norm weight matters
        for p in whole.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = copy.deepcopy(whole)
    apply_tp(model, mesh, hf_plan_class(model, layers="h" if name == "gpt2" else None)(OPTIONS[options]))
    if variant == "tied":  # still one weight (deduplicated by parameters(), as in one process)
        assert model.lm_head.weight is model.get_input_embeddings().weight
        assert len(list(model.parameters())) == len(list(whole.parameters()))
    # Adam's first step moves every weight by about +-lr whatever its gradient's size, so a weight whose
    # gradient is near zero differs by up to lr between the two; a small lr keeps that under the tolerance.
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (whole, model)]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    worst = 0.0
    # GPT-2's key bias gets a gradient of rounding noise only (softmax ignores a shift of every score): AdamW
    # turns noise into +-lr moves, different in each process; its loss and gradients are compared, no update
    steps = 0 if name == "gpt2" else STEPS
    for step in range(steps + 1):
        expected = _loss(whole, tokens, False)
        worst = max(worst, _relative_error(_loss(model, tokens, OPTIONS[options].loss_parallel), expected))
        for p, q in zip(model.parameters(), whole.parameters()):
            worst = max(worst, _relative_error(p.grad, q.grad))
        for optimizer in optimizers[:2 * (step < steps)]:
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(model.parameters(), whole.parameters()):
        worst = max(worst, _relative_error(p.detach(), q.detach()))
    return worst


def _all_cases(rank, mesh):
    return {case: _compare(*case, mesh) for case in EXACT_CASES}


def test_two_ranks_equal_one_process():
    """fp32, same seed on both ranks: SP with loss parallel, and neither, match one process within 1e-5."""
    results = on_forked_ranks(TP, _all_cases)
    for model_type, options in EXACT_CASES:
        for rank in range(TP):
            worst = results[rank][model_type, options]
            assert worst <= 1e-5, f"{model_type} {options} rank {rank}: relative error {worst:.1e}"
