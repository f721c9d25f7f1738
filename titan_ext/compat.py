"""Every private API of torchtitan, fla and torch that titan_ext uses, looked up here and only when needed.

A patch release may rename any of these. Nothing here runs at ``import
titan_ext``: each accessor resolves its symbols on first use (a GLA model's
kernels, activation checkpointing, ...), so a rename breaks only the feature
that needs the symbol, and it fails in one line naming the versions titan_ext
was checked against.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
import types

SUPPORTED = {
    "torchtitan": "0.2.2 (0.2.x)",
    "flash-linear-attention": "0.6.0 (0.6.x)",
    "torch": "2.11-2.15",
    "transformers": "5.17-5.24",
    "torchdata": "0.11 (torchtitan 0.2.2's)",
}


class CompatError(RuntimeError):
    """A private symbol titan_ext relies on is missing from the installed package."""


def owner_and_name(target: str) -> tuple[object, str]:
    """``"module:Class.attr"`` -> (the module or class holding it, ``"attr"``), importing the module."""
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


def resolve(target: str):
    """The object a target names; a class attribute as defined on the class (not bound)."""
    owner, name = owner_and_name(target)
    return vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _lookup(package: str, module: str, *names: str) -> types.SimpleNamespace:
    try:
        owner = importlib.import_module(module)
        return types.SimpleNamespace(**{name: getattr(owner, name) for name in names})
    except (ImportError, AttributeError) as error:
        raise CompatError(
            f"titan_ext needs {module}.{'/'.join(names)} ({error}); installed {package} {_version(package)}, "
            f"supported {SUPPORTED[package]}: install a supported version"
        ) from None


@functools.cache
def torchtitan_ac() -> types.SimpleNamespace:
    """torchtitan's activation-checkpoint helpers (``_apply_full_ac``, ``_apply_op_sac``) and Llama's save list."""
    ac = _lookup("torchtitan", "torchtitan.distributed.activation_checkpoint", "apply_ac", "_apply_full_ac", "_apply_op_sac")
    save = _lookup("torchtitan", "torchtitan.models.llama3.infra.parallelize", "_op_sac_save_list")
    return types.SimpleNamespace(
        apply_ac=ac.apply_ac, apply_full_ac=ac._apply_full_ac, apply_op_sac=ac._apply_op_sac,
        op_sac_save_list=save._op_sac_save_list,
    )


@functools.cache
def fla_gla_drivers() -> types.SimpleNamespace:
    """fla's GLA forward/backward drivers (what ``ChunkGLAFunction`` runs) and their helpers."""
    drivers = _lookup("flash-linear-attention", "fla.ops.gla.chunk", "chunk_gla_fwd", "chunk_gla_bwd", "chunk_gla")
    helpers = _lookup("flash-linear-attention", "fla.ops.utils", "prepare_chunk_indices")
    guard = _lookup("flash-linear-attention", "fla.utils", "input_guard")
    return types.SimpleNamespace(**vars(drivers), **vars(helpers), **vars(guard))


@functools.cache
def fla_kda_drivers() -> types.SimpleNamespace:
    """fla's KDA forward/backward drivers and the in-kernel L2 norm and ``sigmoid(beta)`` around them (what
    ``ChunkKDAFunction`` runs), with their helpers."""
    parts = (
        _lookup("flash-linear-attention", "fla.ops.kda.chunk_fwd", "chunk_kda_fwd"),
        _lookup("flash-linear-attention", "fla.ops.kda.chunk_bwd", "chunk_kda_bwd"),
        _lookup("flash-linear-attention", "fla.modules.norm.l2norm", "l2norm_fwd", "l2norm_bwd"),
        _lookup("flash-linear-attention", "fla.ops.common.gate", "fused_beta_sigmoid_fwd", "fused_beta_sigmoid_bwd"),
        _lookup("flash-linear-attention", "fla.ops.utils", "prepare_chunk_indices"),
        _lookup("flash-linear-attention", "fla.utils", "input_guard"),
        _lookup("flash-linear-attention", "fla.ops.kda.chunk", "chunk_kda"),
    )
    return types.SimpleNamespace(**{name: value for part in parts for name, value in vars(part).items()})


