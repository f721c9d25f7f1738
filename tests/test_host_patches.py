"""``import titan_ext`` leaves its hosts alone; every change it makes is a row of a table in one of
``patching.TABLE_MODULES`` and undoes exactly."""

import json
import signal
import subprocess
import sys
import warnings

import pytest
from launch import REPO

import titan_ext  # noqa: F401
from titan_ext import compat, kernels, patching
from titan_ext.checkpoints import host_patches as checkpoint_patches
from titan_ext.host import cpu_patches, job_patches
from titan_ext.kernels import host_patches as kernel_patches
from titan_ext.parallel import host_patches as parallel_patches
from titan_ext.planner import host_patches as planner_patches

# Run in a fresh interpreter: the test process has imported titan_ext (and built models) long before.
IMPORT_CHANGES_NOTHING = r"""
import json, sys, types, warnings
import fla, fla.layers.gla, fla.layers.attn, fla.models, fla.modules, fla.ops.gla
import torch, torchtitan.protocols.train_spec, torchtitan.tools.utils, torchtitan.distributed.utils
import torchtitan.components.checkpoint, torchtitan.components.metrics, transformers
from torch.distributed.fsdp import FSDPModule

def snapshot():
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("fla", "torchtitan", "transformers")):
            continue
        for key, value in list(vars(module).items()):
            if callable(value) or isinstance(value, (str, types.ModuleType)):
                seen[f"{name}.{key}"] = id(value)
        for key, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                for attr, member in vars(value).items():
                    seen[f"{name}.{key}.{attr}"] = id(member)
    seen["FSDPModule.set_gradient_divide_factor"] = id(FSDPModule.set_gradient_divide_factor)
    seen["warnings.filters"] = len(warnings.filters)
    return seen

before = snapshot()
chunk_gla = fla.layers.gla.chunk_gla
import titan_ext
after = snapshot()
changed = sorted(k for k in before if after.get(k) != before[k])
# fla as shipped: its own GLA model still calls its Triton kernels (no GPU here) ...
model = fla.models.GLAForCausalLM(fla.models.GLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=64))
try:
    model(torch.randint(0, 64, (1, 80)))
    shipped = "ran"
except RuntimeError as error:
    shipped = str(error)
# ... while titan_ext's own model, in the same process, runs on titan_ext's kernels
from titan_ext.models.adapter import build_model
from titan_ext.models.gla import gla_flavors
ours = build_model(gla_flavors["debugmodel"])
ours.init_weights()
finite = bool(ours(torch.randint(0, 2048, (1, 80))).isfinite().all())
print(json.dumps({"changed": changed, "shipped": shipped, "chunk_gla_is_fla": fla.layers.gla.chunk_gla is chunk_gla,
                  "attn_flash": repr(fla.layers.attn.flash_attn_func), "ours_finite": finite,
                  "heavy": [m for m in ("fla", "transformers", "torchao") if m in sys.modules]}))
"""


def test_import_changes_nothing_in_fla_torchtitan_transformers_or_torch():
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHANGES_NOTHING], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Registration only: torchtitan's train-spec and dataset registries are dicts, mutated in place.
    assert result["changed"] == [], result["changed"][:20]
    assert result["chunk_gla_is_fla"] and result["attn_flash"] == "None"
    assert "0 active drivers" in result["shipped"], result["shipped"]
    assert result["ours_finite"]


def test_import_does_not_import_fla_or_transformers():
    code = "import sys, titan_ext; print([m for m in ('fla', 'transformers', 'torchao') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_every_row_says_why_and_for_which_versions():
    for row in patching.rows():
        owner, name = compat.owner_and_name(row.target)  # the target exists in the installed version
        # an instance row names an attribute the class defines or declares (torchtitan sets
        # MetricsProcessor.logger in __init__), any other row one its module, class or object holds
        assert hasattr(owner, name) or (isinstance(row, patching.InstancePatch)
                                        and name in getattr(owner, "__annotations__", {})), row.target
        assert row.why and row.checked, row.target
    for path in kernels.PATHS:
        assert kernels.replacements(path)  # every kernel module's KERNELS row resolves


