"""TP plans without a trainer: registry, validation, the job plan's TP choice, and the collectives one block issues.

Collectives are counted on torch's "fake" process group (world size 2, one
process): DTensor issues the same collectives as on gloo, only their data is
not exchanged, which is all ``CommDebugMode`` needs.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from model_plans import (
    DeepseekV3TPPlan,
    IfPresent,
    KimiLinearTPPlan,
    TPOptions,
    TPPlan,
    apply_tp,
    get_tp_plan,
    register_tp_plan,
    registered_model_types,
    resolve,
    validate_tp,
)
from titan_ext import kernels
from titan_ext.errors import ConfigError
from titan_ext.job_plan import TPChoice
from titan_ext.models import mixers
from titan_ext.models.gla import gla
from titan_ext.parallel.tensor_parallel import (
    apply_tp_from_plan,
    float8_tp_enabled,
    tp_plan_class,
    sequence_parallel_enabled,
    tp_choice,
)

TP = 2


class GLATPPlan(TPPlan):
    """A plan as a user writes one for a GLA model (fla's block names are ``TPPlan``'s defaults): the GLA mixer's
    own entries for its layers."""

    def attn_plan(self):
        return mixers.GLA("attn").tp_entries(self)


def plan_for(model, **options):
    """The plan titan_ext gives the model (``tensor_parallel.tp_plan_class``)."""
    return tp_plan_class(model, TP)(TPOptions(**options))


# ---- registry ---------------------------------------------------------------------------------


def test_shipped_plans_are_registered():
    """Only what neither a mixer's entries nor an HF plan gives: DeepSeek-V3's and Kimi Linear's MoE blocks."""
    assert get_tp_plan("deepseek_v3") is DeepseekV3TPPlan and get_tp_plan("kimi_linear") is KimiLinearTPPlan
    assert registered_model_types() == ["deepseek_v3", "kimi_linear"]


def test_unknown_model_type_lists_registered_ones():
    with pytest.raises(ValueError) as e:
        get_tp_plan("mamba9")
    msg = str(e.value)
    assert "'mamba9'" in msg and all(repr(t) in msg for t in ("deepseek_v3", "kimi_linear"))
    assert "\n" not in msg


def test_a_user_plan_replaces_the_shipped_one_and_a_second_user_plan_clashes(monkeypatch):
    from model_plans import plan_source, registry

    monkeypatch.setattr(registry, "_PLANS", dict(registry._PLANS))  # the registry as shipped, restored after
    assert plan_source(get_tp_plan("deepseek_v3")) == "shipped with titan_ext"

    @register_tp_plan("deepseek_v3")
    class Mine(DeepseekV3TPPlan):
        pass

    assert get_tp_plan("deepseek_v3") is Mine and plan_source(Mine) == f"registered by {__name__}"
    register_tp_plan("deepseek_v3")(DeepseekV3TPPlan)  # a shipped plan (re-registered) never replaces a user's
    assert get_tp_plan("deepseek_v3") is Mine
    with pytest.raises(ValueError, match="already registered"):
        register_tp_plan("deepseek_v3")(type("Other", (DeepseekV3TPPlan,), {}))
    register_tp_plan("test_only_gla_variant")(Mine)
    assert "test_only_gla_variant" in registered_model_types()
    with pytest.raises(TypeError):
        register_tp_plan("not_a_plan")(object)


# ---- validation --------------------------------------------------------------------------------


def meta_gla(**kw):
    from fla.models import GLAConfig, GLAForCausalLM

    base = dict(hidden_size=64, num_heads=4, num_hidden_layers=2, vocab_size=33, expand_k=0.5, expand_v=1.0,
                hidden_ratio=4, use_short_conv=False, tie_word_embeddings=False)
    with torch.device("meta"):
        return GLAForCausalLM(GLAConfig(**{**base, **kw}))


def meta_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                num_hidden_layers=2, vocab_size=33, tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**{**base, **kw}))


DEGREE = "is not divisible by --parallelism.tensor_parallel_degree"