@functools.cache
def transformers_weight_conversion() -> types.SimpleNamespace:
    """transformers' checkpoint conversion (5.x): the conversion list a model loads through
    (``get_model_conversion_mapping``), the renaming of one checkpoint key (``rename_source_key``), the key order
    converters collect in (``dot_natural_key``), the save-side reverse (``revert_weight_conversion``), and the
    classes of its transforms and of the operations titan_ext reads a box of (``MergeModulelist``, ``Concatenate``)."""
    mapping = _lookup("transformers", "transformers.conversion_mapping", "get_model_conversion_mapping")
    core = _lookup("transformers", "transformers.core_model_loading", "WeightConverter", "WeightRenaming",
                   "MergeModulelist", "Concatenate", "rename_source_key", "revert_weight_conversion", "dot_natural_key")
    return types.SimpleNamespace(**vars(mapping), **vars(core))


@functools.cache
def fla_block_drivers() -> types.SimpleNamespace:
    """fla's forward/backward drivers of the other kernels a GLA, Gated DeltaNet or KDA block reaches (what
    fla's autograd Functions run): the norms (``LayerNormFunction``, ``LayerNormGatedFunction``), SwiGLU,
    the short convolution, the rotary embedding, GLA's fused recurrence and the gated delta rule."""
    fla = "flash-linear-attention"
    parts = (
        _lookup(fla, "fla.modules.norm.layernorm", "layer_norm_fwd", "layer_norm_bwd"),
        _lookup(fla, "fla.modules.norm.fused_norm_gate", "layer_norm_gated_fwd", "layer_norm_gated_bwd"),
        _lookup(fla, "fla.modules.activations.ops", "swiglu_fwd", "swiglu_fwdbwd"),
        _lookup(fla, "fla.modules.causal_conv1d.ops", "causal_conv1d_fwd", "causal_conv1d_bwd", "_has_non_standard_layout"),
        _lookup(fla, "fla.modules.rotary.ops", "rotary_embedding_fwdbwd"),
        _lookup(fla, "fla.ops.common.fused_recurrent", "fused_recurrent_fwd", "fused_recurrent_bwd"),
        _lookup(fla, "fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule_fwd", "chunk_gated_delta_rule_bwd"),
        _lookup(fla, "fla.modules.norm.l2norm", "l2norm_fwd", "l2norm_bwd"),
        _lookup(fla, "fla.ops.common.gate", "fused_beta_sigmoid_fwd", "fused_beta_sigmoid_bwd"),
        _lookup(fla, "fla.ops.utils", "prepare_chunk_indices"),
        _lookup(fla, "fla.utils", "input_guard"),
    )
    return types.SimpleNamespace(**{name: value for part in parts for name, value in vars(part).items()})


def transformers_own_classes(model_type: str) -> tuple[type, type] | None:
    """(config class, causal-LM class) transformers itself ships for ``model_type`` (None: it ships none),
    whatever another library registered under that name since (importing fla registers its Mamba, Mamba2 and
    BitNet as ``mamba``, ``mamba2`` and ``bitnet``): read from transformers' own name tables."""
    from transformers.models.auto import configuration_auto, modeling_auto

    config_name = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
    model_name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if not (config_name and model_name):
        return None
    module = importlib.import_module(f"transformers.models.{configuration_auto.model_type_to_module_name(model_type)}")
    classes = importlib.import_module("transformers")  # a type may reuse another's class (EXAONE: Llama's)
    return getattr(module, config_name, None) or getattr(classes, config_name), getattr(classes, model_name)


def metrics_rank(parallel_dims, job_config) -> int:
    """The rank torchtitan's metrics logger writes from (the last pipeline stage's first rank under PP)."""
    return _lookup("torchtitan", "torchtitan.components.metrics", "_get_metrics_rank")._get_metrics_rank(
        parallel_dims, job_config
    )


def autograd_enabled_inside_kernel():
    """A guard that turns autograd back on inside a custom op's kernel (torch's dispatch-key internals).

    The dispatcher excludes the autograd keys while an op's kernel runs; the
    portable GLA backward differentiates its forward there.
    """
    C = torch_c()
    keys = C.DispatchKey
    autograd = C.DispatchKeySet(keys.AutogradFunctionality)
    for key in (keys.AutogradOther, keys.AutogradNestedTensor, keys.ADInplaceOrView):
        autograd = autograd | C.DispatchKeySet(key)
    include, exclude = C._dispatch_tls_local_include_set(), C._dispatch_tls_local_exclude_set()
    return C._ForceDispatchKeyGuard(include, exclude - autograd)


