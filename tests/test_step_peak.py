"""The planner's step peak (``planner.memory``) on fake tensors against torch's own account of the same step run
for real (the profiler's memory timeline: every CPU allocation and release), where the gradients decide it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F


def measured_peak(step) -> tuple[int, int]:
    """(the most bytes held at once, the bytes held at the end) of what ``step()`` allocates, by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action  # torch's own memory timeline (private: tests only)

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    now = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        now += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, now)
    return peak, now


class Chain(torch.nn.Module):
    """Four square layers on a batch of half their width: backward computes each weight's gradient (as big as two
    layers' activations) while it frees activations, so the peak comes between the first gradient and the last."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.square().sum()


def sharded_like_fsdp(model, shards: list) -> None:
    """Each gradient, once accumulated, replaced by a half-size copy and freed (FSDP's reduce-scatter)."""

    def reduce_scatter(param):
        shards.append(param.grad[: len(param.grad) // 2].clone())
        param.grad = None

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(reduce_scatter)


@pytest.mark.parametrize("sharded", [False, True], ids=["gradients_kept", "gradients_sharded"])
def test_the_step_peak_times_each_gradient_where_backward_allocates_it(sharded):
    from titan_ext import compat
    from titan_ext.planner import memory

    def step(model, x):
        model(x).backward()

    torch.manual_seed(0)
    model, shards = Chain(), []
    if sharded:
        sharded_like_fsdp(model, shards)
    x = torch.randn(128, 256)
    real, real_end = measured_peak(lambda: step(model, x))

    with compat.fake_process_group().FakeTensorMode(allow_non_fake_inputs=True):
        model, fake_shards = Chain(), []
        if sharded:
            sharded_like_fsdp(model, fake_shards)
        x = torch.randn(128, 256)  # the batch, held before the step
        with memory.StepPeak() as peak:
            step(model, x)
        kept = memory.gradients([model]) + fake_shards
        planned = memory.step_peak_bytes(peak, [model])
        without, with_every = peak.peak_bytes(kept), peak.peak_bytes(kept) + sum(map(memory.local_bytes, kept))

    assert real_end == sum(map(memory.local_bytes, kept))  # the same gradients end the step, real and planned
    assert planned == real, (planned, real)
    if not sharded:  # the gradients' timing decides: neither left out nor all held at the peak is within 10%
        assert without < 0.9 * real and with_every > 1.1 * real, (without, real, with_every)


def test_an_accumulating_steps_later_passes_hold_every_gradient():
    from titan_ext import compat
    from titan_ext.planner import memory

    with compat.fake_process_group().FakeTensorMode(allow_non_fake_inputs=True):
        model, x = Chain(), torch.randn(128, 256)
        with memory.StepPeak() as peak:
            model(x).backward()
        grads = memory.grad_bytes([model])
        assert memory.step_peak_bytes(peak, [model], passes=2) == grads + peak.peak_bytes(memory.gradients([model]))
        assert memory.step_peak_bytes(peak, [model], passes=2) > memory.step_peak_bytes(peak, [model], passes=1)


def test_a_storage_freed_and_regathered_by_resizing_is_followed():
    """FSDP's gathered weights: their storage resized to 0 after use and back before the next (no operator)."""
    from titan_ext.planner import memory

    with memory.StepPeak() as peak:
        gathered = torch.empty(1024)  # 4 KiB
        gathered.untyped_storage().resize_(0)
        torch.empty(512)  # 2 KiB, freed at once
        gathered.untyped_storage().resize_(4096)
    assert peak.peak_bytes() == 4096 and [size for _, size in peak.events] == [4096, -4096, 2048, -2048, 4096]


QWEN3_TINY = dict(
    model_type="qwen3", vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False, max_position_embeddings=64,
)
"""Its heads (2 MiB each) outweigh 32 tokens' activations: the gradients decide the step's peak."""


@pytest.fixture(autouse=False)
def _host_patches_undone():
    yield
    from titan_ext import patching

    patching.undo()


def test_a_planned_rank_peaks_as_its_step_run_for_real(tmp_path, _host_patches_undone):
    """``simulate_rank``'s step peak for one rank of a small transformers job, against the profiler's account of the
    same model's forward and backward with torchtitan's loss, run for real."""
    from titan_ext.models.adapter import build_model
    from titan_ext.models.args import HFModelArgs
    from titan_ext.planner import job_config_of, prepare
    from titan_ext.planner.rank import simulate_rank

    config = tmp_path / "qwen3_tiny.json"
    config.write_text(json.dumps(QWEN3_TINY))
    prepare()
    planned = simulate_rank(job_config_of([
        "--job.config_file", "train_configs/debug_llama.toml", "--model.name", "hf", "--model.flavor", "from_config",
        "--titan_ext.hf_config", str(config), "--training.seq_len", "32", "--training.local_batch_size", "1"]), 1)

    torch.manual_seed(0)
    model = build_model(HFModelArgs(library="transformers", config=dict(QWEN3_TINY)))
    model.init_weights()
    tokens = torch.randint(0, QWEN3_TINY["vocab_size"], (1, 32))

    def step():  # torchtitan's forward_backward_step: the logits dropped before backward
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(), reduction="sum") / tokens.numel()
        del logits
        loss.backward()

    real, real_end = measured_peak(step)
    assert real_end == planned.grad_bytes
    assert abs(planned.peak_bytes / real - 1) < 0.05, (planned.peak_bytes, real)


def test_the_planners_watchers_share_one_dispatch_mode():
    """The recorder, the step peak and the PP step's ``.item()`` answer, entered one inside the other, see each
    operator through one torch dispatch mode (``collectives.Watcher``); behind another mode, a mode of their own."""
    from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack

    from titan_ext import compat
    from titan_ext.planner import collectives, memory, rank

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with compat.fake_process_group().FakeTensorMode(allow_non_fake_inputs=True):
        before = _len_torch_dispatch_stack()
        with rank._ScalarsReadOne(), memory.StepPeak() as peak, collectives.Recorder({}) as recorder:
            assert _len_torch_dispatch_stack() == before + 1
            assert torch.ones(2).sum().item() == 1.0  # the fake tensor's value, read as one
            with Other(), memory.StepPeak() as inner:
                assert _len_torch_dispatch_stack() == before + 3
                torch.empty(256)
        assert _len_torch_dispatch_stack() == before
    assert [size for _, size in peak.events if size > 0] == [8, 4, 1024] and recorder.log == []
    assert [size for _, size in inner.events if size > 0] == [1024]


def test_watchers_inside_the_planners_fake_mode_see_what_they_see_behind_it():
    """Entered right inside the planner's fake tensor mode (``collectives.watched_fake_tensors``), the watchers
    are that mode's: no mode of their own on the stack, and each operator reaches Python once. They see what they
    see from a ``_Watch`` above a plain ``FakeTensorMode``, event for event: not the operators the fake mode runs
    inside its own dispatch (a decomposition's), nor a tensor's device that C++ asks."""
    from torch.utils._python_dispatch import _len_torch_dispatch_stack

    from titan_ext import compat
    from titan_ext.planner import collectives, memory, rank

    def step(mode):
        mode.cache_clear()  # each step dispatches as a first one does: the fake mode decomposes what it must
        with mode:
            before = _len_torch_dispatch_stack()
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.SiLU(),
                                        torch.nn.Linear(32, 8))
            x, target = torch.randn(4, 16), torch.zeros(4, dtype=torch.long)
            with rank._ScalarsReadOne(), memory.StepPeak() as peak, rank._SavedBytes() as saved:
                stack = _len_torch_dispatch_stack() - before
                loss = F.cross_entropy(F.logsigmoid(model(x)), target)  # both decomposed by the fake mode
                loss.backward()
                read = loss.item()
            return stack, read, peak.events, saved.bytes, len(mode.watchers) if hasattr(mode, "watchers") else None

    behind = step(compat.fake_process_group().FakeTensorMode(allow_non_fake_inputs=True))
    inside = step(collectives.watched_fake_tensors(allow_non_fake_inputs=True))
    assert behind[0] == 1 and inside[0] == 0  # a _Watch of their own behind a plain fake mode; none inside
    assert inside[1:4] == behind[1:4] and inside[1] == 1.0 and len(inside[2]) > 10
    assert inside[4] == 0  # each watcher left the fake mode, which its own ``with`` ended


def test_the_planners_fake_mode_makes_cached_outputs_as_torch_makes_them(monkeypatch):
    """The planner's fake mode makes an operator's output from the fake cache faster than torch does
    (``compat.fake_tensor_mode().output_from_metadata``): the same fake tensor as a plain ``FakeTensorMode`` makes
    from the same entry, views on their input's storage."""
    from titan_ext import compat
    from titan_ext.planner import collectives

    fake = compat.fake_tensor_mode()
    made = []
    monkeypatch.setattr(fake, "output_from_metadata", lambda *a, _made=fake.output_from_metadata: made.append(1) or _made(*a))

    def outputs(mode):
        mode._allow_unsafe_data_ptr_access = False
        with mode:
            a = torch.randn(4, 6, requires_grad=True)
            b = torch.randn(6, dtype=torch.bfloat16)
            results = []
            for _ in range(2):  # the second from the cache
                results += [a * 2, a.t(), a[1:, 2:], a.view(-1), b.to(torch.float32), (a * 2).add_(1), a.sum(0).neg()]
            return a, results

    def raises(t) -> bool:  # a fake tensor's data pointer, read where the mode forbids it
        try:
            t.data_ptr()
        except RuntimeError:
            return True
        return False

    def described(t):
        return (raises(t), type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.storage_offset(), t._is_view(),
                t.untyped_storage().nbytes(), torch._C._dispatch_keys(t), t.is_leaf, t.is_conj(), t.is_neg(),
                {k: v for k, v in vars(t).items() if k != "fake_mode"})

    _, plain = outputs(compat.fake_process_group().FakeTensorMode(allow_non_fake_inputs=True))
    assert not made
    mode = collectives.watched_fake_tensors(allow_non_fake_inputs=True)
    a, watched = outputs(mode)
    assert len(made) >= 7
    assert [described(w) for w in watched] == [described(p) for p in plain]
    assert all(w.fake_mode is mode for w in watched)
    assert all(v.untyped_storage()._cdata == a.untyped_storage()._cdata for v in watched[8:11])  # the views, from the cache