@pytest.mark.parametrize(
    "build,degree,seq_len,sp,expected",
    [
        (lambda: meta_gla(num_heads=6, hidden_size=96), 4, None, True, f"num_heads=6 {DEGREE}=4"),
        (lambda: meta_gla(num_kv_heads=1), 2, None, True, f"num_kv_heads=1 {DEGREE}=2"),
        # sizes the plan splits, read from the modules it names (fla sizes attention by whole heads)
        (lambda: meta_gla(intermediate_size=130), 4, None, True, f"model.layers.0.mlp.gate_proj.out_features=130 {DEGREE}=4"),
        (lambda: meta_gla(hidden_size=72, num_heads=2, hidden_ratio=2), 8, None, True, "num_heads=2"),
        (lambda: meta_llama(num_attention_heads=3, hidden_size=48), 2, None, True, "num_attention_heads=3 is not divisible"),
        (lambda: meta_llama(num_key_value_heads=1), 2, None, True, "num_key_value_heads=1 is not divisible"),
        (lambda: meta_llama(num_attention_heads=8, num_key_value_heads=8, intermediate_size=100), 8, None, True, f"model.layers.0.mlp.gate_proj.out_features=100 {DEGREE}=8"),
        (meta_gla, 2, 127, True, f"--training.seq_len=127 {DEGREE}=2"),
    ],
)
def test_validation_names_field_value_and_degree(build, degree, seq_len, sp, expected):
    model = build()
    plan = plan_for(model, sequence_parallel=sp)
    with pytest.raises(ValueError) as e:
        validate_tp(model, plan, degree, seq_len)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_validation_passes_what_tp_can_split():
    gla, llama = meta_gla(), meta_llama()
    validate_tp(gla, GLATPPlan(), 2, 128)  # the vocabulary (33) may split unevenly
    validate_tp(meta_gla(use_short_conv=True), GLATPPlan(), 2, 128)  # convs sharded with their projections
    validate_tp(gla, GLATPPlan(TPOptions(sequence_parallel=False)), 2, 127)  # no sequence sharding, any length
    validate_tp(llama, plan_for(llama), 2, 128)
    tied = meta_llama(tie_word_embeddings=True)
    validate_tp(tied, plan_for(tied), 2, 128)  # one vocab-sharded weight (apply_tp)
    validate_tp(meta_gla(num_heads=3, hidden_size=96), GLATPPlan(), 1, 127)  # no TP, nothing to check


def test_validation_reads_the_mlp_width_fla_derives():
    """fla sizes the MLP from hidden_ratio when intermediate_size is None (192 * 4 * 2/3 rounded up to
    a multiple of 256 = 512): the check sees the built width, which 3 does not divide, though the heads
    (6) and the attention widths (96, 192) split."""
    model = meta_gla(hidden_size=192, num_heads=6, hidden_ratio=4, intermediate_size=None)
    assert model.model.layers[0].mlp.gate_proj.out_features == 512
    with pytest.raises(ValueError, match=f"mlp.gate_proj.out_features=512 {DEGREE}=3"):
        validate_tp(model, GLATPPlan(), 3, None)


# ---- the job plan's choice -----------------------------------------------------------------------


def job(converters=(), recipe=None, disable_loss_parallel=False, disable_sp=None, async_tp=False, degree=TP, seq_len=128):
    titan_ext_section = SimpleNamespace() if disable_sp is None else SimpleNamespace(disable_sequence_parallel=disable_sp)
    return SimpleNamespace(
        model=SimpleNamespace(converters=list(converters)),
        quantize=SimpleNamespace(linear=SimpleNamespace(float8=SimpleNamespace(recipe_name=recipe))),
        parallelism=SimpleNamespace(tensor_parallel_degree=degree, disable_loss_parallel=disable_loss_parallel,
                                    enable_async_tensor_parallel=async_tp, expert_parallel_degree=1),
        training=SimpleNamespace(seq_len=seq_len),
        validation=SimpleNamespace(enable=False),
        titan_ext=titan_ext_section,
    )


def debug_gla_args(**kw):
    return gla(hidden_size=64, num_hidden_layers=1, num_heads=4, vocab_size=128, **kw)


def debug_gla_meta(**kw):
    from titan_ext.models.adapter import meta_model

    return meta_model(debug_gla_args(**kw))