def torch_c():
    import torch

    for name in ("_ForceDispatchKeyGuard", "_dispatch_tls_local_include_set", "_dispatch_tls_local_exclude_set"):
        if not hasattr(torch._C, name):
            raise CompatError(f"titan_ext needs torch._C.{name}; installed torch {torch.__version__}, supported {SUPPORTED['torch']}")
    return torch._C


def importing_trainer_job_config():
    """The ``JobConfig`` of the torchtitan ``Trainer`` whose ``__init__`` is importing titan_ext, else None.

    torchtitan imports ``[experimental] custom_import`` first thing in
    ``Trainer.__init__`` (train.py, 0.2.2), before it picks the device: the
    only moment titan_ext can set up a job for torchtitan's own code. The
    frame is recognised by its file and function (``-m torchtitan.train`` runs
    that file as ``__main__``), so a subclass of Trainer counts.
    """
    frame = _frame_on_stack("torchtitan.train", "__init__", lambda f: "job_config" in f.f_locals)
    return None if frame is None else frame.f_locals["job_config"]


def importing_trainer():
    """The torchtitan ``Trainer`` whose ``__init__`` is importing titan_ext (see ``importing_trainer_job_config``)."""
    frame = _frame_on_stack("torchtitan.train", "__init__", lambda f: "job_config" in f.f_locals)
    return None if frame is None else frame.f_locals.get("self")


def _frame_on_stack(module: str, function: str, accept=lambda frame: True):
    """The innermost caller frame running ``function`` of ``module``'s file (matched by file, not by
    module object: ``-m torchtitan.train`` runs that file as ``__main__``)."""
    path = _origin(module)
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename == path and accept(frame):
            return frame
        frame = frame.f_back
    return None