def test_the_tables_are_those_of_the_table_modules():
    """``rows()`` holds every table a reader finds (each module's ``TABLES``): 54 rows, each once."""
    tables = (cpu_patches.CPU_MODE, job_patches.PER_JOB, parallel_patches.PER_JOB, parallel_patches.PIPELINE,
              checkpoint_patches.CHECKPOINT_MANIFEST, checkpoint_patches.SKIP_DAMAGED_STEPS, checkpoint_patches.STRIDED_CHECKPOINT,
              kernel_patches.BUILD, kernel_patches.INTERPRETER, kernel_patches.CUDA, planner_patches.PLANNER,
              planner_patches.STEPPING)
    assert [id(row) for row in patching.rows()] == [id(row) for table in tables for row in table]
    assert len(patching.rows()) == 54


def defining_modules() -> set[str]:
    """The package modules whose code builds a row (calls ``Patch``, ``Setting`` or ``InstancePatch``)."""
    import ast

    kinds, found = {"Patch", "Setting", "InstancePatch"}, set()
    for path in (REPO / "titan_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in kinds:
                found.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_every_module_that_builds_a_row_is_a_table_module():
    """A table outside ``TABLE_MODULES`` would be a change no reader of the list finds."""
    assert defining_modules() == set(patching.TABLE_MODULES)


def test_a_setting_row_is_undone():
    import torch._dynamo.config as dynamo_config

    before = dynamo_config.optimize_ddp
    parallel_patches.OPTIMIZE_DDP.set("ddp_optimizer")
    assert dynamo_config.optimize_ddp == "ddp_optimizer"
    patching.undo()
    assert dynamo_config.optimize_ddp == before


def test_an_instance_row_changes_one_object_of_its_class_only():
    from torchtitan.components.optimizer import OptimizersContainer

    class Mine(OptimizersContainer):
        def __init__(self):  # no torch optimizers needed
            pass

    one, other = Mine(), Mine()
    job_patches.OPTIMIZER_STEP.apply(one, lambda step: "guarded")
    assert one.step == "guarded" and other.step != "guarded"
    with pytest.raises(TypeError, match="OptimizersContainer"):
        job_patches.OPTIMIZER_STEP.apply(object(), lambda step: step)


def test_undo_restores_every_original():
    originals = {}
    patching.undo()  # whatever earlier tests left
    rows = (*cpu_patches.CPU_MODE, *parallel_patches.PIPELINE, *checkpoint_patches.STRIDED_CHECKPOINT,
            *checkpoint_patches.SKIP_DAMAGED_STEPS)
    for patch in rows:
        owner, name = patch.owner_and_name()
        originals[patch.target] = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    filters, handlers = list(warnings.filters), {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    job_patches.apply_job()
    patching.apply_once(checkpoint_patches.CHECKPOINT_MANIFEST)
    patching.apply_once(checkpoint_patches.SKIP_DAMAGED_STEPS)
    job_patches.apply_signal_handlers(lambda number, frame: None)
    assert "finish" in vars(FileSystemWriter) and signal.getsignal(signal.SIGTERM) is not handlers[signal.SIGTERM]
    cpu_patches.apply_cpu_mode()
    cpu_patches.apply_cpu_mode()  # once per process: a second job in the process applies nothing twice
    patching.apply_once(parallel_patches.PIPELINE)
    patching.apply_once(parallel_patches.PIPELINE)
    patching.apply_once(checkpoint_patches.STRIDED_CHECKPOINT)
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    assert tools_utils.device_type == "cpu" and len(warnings.filters) > len(filters)
    assert dist_utils.clip_grad_norm_ is not originals["torchtitan.distributed.utils:clip_grad_norm_"]
    patching.undo()
    for patch in rows:
        owner, name = patch.owner_and_name()
        now = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
        assert now is originals[patch.target], patch.target
    assert "finish" not in vars(FileSystemWriter)  # inherited again, as shipped
    assert {n: signal.getsignal(n) for n in handlers} == handlers
    assert warnings.filters == filters
    assert not patching.active()


def test_build_patches_last_only_while_building():
    import fla.layers.attn as attn

    before = attn.flash_attn_func
    with kernel_patches.building():
        assert attn.flash_attn_func is not None
    assert attn.flash_attn_func is before


def test_the_planners_rows_last_only_inside_its_blocks():
    """``PLANNER``: torch's storage resize (a method the class inherits), DTensor's shape inference and
    transformers' packed-sequence finder, changed inside a step peak's ``with`` and a planned step's, each as
    shipped after."""
    import torch
    import transformers.masking_utils as masking

    from titan_ext.planner import memory, microbatches, rank

    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules

    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    finder, inherited = masking.find_packed_sequence_indices, torch.UntypedStorage.resize_
    p2p, infer = schedules._batch_p2p, ShardingPropagator._propagate_tensor_meta_non_cached
    with memory.StepPeak():
        assert torch.UntypedStorage.resize_ is not inherited
        assert ShardingPropagator._propagate_tensor_meta_non_cached is not infer
    with rank._whole_windows():
        assert masking.find_packed_sequence_indices(torch.arange(4)[None]) is None
    with rank._schedules_as_on_a_real_group():
        assert schedules.dist is not dist and schedules.dist.get_backend is not dist.get_backend
    from titan_ext.kernels import cp_attention
    attend = cp_attention.per_document_sdpa
    with patching.scoped((planner_patches.DOCUMENTS_AS_WHOLE_ROWS,)):
        assert cp_attention.per_document_sdpa is not attend
    assert cp_attention.per_document_sdpa is attend
    stepped = microbatches.Microbatches.__new__(microbatches.Microbatches)
    with stepped:
        assert schedules._batch_p2p is not p2p and microbatches._STEPPED == [stepped]
    assert masking.find_packed_sequence_indices is finder and torch.UntypedStorage.resize_ is inherited
    assert "resize_" not in vars(torch.UntypedStorage)
    assert schedules.dist is dist and schedules._batch_p2p is p2p and microbatches._STEPPED == []
    assert ShardingPropagator._propagate_tensor_meta_non_cached is infer


@pytest.mark.parametrize("path", kernels.PATHS)
def test_binding_one_model_leaves_fla_classes_alone(path):
    import fla.layers.gla as gla
    from fla.models import GLAConfig, GLAForCausalLM

    model = GLAForCausalLM(GLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=64))
    layer = model.model.layers[0].attn
    kernels.bind(model, path)
    assert type(layer) is not gla.GatedLinearAttention and isinstance(layer, gla.GatedLinearAttention)
    assert type(layer).forward.__code__ is gla.GatedLinearAttention.forward.__code__  # fla's own code
    assert gla.chunk_gla.__module__.startswith("fla.")


def test_a_job_silences_host_noise_that_asks_nothing_of_its_user(caplog):
    """Each JOB_WARNINGS/JOB_LOGS row drops its message during a titan_ext job, and only then."""
    import logging

    patching.undo()

    def emitted() -> int:
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", append=True)  # behind the job's filters, which come first
            for message, _, _ in job_patches.JOB_WARNINGS:
                warnings.warn(message.replace(".*", " (FSDPGLAForTitan) "), UserWarning)
        with caplog.at_level(logging.WARNING):
            for name, part, _ in job_patches.JOB_LOGS:
                logging.getLogger(name).warning(f"x {part} y")
        return len(caught) + len(caplog.records)

    everything = len(job_patches.JOB_WARNINGS) + len(job_patches.JOB_LOGS)
    assert emitted() == everything
    job_patches.apply_job()
    try:
        assert emitted() == 0
    finally:
        patching.undo()
    assert emitted() == everything


def test_an_entry_point_is_quiet_for_its_call_alone(caplog):
    """``quiet_entry`` drops the job's and ENTRY_WARNINGS' notices inside its scope, none outside."""
    import logging

    def emitted() -> int:
        caplog.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", append=True)
            for message, _, _ in job_patches.ENTRY_WARNINGS:
                warnings.warn(f"{message} y", FutureWarning)
        with caplog.at_level(logging.WARNING):
            for name, part, _ in job_patches.JOB_LOGS:
                logging.getLogger(name).warning(f"x {part} y")
        return len(caught) + len(caplog.records)

    everything = len(job_patches.ENTRY_WARNINGS) + len(job_patches.JOB_LOGS)
    assert emitted() == everything
    with job_patches.quiet_entry():
        assert emitted() == 0
    assert emitted() == everything


def test_document_positions_reach_every_pipeline_stage():
    """``TRAINER_BATCH``: torchtitan forwards its extra kwargs (not its extra inputs) to every PP stage; with
    document masking the boundaries join them, on the one Trainer of the job."""
    import types

    import torch
    from torchtitan.train import Trainer

    from titan_ext.data import documents

    trainer = object.__new__(Trainer)
    trainer.model_args, trainer.parallel_dims = None, types.SimpleNamespace(cp_enabled=False)
    batch = {"input": torch.zeros(2, 4, dtype=torch.long), "document_positions": torch.arange(4).expand(2, 4)}
    labels = torch.zeros(2, 4, dtype=torch.long)
    _, _, extra_inputs, extra_kwargs = trainer.post_dataloading_process(dict(batch), labels)
    assert "document_positions" in extra_inputs and "document_positions" not in extra_kwargs  # torchtitan's split
    job_patches.TRAINER_BATCH.apply(trainer, documents.to_every_stage)
    _, _, extra_inputs, extra_kwargs = trainer.post_dataloading_process(dict(batch), labels)
    assert extra_inputs == {} and extra_kwargs["document_positions"] is batch["document_positions"]
    assert "post_dataloading_process" not in vars(Trainer) or vars(Trainer)["post_dataloading_process"] is \
        Trainer.post_dataloading_process  # the class is untouched
    with pytest.raises(TypeError):
        job_patches.TRAINER_BATCH.apply(types.SimpleNamespace(), documents.to_every_stage)


def test_the_planners_fake_cache_keys_tell_apart_exactly_what_torchs_do():
    """``FAKE_CACHE_KEYS``: two calls of an operator share a cached fake answer under the planner's keys exactly
    where they share one under torch's own: fake tensors differing in any metadata torch keys by, and values
    of different types or containers."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState  # torch's own keys: tests only

    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 6)
        complex_ = torch.empty(4, 6, dtype=torch.complex64)
        with torch.inference_mode():
            inference = torch.empty(4, 6)
        tensors = [x, torch.empty(4, 6), torch.empty(4, 6, dtype=torch.bfloat16), torch.empty(6, 4).t(),
                   torch.empty(5, 6)[1:], torch.empty(8, 6)[:4], torch.empty(4, 6, requires_grad=True), inference,
                   complex_, complex_.conj(), torch._neg_view(complex_), torch.empty(4, 6, device="meta")]
    calls = [(t,) for t in tensors] + [(x, 1), (x, 1.0), (x, True), (x, [x, x]), (x, (x, x)), (x, None), (x, [x])]

    def keys():
        return [mode._cache_key(_CacheKeyState(mode.shape_env), torch.ops.aten.add.Tensor, args, {}) for args in calls]

    torchs, shipped = keys(), FakeTensorMode._prep_args_for_hash
    with patching.scoped((planner_patches.FAKE_CACHE_KEYS,)):
        assert FakeTensorMode._prep_args_for_hash is not shipped
        ours = keys()
    assert FakeTensorMode._prep_args_for_hash is shipped
    for i in range(len(calls)):
        for j in range(len(calls)):
            assert (ours[i] == ours[j]) == (torchs[i] == torchs[j]), (i, j)
    assert len(set(ours)) == len(calls) - 1  # only x and a fresh tensor of its metadata share a key


def test_a_planned_ranks_mesh_has_the_groups_and_names_it_has_without_the_planners_row():
    """``FAKE_GROUPS_OF_OTHER_RANKS``: inside the planner's fake group, a device mesh's groups without this rank
    only take their names; this rank's groups are the same, with the same names, and so is every later group's
    name."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    from titan_ext import compat
    from titan_ext.planner import rank

    def groups():
        mesh = init_device_mesh("cpu", (4, 2, 8), mesh_dim_names=("dp", "cp", "tp"))
        flat = mesh["dp", "cp"]._flatten("dp_cp")
        return ([(g.group_name, dist.get_process_group_ranks(g)) for g in [*mesh.get_all_groups(), flat.get_group()]],
                dist.new_group([20, 21]).group_name, c10d._world.group_count)

    with rank.fake_group(64, 21):
        import torch

        if torch.__version__ >= "2.13":  # torch 2.11's new_group takes other arguments: left as shipped there
            assert c10d._new_group_with_tag.__module__ == "titan_ext.planner.host_patches"
        planned = groups()
    assert c10d._new_group_with_tag.__module__ == "torch.distributed.distributed_c10d"  # restored
    dist.init_process_group("fake", store=compat.fake_process_group().FakeStore(), rank=21, world_size=64)
    try:
        shipped = groups()
    finally:
        dist.destroy_process_group()
    assert planned == shipped and [len(ranks) for _, ranks in planned[0]] == [4, 2, 8, 8]