@pytest.mark.parametrize(
    "converters,recipe,float8",
    [
        (["quantize.linear.float8"], None, True),
        (["quantize.linear.float8"], "tensorwise", True),
        (["quantize.linear.float8"], "rowwise", False),
        (["quantize.linear.float8"], "rowwise_with_gw_hp", False),
        (["float8"], None, False),  # not a registered converter name
        ([], None, False),
    ],
)
def test_float8_styles_only_for_tensorwise_float8(converters, recipe, float8):
    assert float8_tp_enabled(job(converters, recipe)) is float8
    choice = tp_choice(debug_gla_meta(), job(converters, recipe))
    assert choice.float8 is float8
    plan = choice.plan_cls(TPOptions(float8=choice.float8))
    styles = {fqn: getattr(entry, "style", entry) for fqn, entry in {**plan.block_plan(0), **plan.model_plan()}.items()}
    for fqn in ("attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "attn.o_proj", "mlp.down_proj", "mlp"):
        assert (type(styles[fqn]).__module__.startswith("torchao.float8")) is float8, (fqn, styles[fqn])
    assert type(styles["lm_head"]) is ColwiseParallel  # the head stays high precision, as in torchtitan


def test_tp_choice_maps_the_job_options():
    assert tp_choice(debug_gla_meta(), job(degree=1)) is None
    choice = tp_choice(debug_gla_meta(), job())
    assert choice.plan_cls.__name__ == "FlaTPPlan" and choice == TPChoice(
        degree=TP, plan_cls=choice.plan_cls, sequence_parallel=True, loss_parallel=True, float8=False, async_tp=False)
    choice = tp_choice(debug_gla_meta(), job(disable_loss_parallel=True, disable_sp=True, async_tp=True))
    assert (choice.sequence_parallel, choice.loss_parallel, choice.async_tp) == (False, False, True)
    assert sequence_parallel_enabled(job()) and not sequence_parallel_enabled(job(disable_sp=True))


def test_lm_head_layout_follows_loss_parallel():
    head = GLATPPlan(TPOptions(loss_parallel=True)).model_plan()["lm_head"].style  # IfPresent: PP stages lack it
    assert head.output_layouts[0].is_shard(-1) and not head.use_local_output
    head = GLATPPlan(TPOptions(loss_parallel=False)).model_plan()["lm_head"].style
    assert head.output_layouts[0].is_replicate() and head.use_local_output


def test_the_tp_choice_is_checked_against_the_model_in_one_line():
    from titan_ext.models.adapter import meta_model

    debug, six_heads = meta_model(debug_gla_args()), meta_model(gla(hidden_size=96, num_heads=6))
    assert tp_choice(debug, job()) is not None
    assert tp_choice(six_heads, job(degree=1)) is None  # no TP, nothing to check
    with pytest.raises(ConfigError) as e:
        tp_choice(six_heads, job(degree=4))
    assert "num_heads=6 is not divisible by --parallelism.tensor_parallel_degree=4" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--training.seq_len=127"):
        tp_choice(debug, job(seq_len=127))
    tp_choice(debug, job(seq_len=127, disable_sp=True))


def test_a_config_the_library_refuses_is_one_line_before_the_build():
    from titan_ext.models.adapter import meta_model

    with pytest.raises(ConfigError) as e:
        meta_model(gla(hidden_size=64, num_heads=3))  # fla: key dim 32 does not split into 3 heads
    assert "GLAForCausalLM cannot be built from this config (AssertionError: key dim must be divisible" in str(e.value)
    assert "\n" not in str(e.value)


# ---- models on a fake 2-rank group ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    yield init_device_mesh("cpu", (TP,))
    dist.destroy_process_group()


def tiny_gla(**kw):
    from fla.models import GLAConfig, GLAForCausalLM

    config = GLAConfig(hidden_size=64, num_hidden_layers=1, num_heads=4, vocab_size=128,
                       fuse_cross_entropy=False, fuse_linear_cross_entropy=False, **kw)
    return kernels.portable(GLAForCausalLM(config))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def tiny_transformer():
    from fla.models import TransformerConfig, TransformerForCausalLM

    from titan_ext.kernels.host_patches import building

    config = TransformerConfig(hidden_size=64, num_hidden_layers=1, num_heads=4, num_kv_heads=2, vocab_size=128,
                               qk_norm=True, fuse_cross_entropy=False, fuse_linear_cross_entropy=False)
    with building():  # fla's Attention refuses to build without flash-attn otherwise
        model = TransformerForCausalLM(config)
    return kernels.portable(model)  # SDPA in place of flash-attn, torch RMSNorm and rotary


BUILDERS = {
    "gla": tiny_gla,
    "gla_unfused": lambda: tiny_gla(fuse_norm=False, fuse_swiglu=False),
    "gla_gqa": lambda: tiny_gla(num_kv_heads=2),
    "llama": tiny_llama,
    "transformer": tiny_transformer,
}


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_one_block_issues_the_megatron_minimum(mesh, name, sp):
    model = BUILDERS[name]()
    plan = plan_for(model, sequence_parallel=sp)
    apply_tp(model, mesh, plan)
    tokens = torch.randint(0, 128, (2, 16))
    hidden = model.get_input_embeddings()(tokens)
    block = model.get_submodule(plan.layers)[0]
    kwargs = {}
    if name == "llama":
        positions = torch.arange(16)[None]
        kwargs = {"position_embeddings": model.model.rotary_emb(hidden, positions), "position_ids": positions}
    with CommDebugMode() as comm:
        out = block(hidden, **kwargs)
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    print(f"\n{name} {'SP' if sp else 'no SP'}: one block's forward issues {counts}")
    expected = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2} if sp else {"all_reduce": 2}
    assert counts == expected
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape[-1] == 64