@functools.cache
def _origin(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    return spec.origin if spec else None


def parsing_torchtitan_config() -> bool:
    """Whether torchtitan's ``ConfigManager`` is importing titan_ext (for ``custom_config_module``).

    That import comes before the Trainer exists; see ``titan_ext.config.__getattr__``.
    """
    return _frame_on_stack("torchtitan.config.manager", "_maybe_add_custom_config") is not None


def maybe_mark_dynamic(tensor, dim: int) -> None:
    """Ask dynamo to trace ``tensor``'s ``dim`` as a symbol from the first compile (``torch._dynamo``,
    not re-exported by ``torch.compiler`` in 2.11-2.13); a no-op for eager code."""
    import torch._dynamo

    torch._dynamo.maybe_mark_dynamic(tensor, dim)


@functools.cache
def varlen_attention():
    """torch's variable-length attention kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA), or None
    where this torch lacks it or its ``window_size``/``enable_gqa`` arguments (torch 2.13 has both)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return varlen_attn if {"window_size", "enable_gqa", "scale"} <= set(parameters) else None


def once_per_run(fn) -> None:
    """Call ``fn()`` once per run of the calling code: now in eager code, and while dynamo traces compiled
    code (``torch._dynamo.comptime``: no op in the graph, no guard, so nothing recompiles)."""
    import torch

    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(lambda ctx: fn())
    else:
        fn()


def strided_shard(dim: int, split_factor: int):
    """torch's ``_StridedShard`` placement: rank r holds shard r of each of ``split_factor`` equal pieces of ``dim``
    (``torch.distributed.tensor.placement_types``, private)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def is_shard(placement) -> bool:
    """``Shard`` or ``_StridedShard`` (either splits its dim)."""
    from torch.distributed.tensor import Shard

    return isinstance(placement, Shard) or is_strided_shard(placement)


def shard_on_view(placement, dim: int, split: bool):
    """``placement`` on a view that splits ``dim`` into (split factor, rest): the strided shard being split
    (``split``) becomes a ``Shard`` of the rest; placements of later dims move one dim on."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if split:
        return Shard(dim + 1)
    if not is_shard(placement) or placement.dim < dim:
        return placement
    if is_strided_shard(placement):
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    return Shard(placement.dim + 1)


def dtensor_local_box(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of this rank's shard (``torch.distributed.tensor._utils``, private)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(sizes), tuple(offsets)


def all_gather_autograd(tensor, group, dim: int = 0):
    """An all-gather along ``dim`` whose backward sums each slice's gradient over the ranks
    (``torch.distributed._functional_collectives``: traceable by dynamo, runs on gloo and NCCL)."""
    from torch.distributed import _functional_collectives as funcol

    # the newer name where torch has it: torch 2.13's old one warns on every call
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(tensor, gather_dim=dim, group=group)


def all_to_all_counts(counts, group):
    """Each rank's ``counts`` split evenly over the ranks, exchanged (rank r receives every rank's r-th piece),
    finished: the sizes of an uneven all-to-all (``torch.distributed._functional_collectives``)."""
    from torch.distributed import _functional_collectives as funcol

    return _finished(funcol.all_to_all_single(counts, None, None, group))


def all_to_all_autograd(tensor, output_sizes: list[int], input_sizes: list[int], group):
    """An uneven all-to-all of rows whose backward sends the gradients back the same way
    (``torch.distributed._functional_collectives``: runs on gloo and NCCL)."""
    from torch.distributed import _functional_collectives as funcol

    return _finished(funcol.all_to_all_single_autograd(tensor, output_sizes, input_sizes, group))


def grouped_mm(rows, weights, ends):
    """``rows [T, in]`` times each group's ``weights[g] [in, out]``, group g the rows up to ``ends[g]``, through
    transformers' dispatcher (``transformers.integrations.moe._grouped_mm``): torch's grouped GEMM where it runs
    (CPU; CUDA from SM80; only bfloat16 under torch.compile), else its own loop over the groups (a custom op)."""
    import torch

    moe = _lookup("transformers", "transformers.integrations.moe", "_grouped_mm")
    return moe._grouped_mm(rows, weights, ends.to(torch.int32))


def experts_dispatch_of(hf_class: type) -> dict:
    """The class attribute that makes a subclass of ``hf_class`` dispatch its experts as ``hf_class`` does.

    transformers lets a model choose its experts forward (``grouped_mm`` by default) only when the source of
    the model class's module uses ``@use_experts_implementation`` (``_can_set_experts_implementation``, whose
    answer it caches on the class); a class made elsewhere (``adapter.titan_class``) would get its loop over
    the experts ("eager"). Its experts module is the model's own, so the answer is the model class's (the
    check and its cached attribute read in transformers 5.17 and 5.24)."""
    check = getattr(hf_class, "_can_set_experts_implementation", None)
    if check is None:
        raise CompatError(
            f"titan_ext needs {hf_class.__name__}._can_set_experts_implementation; installed transformers "
            f"{_version('transformers')}, supported {SUPPORTED['transformers']}: install a supported version"
        )
    return {"_can_set_experts_implementation_cached_value": bool(check())}


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (where activation checkpointing
    recomputes a forward): ``torch._C._current_graph_task_id``."""
    import torch

    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is None:
        raise CompatError(
            f"titan_ext needs torch._C._current_graph_task_id; installed torch {torch.__version__}, "
            f"supported {SUPPORTED['torch']}"
        )
    return task() != -1


def fla_rotary_tables(rotary, length: int, like):
    """fla ``RotaryEmbedding``'s cos/sin tables for ``length`` positions, in ``like``'s device and dtype
    (its private ``_update_cos_sin_cache`` and ``_cos_cached``/``_sin_cached``)."""
    for name in ("_update_cos_sin_cache", "_cos_cached", "_sin_cached", "interleaved"):
        if not hasattr(rotary, name):
            raise CompatError(
                f"titan_ext needs fla's RotaryEmbedding.{name}; installed flash-linear-attention "
                f"{_version('flash-linear-attention')}, supported {SUPPORTED['flash-linear-attention']}"
            )
    rotary._update_cos_sin_cache(length, device=like.device, dtype=like.dtype)
    return rotary._cos_cached, rotary._sin_cached


@functools.cache
def torch_ring_template() -> types.SimpleNamespace:
    """torch's ring-attention template, forward and backward (what its CP dispatcher runs for CUDA's SDPA
    kernels); titan_ext's CPU handlers (``kernels.ring_attention``) run it with the CPU kernel."""
    ring = _lookup("torch", "torch.distributed.tensor.experimental._context_parallel._attention",
                   "_templated_ring_attention", "_templated_ring_attention_backward")
    return types.SimpleNamespace(forward=ring._templated_ring_attention, backward=ring._templated_ring_attention_backward)


