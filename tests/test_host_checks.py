"""Host behaviours titan_ext relies on: each probe passes on the installed versions and stops the job, in one
line naming the package and its version, when the behaviour changes (simulated here by patching the host)."""

import copy
import functools
import types

import pytest
import torch

from titan_ext.errors import ConfigError, HostChanged
from titan_ext.host import checks
from titan_ext.kernels import binding
from titan_ext.models.args import transformers_model
from titan_ext.models.gla import gla_flavors
from titan_ext.models.llama import llama_flavors

QWEN3 = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
QWEN3_5 = dict(QWEN3, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention", "full_attention"])
"""A hybrid whose layer 0 has no ``self_attn`` (Gated DeltaNet's ``linear_attn``): the probe takes layer 1's kind."""


QWEN3_MOE = dict(QWEN3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
OLMOE = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("args", [llama_flavors["debugmodel"], llama_flavors["8B"], gla_flavors["debugmodel"],
                                  transformers_model("qwen3", **QWEN3), transformers_model("qwen3_moe", **QWEN3_MOE),
                                  transformers_model("olmoe", **OLMOE), transformers_model("qwen3_5_text", **QWEN3_5)],
                         ids=["llama", "llama8B", "gla", "qwen3", "qwen3_moe", "olmoe", "qwen3_5"])
def test_every_check_passes_on_the_installed_hosts(args):
    args = copy.deepcopy(args)
    checks.check_host(args)
    if args.library == "transformers":
        assert checks.tiny_copy(args, layer=1) is not None  # the probe ran: the architecture took the tiny sizes


def expect_host_changed(package, what, args=None):
    with pytest.raises(HostChanged) as error:
        checks.check_host(copy.deepcopy(args or llama_flavors["debugmodel"]))
    message = str(error.value)
    assert message.startswith(f"{package} ") and what in message and "\n" not in message, message
    assert isinstance(error.value, ConfigError)  # the job's config boundary turns it into one line and exit 2
    return message


def test_an_attention_forward_the_binding_cannot_reach_stops_the_job(monkeypatch):
    """transformers 5.24's failure, on any version: a decorated forward (a wrapper from another module, as
    5.24's ``deprecate_kwarg``) and a binding that cannot read through it."""
    from transformers.models.llama import modeling_llama

    def without_read_through(fn, replacements, names, used, seen=frozenset()):
        overrides = binding._global_overrides(fn, replacements, names, used)
        return binding.rebased(fn, overrides) if overrides else None

    def decorated(forward):
        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            return forward(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(binding, "_rebind", without_read_through)
    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", decorated(modeling_llama.LlamaAttention.forward))
    expect_host_changed("transformers", "LlamaAttention.forward no longer calls the attention")


def test_position_ids_ignored_stop_the_job(monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaRotaryEmbedding.forward

    def from_zero(self, x, position_ids):
        return original(self, x, torch.arange(position_ids.shape[-1])[None])

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", from_zero)
    expect_host_changed("transformers", "position_ids")
    # only CP and document masking rely on it: a job using neither trains its model as transformers runs it
    checks.check_host(copy.deepcopy(llama_flavors["debugmodel"]), frozenset())


def test_experts_that_split_gate_and_up_otherwise_stop_the_job(monkeypatch):
    """E.g. a release storing [up; gate] instead of [gate; up]: expert parallelism would compute other experts."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    original = modeling_qwen3_moe.Qwen3MoeExperts.forward

    def swapped(self, hidden_states, top_k_index, top_k_weights):
        gate_up = self.gate_up_proj
        try:
            self.gate_up_proj = torch.nn.Parameter(torch.cat(gate_up.chunk(2, dim=1)[::-1], dim=1))
            return original(self, hidden_states, top_k_index, top_k_weights)
        finally:
            self.gate_up_proj = gate_up

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeExperts, "forward", swapped)
    expect_host_changed("transformers", "Qwen3MoeExperts no longer computes", transformers_model("qwen3_moe", **QWEN3_MOE))


def test_a_router_returning_scores_first_stops_the_job(monkeypatch):
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    original = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward",
                        lambda self, x: (lambda lg, s, i: (-lg, s, i))(*original(self, x)))
    expect_host_changed("transformers", "no longer returns its logits first", transformers_model("qwen3_moe", **QWEN3_MOE))


def test_a_router_weighing_experts_otherwise_stops_the_job(monkeypatch):
    """E.g. a release scaling the chosen experts' weights: titan_ext's biased router would weigh them otherwise."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    original = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward",
                        lambda self, x: (lambda lg, s, i: (lg, 2 * s, i))(*original(self, x)))
    expect_host_changed("transformers", "no longer weighs its top-k experts", transformers_model("qwen3_moe", **QWEN3_MOE))


def test_a_4d_mask_not_used_as_given_stops_the_job(monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "create_causal_mask", lambda **kwargs: None)
    expect_host_changed("transformers", "attention_mask")


def test_a_changed_fla_kernel_signature_stops_the_job(monkeypatch):
    import fla.ops.gla.chunk as chunk

    original = chunk.chunk_gla

    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=True, **kwargs):
        return original(q, k, v, g, scale, initial_state, output_final_state, **kwargs)

    monkeypatch.setattr(chunk, "chunk_gla", chunk_gla)
    message = expect_host_changed("flash-linear-attention", "chunk_gla now takes", gla_flavors["debugmodel"])
    assert "output_final_state=True" in message


def test_fla_signature_table_names_real_functions():
    from titan_ext import kernels
    from titan_ext.compat import resolve

    replaced = {k.fla for k in kernels.kernel_rows() if not isinstance(resolve(k.fla), type)}
    def unsigned(target):  # fla's Function.apply aliases: (*args, **kwargs), or no signature at all (torch 2.15)
        try:
            return checks.parameters(resolve(target)) in ("*args, **kwargs", "**kwargs")
        except ValueError:
            return True

    unsigned = {t for t in replaced if unsigned(t)}
    assert replaced - unsigned <= set(kernels.signatures()), replaced - unsigned - set(kernels.signatures())


def test_torchtitan_loss_scaling_changed_stops_the_job(monkeypatch):
    from torchtitan.train import Trainer

    original = Trainer.forward_backward_step

    def averaged(self, *, input_dict, labels, global_valid_tokens):  # a mean where titan_ext expects sum / tokens
        return original(self, input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens / 2)

    monkeypatch.setattr(Trainer, "forward_backward_step", averaged)
    expect_host_changed("torchtitan", "no longer backpropagates the loss sum")


def test_binding_reads_through_decorators():
    """A ``functools.wraps`` wrapper defined in another module: the wrapped function's globals are rebound."""
    decorators = types.ModuleType("decorators")
    exec("import functools\n"
         "def logged(fn):\n"
         "    @functools.wraps(fn)\n"
         "    def wrapper(*args, **kwargs):\n"
         "        return fn(*args, **kwargs)\n"
         "    return wrapper\n", decorators.__dict__)
    layer = types.ModuleType("layer")
    layer.__dict__["logged"] = decorators.logged
    exec("import torch\n"
         "def kernel(x):\n"
         "    return x + 1\n"
         "class Mixer(torch.nn.Module):\n"
         "    @logged\n"
         "    def forward(self, x):\n"
         "        return kernel(x)\n", layer.__dict__)
    mixer = layer.Mixer()
    used = binding.bind(mixer, {layer.kernel: lambda x: x + 2}, key="test_decorated")
    assert used == {layer.kernel}
    assert mixer(torch.zeros(1)).item() == 2.0
    assert layer.Mixer()(torch.zeros(1)).item() == 1.0  # the class itself unchanged


def test_the_probes_leave_the_jobs_random_state_alone():
    """A job's first random draws (initial weights without a seed checkpoint) must not depend on the probes."""
    state = torch.random.get_rng_state()
    checks.check_host(copy.deepcopy(llama_flavors["debugmodel"]))
    checks.check_host(copy.deepcopy(gla_flavors["debugmodel"]))
    assert torch.equal(torch.random.get_rng_state(), state)


def test_the_probe_of_a_real_config_warns_of_nothing(caplog):
    """A real checkpoint's token ids (Qwen3's eos 151645) lie beyond the probe's 64-token vocabulary: the probe
    drops them rather than have transformers warn on the job's (or the planner's) console."""
    import logging

    args = transformers_model("qwen3_moe", **{**QWEN3_MOE, "vocab_size": 151936}, eos_token_id=151645,
                              bos_token_id=151643, pad_token_id=151643)
    with caplog.at_level(logging.WARNING):
        assert checks.tiny_copy(args) is not None
    assert not [r for r in caplog.records if "token_id" in r.getMessage()], caplog.text