@pytest.mark.parametrize("name", ["gla", "gla_unfused", "llama", "transformer"])
def test_every_parameter_becomes_a_dtensor_and_trains(mesh, name):
    """Forward and backward of the whole model under both variants; no plain parameter is left."""
    for sp in (True, False):
        model = BUILDERS[name]()
        plan = plan_for(model, sequence_parallel=sp, loss_parallel=False)
        apply_tp(model, mesh, plan)
        logits = model.lm_head(model.model(input_ids=torch.randint(0, 128, (2, 16))).last_hidden_state)
        assert logits.shape == (2, 16, 128) and not isinstance(logits, DTensor)
        logits.float().pow(2).mean().backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())


def test_a_parameter_no_plan_covers_is_an_error(mesh):
    class Partial(GLATPPlan):
        def attn_plan(self):
            plan = super().attn_plan()
            del plan["attn.gk_proj.0"]
            return plan

    with pytest.raises(ValueError, match=r"parameter model.layers.0.attn.gk_proj.0.weight is not covered by Partial"):
        apply_tp(tiny_gla(), mesh, Partial())
    # and before anything is built: the check on the meta-device model
    with pytest.raises(ValueError, match=r"parameter model.layers.0.attn.gk_proj.0.weight is not covered by Partial: "):
        validate_tp(meta_gla(), Partial(), 2)


def test_float8_styles_fall_back_where_the_converter_left_a_linear(mesh):
    plan = GLATPPlan(TPOptions(float8=True))
    block = tiny_gla().model.layers[0]  # no Float8Linear at all
    resolved = resolve(plan.block_plan(), block)
    assert type(resolved["attn.q_proj"]) is ColwiseParallel
    assert type(resolved["mlp.down_proj"]) is RowwiseParallel
    assert type(resolved["mlp"]) is PrepareModuleInput
    assert "attn.g_norm" not in resolved  # fused variant: g_norm_swish_gate instead


def test_a_typo_in_a_plan_entry_is_a_one_line_error_naming_it(mesh):
    class Typo(GLATPPlan):
        def attn_plan(self):
            plan = super().attn_plan()
            plan["attn.q_prj"] = plan.pop("attn.q_proj")
            return plan

    with pytest.raises(ValueError) as e:
        apply_tp(tiny_gla(), mesh, Typo())
    message = str(e.value)
    assert "Typo names 'attn.q_prj'" in message and "IfPresent" in message and "\n" not in message


def test_an_if_present_entry_for_a_missing_module_is_skipped():
    block = tiny_gla().model.layers[0]
    style = ColwiseParallel()
    plan = {"attn.q_proj": style, "attn.not_there": IfPresent(RowwiseParallel())}
    assert resolve(plan, block) == {"attn.q_proj": style}
    with pytest.raises(ValueError, match="my plan names 'attn.not_there'"):
        resolve({"attn.not_there": RowwiseParallel()}, block, "my plan")


@pytest.mark.parametrize("fuse_swiglu", [True, False])
@pytest.mark.parametrize("fuse_norm", [True, False])
def test_shipped_gla_plan_fits_every_fusion_setting(mesh, fuse_norm, fuse_swiglu):
    model = tiny_gla(fuse_norm=fuse_norm, fuse_swiglu=fuse_swiglu)
    choice = TPChoice(degree=TP, plan_cls=GLATPPlan, sequence_parallel=True, loss_parallel=False, float8=False,
                      async_tp=False)
    apply_tp_from_plan(model, mesh, choice)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    attn = model.model.layers[0].attn
    assert hasattr(attn, "g_norm_swish_gate") is fuse_norm  # fla builds one of the two head norms
    logits = model.lm_head(model.model(input_ids=torch.randint(0, 128, (2, 16))).last_hidden_state)
    assert logits.shape == (2, 16, 128)


def test_base_plan_needs_an_attention_plan():
    with pytest.raises(NotImplementedError, match="TPPlan must define attn_plan"):
        TPPlan().block_plan()