@functools.cache
def torch_cp_options() -> types.SimpleNamespace:
    """torch's context-parallel options: ``_cp_options`` (whether the ring expects head-tail pieces, set by
    torchtitan's input sharding each step) and ``set_rotate_method`` (how the ring passes keys and values)."""
    return _lookup("torch", "torch.distributed.tensor.experimental._attention", "_cp_options", "set_rotate_method")


def waited(tensor):
    """``tensor`` with a functional collective's result still in flight (``AsyncCollectiveTensor``, what
    ``DTensor.to_local`` gives after a redistribution) finished, in forward, and its gradient likewise in
    backward (a redistribution's backward can hand one over): a Triton kernel reads memory directly, so it
    must receive neither wrapper. Differentiable, without a copy."""
    if not tensor.requires_grad:
        return _finished(tensor)
    return _wait_function().apply(tensor)


def _finished(tensor):
    from torch.distributed import _functional_collectives as funcol

    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


@functools.cache
def _wait_function():
    import torch

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return _finished(x).view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return _finished(grad)

    return Wait


def triton_version_string() -> str:
    return _version("triton")


def triton_version() -> tuple[int, ...]:
    """The installed Triton's (major, minor), (0,) when it is missing."""
    import re

    found = re.match(r"(\d+)\.(\d+)", _version("triton"))
    return (int(found[1]), int(found[2])) if found else (0,)


def torch_dispatch_mode():
    """torch's ``TorchDispatchMode`` (``torch.utils._python_dispatch``): the planner's collective recorder."""
    return _lookup("torch", "torch.utils._python_dispatch", "TorchDispatchMode").TorchDispatchMode


def current_dispatch_mode():
    """The innermost torch dispatch mode in force, or None (``torch.utils._python_dispatch``): where the
    planner's watchers join one mode instead of stacking their own."""
    return _lookup("torch", "torch.utils._python_dispatch", "_get_current_dispatch_mode")._get_current_dispatch_mode()


def c10d_groups() -> types.SimpleNamespace:
    """c10d's group bookkeeping (``torch.distributed.distributed_c10d``): the default group, a group's backend,
    the next group name (a number), the marker of a group without this rank, and whether groups end with a
    barrier (``TORCH_DIST_INIT_BARRIER``)."""
    c10d = _lookup("torch", "torch.distributed.distributed_c10d", "_get_default_group", "get_backend",
                   "_process_group_name", "GroupMember", "_is_barrier_after_init")
    return types.SimpleNamespace(
        default_group=c10d._get_default_group, backend_of=c10d.get_backend,
        group_name=lambda ranks: c10d._process_group_name(ranks, use_hashed_name=False),
        non_member=c10d.GroupMember.NON_GROUP_MEMBER, barrier_after_init=lambda: c10d._is_barrier_after_init() == 1,
    )


def resolve_process_group(name: str):
    """The process group a functional collective names (``torch._C._distributed_c10d``)."""
    return _lookup("torch", "torch._C._distributed_c10d", "_resolve_process_group")._resolve_process_group(name)


def fake_process_group() -> types.SimpleNamespace:
    """torch's fake backend (``init_process_group("fake", store=FakeStore())``: any world size in one process,
    collectives return without moving data; what torchtitan's ``--comm.mode fake_backend`` uses) and
    ``FakeTensorMode`` (tensors with shapes and dtypes, no storage: ``FakeTensor``)."""
    store = _lookup("torch", "torch.testing._internal.distributed.fake_pg", "FakeStore")
    mode = _lookup("torch", "torch._subclasses.fake_tensor", "FakeTensorMode", "FakeTensor")
    return types.SimpleNamespace(FakeStore=store.FakeStore, FakeTensorMode=mode.FakeTensorMode, FakeTensor=mode.FakeTensor)


@functools.cache
def fake_tensor_mode() -> types.SimpleNamespace:
    """torch's ``FakeTensorMode`` and ``FakeTensor``; the operators the mode answers first in its dispatch, from a
    fake tensor's metadata (``_DISPATCH_META_HANDLERS``: ``prim.device``, a size, a stride); whether its cache
    makes an output as the torch known to the planner does (``_get_output_tensor_from_cache_entry``), and
    ``output_from_metadata``: that output, made faster. The planner's watched fake mode uses them."""
    import inspect

    import torch

    fake = _lookup("torch", "torch._subclasses.fake_tensor", "FakeTensorMode", "FakeTensor", "_DISPATCH_META_HANDLERS",
                   "FakeTensorConfig")
    made = getattr(fake.FakeTensorMode, "_get_output_tensor_from_cache_entry", None)
    # (self, state, entry, key, func, args) in torch 2.11 and 2.13; 2.15 dropped ``func``. Either way the output
    # is a view where the entry names its input (``view_idx``: set for view operators alone).
    known = made is not None and list(inspect.signature(made).parameters) in (
        ["self", "state", "entry", "key", "func", "args"], ["self", "state", "entry", "key", "args"])
    undispatched, subclass = torch._C._DisableTorchDispatch, torch.Tensor._make_subclass

    def output_from_metadata(mode, entry, args, device, attributes: dict):
        """What ``FakeTensorMode._get_output_tensor_from_cache_entry`` makes from a cache entry's metadata without a
        shape environment, for an output that is not an input written in place: an empty meta tensor of its shape
        and strides (a view's on its input's storage), made a ``FakeTensor`` on ``device`` as ``FakeTensor.__new__``
        makes it (``attributes``: those of one it made on that device), without the checks of its arguments."""
        metadata = entry.metadata
        with undispatched():  # torch's in_kernel_invocation_manager besides: of no effect on meta tensors' own ops
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, layout=metadata.layout,
                                        device="meta", requires_grad=metadata.requires_grad)
            if metadata.is_conj:
                torch._C._set_conj(empty, True)
            if metadata.is_neg:
                torch._C._set_neg(empty, True)
            if entry.view_idx is not None:
                empty.set_(args[entry.view_idx].untyped_storage(), metadata.storage_offset, metadata.shape,
                           metadata.stride)
        out = subclass(fake.FakeTensor, empty, empty.requires_grad, dispatch_device=True, device_for_backend_keys=device)
        if not mode._allow_unsafe_data_ptr_access:
            torch._C._set_throw_on_mutable_data_ptr(out)
        else:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
        vars(out).update(attributes)
        return out

    return types.SimpleNamespace(
        FakeTensorMode=fake.FakeTensorMode, FakeTensor=fake.FakeTensor, metadata_handlers=fake._DISPATCH_META_HANDLERS,
        debug=lambda: fake.FakeTensorConfig.debug, outputs_from_cache_entries=known, output_from_metadata=output_from_metadata,
    )


def clear_dtensor_caches() -> None:
    """Forget DTensor's process-wide caches, which are keyed by meshes or hold them.

    The sharding propagator's (its Python caches and the C++ fast path's copy) are keyed by meshes that compare
    equal across process groups, and hold the first mesh seen: a job planned or run after another in the same
    process would issue its collectives on the previous job's (destroyed) groups. The redistribution caches
    (``_redistribute``'s planners and transform steps, ``MeshTopoInfo``'s) hold meshes too, and through them
    their process groups: in a process that runs job after job (the planner's sweep, the test matrix's driver)
    each job's gloo groups, with their threads, sockets and stores, lived on (a 4-process matrix held 80
    groups a process, their loops busy). Those three are cleared where the installed torch has them: a release
    without one has nothing there to hold."""
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    caches = [getattr(propagator, name, None) for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached")]
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is None or not all(hasattr(cache, "cache_clear") for cache in caches):
        raise CompatError(
            "titan_ext needs DTensor's sharding_propagator caches and torch._C._clear_DTensor_sharding_propagator_cache; "
            f"installed torch {torch.__version__}, supported {SUPPORTED['torch']}"
        )
    for cache in caches:
        cache.cache_clear()
    native()
    getattr(_redistribute, "_planner_cache", {}).clear()
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def transformers_masking_module() -> types.ModuleType:
    """transformers' mask builders (``transformers.masking_utils``), whose ``find_packed_sequence_indices`` the
    planner answers for its fake batch of whole windows (on fake tensors it cannot read the position ids)."""
    _lookup("transformers", "transformers.masking_utils", "find_packed_sequence_indices")
    return importlib.import_module("transformers.masking_utils")


def set_pipeline_microbatches(schedule, count: int) -> None:
    """A single-stage pipeline schedule (``torch.distributed.pipelining``'s ``PipelineScheduleSingle``) set to
    step ``count`` microbatches after it was built: its constructor's check (1F1B: no fewer than stages) is the
    whole pipeline's, while the planner steps one stage with its own fewest (``planner.microbatches.stage_microbatches``)."""
    if not hasattr(schedule, "_n_microbatches") or not hasattr(schedule, "_stage"):
        raise CompatError("torch's single-stage pipeline schedule no longer keeps _n_microbatches and _stage")
    schedule._n_microbatches = count


def stage_input_gradients(stage):
    """A torch pipeline stage's ``_compute_input_grads``: its first step's metadata inference computes its input
    gradients with it (``autograd.grad``), which the planner answers (``planner.stages.input_gradients_derived``)."""
    method = getattr(stage, "_compute_input_grads", None)
    if method is None:
        raise CompatError(f"titan_ext needs torch's PipelineStage._compute_input_grads; installed torch "
                          f"{_version('torch')}, supported {SUPPORTED['torch']}: install a supported version")
    return method


def answer_stage_input_gradients(stage, answer) -> None:
    """``answer`` in place of ``stage``'s ``_compute_input_grads`` (``stage_input_gradients``); None: torch's again."""
    if answer is None:
        vars(stage).pop("_compute_input_grads", None)
    else:
        stage._compute_input_grads = answer


def pipeline_metadata() -> types.SimpleNamespace:
    """torch's pipeline-stage metadata (``torch.distributed.pipelining._utils``): what a stage receives from its
    neighbours on another rank before its first step; the planner hands it over itself."""
    return _lookup("torch", "torch.distributed.pipelining._utils", "InferenceMode", "_StageForwardMeta",
                   "_StageBackwardMeta", "_derive_grad_metas", "extract_tensor_metas")


def end_dataloader_workers(loader) -> None:
    """Stop the worker processes of a torchdata ``StatefulDataLoader`` now: it keeps its last iterator
    (``_iterator``, private), whose workers otherwise live until the garbage collector frees it."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        getattr(iterator, "_shutdown_workers", lambda: None)()  # the single-process iterator has none
        loader._iterator = None


def dataloader_steps_since_snapshot(loader_state: dict) -> int:
    """How many batches a torchdata ``StatefulDataLoader``'s state is past its workers' snapshot (the position
    ``dataloader_dataset_state`` reads; 0 without workers): torchdata's own load replays them."""
    return loader_state.get("_steps_since_snapshot", 0)


def dataloader_dataset_state(loader_state: dict) -> tuple[object, int]:
    """(its dataset's state, its number of workers) from a torchdata ``StatefulDataLoader``'s state, whose
    layout is private: at the top without workers, in worker 0's snapshot with one (taken at checkpoint steps: ``StreamDataloader``)."""
    try:
        snapshot = loader_state.get("_snapshot")
        if snapshot is None:
            loader_state["_num_yielded"]  # the single-process layout's mark
            return loader_state["dataset_state"], 0
        return snapshot["_worker_snapshots"]["worker_0"]["dataset_state"], snapshot["_main_snapshot"]["_num_workers"]
    except (KeyError, TypeError, AttributeError) as error:
        raise CompatError(
            f"titan_ext reads torchdata's StatefulDataLoader state ({error!r}); installed torchdata "
            f"{_version('torchdata')}, supported {SUPPORTED['torchdata']}: install a supported version"
        ) from None


def dcp_storage_extents(metadata) -> dict[str, int]:
    """Each file a DCP checkpoint's metadata names -> the bytes it must hold: its entries' largest offset + length
    (``Metadata.storage_data`` holds torch's private ``_StorageInfo`` records for a file-system checkpoint)."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends


def dcp_written_files(results) -> set[str]:
    """The files every rank wrote, from the write results DCP hands ``StorageWriter.finish`` (one list per rank,
    each result's ``storage_data`` a private ``_StorageInfo`` for a file-system checkpoint)."""
    return {result.storage_data.relative_path for rank_results in results for result in rank_results}
