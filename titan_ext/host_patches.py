"""Every change titan_ext makes to the libraries it runs inside, in one place.

``import titan_ext`` changes none of them. What changes, and when:

* ``CPU_MODE``: when torchtitan's ``Trainer`` imports titan_ext (its
  ``custom_import``) on a machine without an accelerator (or with
  ``TITAN_EXT_CPU=1``), stock torchtitan is pointed at the CPU and gloo.
  These stay for the rest of that process, which is that job's; ``undo()``
  restores every original.
* ``JOB``: in every torchtitan job that imports titan_ext, CPU or GPU.
* ``PER_JOB``: a flag or one object of the job, changed by the feature that
  needs it (DDP with compile, CP's rotate method, the optimizer's step, the
  metrics logger, step line, colours and close, the trainer's split of a batch and its close).
* ``PIPELINE``: in a pipeline-parallel job of a model with tied embeddings.
* ``CHECKPOINT_MANIFEST``: in a job that saves checkpoints; ``SKIP_DAMAGED_STEPS``: in a
  job that resumes past damaged steps (``--titan_ext.damaged_checkpoint skip``).
* ``SIGNALS``: the SIGINT and SIGTERM handlers of every titan_ext job (Python's, not a library's).
* ``INTERPRETER``: in a job whose fla kernels run under Triton's interpreter on
  the CPU (``--titan_ext.kernels fla`` with ``TRITON_INTERPRET=1``).
* ``CUDA``: in a job whose fla kernels run on CUDA (Triton's autotuning).
* ``BUILD``: only while titan_ext builds one of its own models (``building()``).
* ``PLANNER``: only inside the planner's blocks (``scoped()``): a step peak's ``with``
  (``planner.memory.StepPeak``) and a planned step's (``planner.rank``).

Each row: the target, why, the versions it was checked against, and how it is
undone. Not here, since it changes no library: the kernels titan_ext's own models
call instead of fla's (each kernel module's ``KERNELS``, ``titan_ext.kernels``).
``tests/test_host_patches.py`` checks that import changes nothing and
that ``undo()`` restores every original.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from titan_ext.compat import owner_and_name, resolve

TORCHTITAN = "torchtitan 0.2.2"
FLA = "fla 0.6.0"
TORCH = "torch 2.11-2.15"
TRITON = "triton 3.6-3.9"


@dataclass(frozen=True)
class Patch:
    target: str
    """``module:attribute`` or ``module:Class.attribute``."""
    why: str
    checked: str
    new: Callable[[object], object]
    """The original -> what the target becomes."""

    def owner_and_name(self) -> tuple[object, str]:
        return owner_and_name(self.target)

    def apply(self) -> Callable[[], None]:
        """Rebind the target; returns the undo (restores the original object, or a method the class
        inherits by deleting the class's own)."""
        owner, name = self.owner_and_name()
        if isinstance(owner, type) and name not in vars(owner):
            setattr(owner, name, self.new(getattr(owner, name)))
            return lambda: delattr(owner, name)
        original = resolve(self.target)
        setattr(owner, name, self.new(original))
        return lambda: setattr(owner, name, original)


def _cpu_device_module(_original):
    from titan_ext.cpu_mode import CPU_DEVICE_MODULE

    return CPU_DEVICE_MODULE


def _always_sum_on_gloo(original):
    """FSDP reduces with PREMUL_SUM when a divide factor is set; gloo has no PREMUL_SUM, so force SUM."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    return set_gradient_divide_factor


def _ring_attention_on_cpu(original):
    return {**original, **resolve("titan_ext.kernels.ring_attention:HANDLERS")}


def _no_peak_flops(_original):
    """A CPU has no peak in torchtitan's table: report MFU as 0 without its lspci/A100 warnings."""
    return lambda device_name: math.inf


_CPU = "torchtitan picks its device once at import and falls back to 'cuda' without an accelerator"
CPU_MODE: tuple[Patch, ...] = (
    Patch("torchtitan.tools.utils:device_type", _CPU, TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.tools.utils:device_module", _CPU + "; the trainer calls set_device/memory stats", TORCHTITAN, _cpu_device_module),
    Patch("torchtitan.distributed.utils:device_type", _CPU + "; gloo instead of nccl", TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.distributed.utils:device_module", _CPU + "; barrier needs an int device", TORCHTITAN, _cpu_device_module),
    Patch("torchtitan.distributed.parallel_dims:device_type", _CPU + "; meshes on cpu", TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.components.metrics:device_type", _CPU + "; memory monitor", TORCHTITAN, lambda _: "cpu"),
    Patch("torchtitan.components.metrics:device_module", _CPU + "; memory monitor", TORCHTITAN, _cpu_device_module),
    Patch("torchtitan.tools.utils:get_peak_flops", "no CPU entry; warns twice per rank and assumes an A100", TORCHTITAN, _no_peak_flops),
    Patch(
        "torch.distributed.fsdp:FSDPModule.set_gradient_divide_factor",
        "torchtitan's own apply_fsdp sets factor 1.0, which reduces with PREMUL_SUM: gloo lacks it",
        TORCH, _always_sum_on_gloo,
    ),
    Patch(
        "torch.distributed.tensor.experimental._context_parallel._attention:custom_ops",
        "torch's CP dispatcher (which torchtitan's apply_cp_to_attention_module enables from this table) rings only "
        "CUDA's SDPA kernels: the CPU kernel and its backward run the same ring template (kernels.ring_attention)",
        "torch 2.13", _ring_attention_on_cpu,
    ),
)

# Python warnings a CPU run cannot act on: (message regex, why).
CPU_MODE_WARNINGS: tuple[tuple[str, str], ...] = (
    ("Triton is not supported on current platform", "fla, on import: titan_ext's portable kernels run instead"),
    ("DTensor (random operators|manual_seed)", "torch: gloo meshes; titan_ext does not draw random numbers on DTensors"),
    ("Set timeout is now only supported", "torch, for gloo groups after step 1; the timeout is still applied"),
    ("'set_vital' is deprecated", "torchdata's dataloader, on every job"),
    ("In CPU autocast, but the target dtype is not supported",
     "torchtitan autocasts 1-process and DDP jobs to --training.mixed_precision_param; for float32 (the debug "
     "TOMLs') the CPU's autocast declines, and the job runs in float32 as asked"),
)


class _DropMessages(logging.Filter):
    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


# Log records a CPU run cannot act on: (logger, message part, why).
CPU_MODE_LOGS: tuple[tuple[str, str, str], ...] = (
    ("torchao", "Failed to load", "torchao's CUDA extensions (mxfp8, cutlass), on import"),
    ("", "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]", "torchtitan sets an NCCL variable; gloo never reads it"),
    ("", "Peak FLOPS used for computing MFU: inf",
     "the CPU has no peak FLOPS (get_peak_flops above): no MFU to compute, and the step line prints none"),
)

# Python warnings of any titan_ext job that ask nothing of its user: (message regex, why, versions seen).
JOB_WARNINGS: tuple[tuple[str, str, str], ...] = (
    ("FSDP2-wrapped module .* returned a view tensor",
     "torch's FSDP, on every rank at step 1: titan_ext's forward returns its logits as a view (reshaped from a "
     "packed row); only the loss reads them, nothing writes them in place", "torch 2.13-2.15"),
)

# Log records of any titan_ext job that ask nothing of its user: (logger, message part, why).
JOB_LOGS: tuple[tuple[str, str, str], ...] = (
    ("torch.utils._pytree", "is an Enum subclass",
     "torchao 0.18 registers its enums with torch.compile on import, which torch 2.13 deprecates"),
    ("transformers.utils.generic", "`past_key_values`/`cache_params` are deprecated",
     "fla 0.6's models build their outputs with past_key_values=, which transformers 5.24 renamed to cache"),
    ("", "Pipeline Parallel loss is not visible",
     "torchtitan's hint (every rank, under PP) to list the last stage's rank in LOG_RANK: titan_ext prints the step "
     "line from that rank (titan_ext.progress)"),
)


# Python warnings of titan_ext's entry points other than training (``titan_ext.kernels.from_pretrained(...)``
# and its ``generate``, the planner) that ask nothing of their user: (message regex, why, versions seen).
ENTRY_WARNINGS: tuple[tuple[str, str, str], ...] = (
    ("`past_key_values` is deprecated and will be removed",
     "fla 0.6's prepare_inputs_for_generation passes past_key_values=, which transformers 5.24 renamed to cache",
     "fla 0.6.0, transformers 5.24"),
    ("Both `past_key_values` and `cache` are set", "the same call, once transformers has made its cache",
     "fla 0.6.0, transformers 5.24"),
)


@contextlib.contextmanager
def quiet_entry() -> Iterator[None]:
    """The console of a titan_ext entry point other than training, for the call alone: the job's tables,
    ``ENTRY_WARNINGS``, and off an accelerator CPU mode's (its warnings and logs, not its patches)."""
    import torch

    cpu = not torch.accelerator.is_available()
    messages = [m for m, *_ in (*JOB_WARNINGS, *ENTRY_WARNINGS)] + [m for m, _ in CPU_MODE_WARNINGS] * cpu
    logs = [(name, part) for name, part, _ in (*JOB_LOGS, *(CPU_MODE_LOGS if cpu else ()))]
    filters = [(logging.getLogger(name), _DropMessages(part)) for name, part in logs]
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=message)
        for logger, log_filter in filters:
            logger.addFilter(log_filter)
        try:
            yield
        finally:
            for logger, log_filter in filters:
                logger.removeFilter(log_filter)


class _OneLineModelArgs(logging.Filter):
    """torchtitan logs the model args as indented JSON (~26 lines per rank); keep it to one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Building ") and "with {\n" in message:
            head, _, body = message.partition("with {\n")
            record.msg, record.args = f"{head.rstrip()} with {{{' '.join(body.split())}", None
        return True


JOB: tuple[tuple[str, str], ...] = (
    ("root logger: filter _OneLineModelArgs", "the model-args dump, one line instead of ~26 per rank"),
    ("torch._inductor.config._micro_pipeline_tp", "async TP (model_plans.enable_async_tp: model_plans imports "
     "no titan_ext, so it sets torch's flag itself, as torchtitan's own apply_tp does)"),
    ("torch CP: DTensor's SDPA handlers", "ring attention under CP (torchtitan's apply_cp_to_attention_module, as for "
     "its own models; titan_ext.context_parallel.apply_cp); torchtitan never turns it off"),
    ("root logger's handlers: filter progress.OtherRankQuiet", "on a rank other than 0, warnings, errors and the "
     "step line only (quiet_other_rank; torchtitan prints every INFO line once per rank)"),
)
"""Changes a job makes through torchtitan's or model_plans' own functions (listed, not applied here)."""


@dataclass(frozen=True)
class Setting:
    """A flag of a host library that an ``apply_*`` sets for its job, as torchtitan's own ``apply_*`` do;
    ``undo()`` restores it."""

    target: str
    why: str
    checked: str

    def set(self, value, setter: Callable[[object], None] | None = None) -> None:
        """Set the flag (through the library's own ``setter`` where it has one)."""
        owner, name = owner_and_name(self.target)
        original = getattr(owner, name)
        (setter or (lambda v: setattr(owner, name, v)))(value)
        _undo_stack.append(lambda: setattr(owner, name, original))


@dataclass(frozen=True)
class InstancePatch:
    """A method or attribute of one object torchtitan builds for a job: the change ends with the object."""

    target: str
    """``module:Class.attribute``: the class of the objects it applies to."""
    why: str
    checked: str

    def apply(self, instance, new: Callable[[object], object]) -> None:
        """``new(original) -> replacement`` on this one instance."""
        module, _, path = self.target.partition(":")
        class_name, _, name = path.rpartition(".")
        if not _instance_of(instance, module, class_name):
            raise TypeError(f"{self.target}: {type(instance).__name__} is not a {class_name}")
        setattr(instance, name, new(getattr(instance, name)))


def _instance_of(instance, module: str, class_name: str) -> bool:
    """Whether ``instance`` is a ``module:class_name``, the class found by its file (``torchrun -m
    torchtitan.train`` runs train.py as ``__main__``: its Trainer is not ``torchtitan.train``'s)."""
    origin = importlib.util.find_spec(module).origin
    return any(klass.__name__ == class_name and getattr(sys.modules.get(klass.__module__), "__file__", None) == origin
               for klass in type(instance).__mro__)


OPTIMIZE_DDP = Setting(
    "torch._dynamo.config:optimize_ddp",
    "'ddp_optimizer' for DDP with compile: dynamo splits the graph at DDP's buckets (titan_ext.parallelize.apply_ddp)",
    TORCH,
)
CP_ROTATE_METHOD = Setting(
    "torch.distributed.tensor.experimental._attention:_cp_options.rotate_method",
    "how the ring passes keys and values: --parallelism.context_parallel_rotate_method, which torchtitan 0.2.2 "
    "applies only in its own validator (titan_ext.context_parallel)",
    TORCH,
)
OPTIMIZER_STEP = InstancePatch(
    "torchtitan.components.optimizer:OptimizersContainer.step",
    "the non-finite-loss guard: every rank agrees on the step's flag, then steps, skips or stops before the update "
    "(titan_ext.nonfinite)",
    TORCHTITAN,
)
METRICS_LOGGER = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.logger",
    "--titan_ext.metrics_jsonl: every logged step also at full precision, as JSON lines (titan_ext.metrics)",
    TORCHTITAN,
)
METRICS_CLOSE = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.close",
    "the one component torchtitan closes after the checkpointer: an HF export is completed there (config.json, "
    "tokenizer; titan_ext.metrics)",
    TORCHTITAN,
)
METRICS_LOG = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.log",
    "a mixture-of-experts model's per-step metrics (the routers' balancing loss, tokens per expert) join the "
    "logged ones (titan_ext.host.moe_metrics, titan_ext.metrics)",
    TORCHTITAN,
)
METRICS_STEP_LINE = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.log",
    "its step line says step N of --training.steps and the time left, and no MFU where the device has no peak "
    "FLOPS; it is printed by the rank holding the loss only (titan_ext.progress, titan_ext.metrics)",
    TORCHTITAN,
)
METRICS_COLOR = InstancePatch(
    "torchtitan.components.metrics:MetricsProcessor.color",
    "torchtitan colours its lines with ANSI codes unless --metrics.disable_color_printing, also into a file: "
    "no colours off a terminal or with NO_COLOR set (titan_ext.progress)",
    TORCHTITAN,
)
TRAINER_BATCH = InstancePatch(
    "torchtitan.train:Trainer.post_dataloading_process",
    "torchtitan hands the dataloader's extra inputs to the first pipeline stage only, and its extra kwargs (its "
    "own models' attention masks, CP's positions) to every stage, which torch's schedule splits into micro-batches "
    "as it splits the inputs: document masking's document_positions join the kwargs, so every stage reads each "
    "micro-batch's boundaries (without PP the model receives both alike; titan_ext.documents)",
    TORCHTITAN,
)
TRAINER_CLOSE = InstancePatch(
    "torchtitan.train:Trainer.close",
    "the job's end (torchtitan's main calls it after training and after a failure) ends its dataloaders' worker "
    "processes, which torchdata keeps until the garbage collector frees the trainer: in a process running one job "
    "after another, a worker forked from one job outlived it (titan_ext.data.ending_dataloader_workers)",
    TORCHTITAN,
)
PER_JOB: tuple[Setting | InstancePatch, ...] = (OPTIMIZE_DDP, CP_ROTATE_METHOD, OPTIMIZER_STEP, METRICS_LOGGER, METRICS_CLOSE,
                                               METRICS_LOG, METRICS_STEP_LINE, METRICS_COLOR, TRAINER_BATCH, TRAINER_CLOSE)
"""Applied by the feature that needs it, to its own job (each names it)."""


def _configs_timed_equal(original):
    """The interpreter has no GPU driver to time configs with: every config times the same, so each kernel
    runs its first (none is run to be timed)."""

    def _bench(self, *args, config, **meta):
        return [0.0, 0.0, 0.0]

    return _bench


def _loop_variables_as_tensors(original):
    return resolve("titan_ext.kernels.interpreter:LoopVariablesAsTensors")()


INTERPRETER: tuple[Patch, ...] = (
    Patch(
        "triton.runtime.autotuner:Autotuner._bench",
        "fla's autotuned kernels time each config through a GPU driver, which the interpreter lacks ('0 active "
        "drivers'): every config times equal, so the first is taken",
        TRITON, _configs_timed_equal,
    ),
    Patch(
        "triton.runtime.interpreter:FunctionRewriter.ast_transformer",
        "the interpreter leaves for-loop variables Python ints, on which fla's kernels call .to() ('int' object has "
        "no attribute 'to'): each loop variable becomes an interpreter tensor (kernels.interpreter)",
        TRITON, _loop_variables_as_tensors,
    ),
)
"""Triton's interpreter (``TRITON_INTERPRET=1``) running fla's kernels on the CPU (``--titan_ext.kernels fla``)."""


def _configs_compiled_together(original):
    return resolve("titan_ext.kernels.autotune:configs_compiled_together")(original)


CUDA: tuple[Patch, ...] = (
    Patch(
        "triton.runtime.autotuner:Autotuner._bench",
        "Triton compiles an autotuned kernel's configs one by one as it times them: on a cold Triton cache a GLA "
        "340M block's fla kernels are 399 compiles for an H100 before the first step, 162 s of one CPU core. A "
        "tuning pass's configs are compiled together in threads (Triton's AsyncCompileMode), then timed one by "
        "one as before (kernels.autotune); fla's code and the configs timed are unchanged",
        TRITON, _configs_compiled_together,
    ),
)
"""A job whose fla kernels run on CUDA (the ``fla`` kernel path, not interpreted)."""


TIED_COPY = "_titan_ext_tied_copy"
"""Marks a pipeline stage's copy of a tied weight that gradient clipping must not count again (every copy but
the first stage's; set by ``titan_ext.parallel.pipeline.TiedWeight``)."""


def _tied_weight_counted_once(original):
    """Under PP torchtitan sums each stage's gradient norm; a tied weight has a copy on the first and the last stage
    (``titan_ext.parallel.pipeline.TiedWeight``, equal gradients): the norm counts the first stage's only, and every
    copy is clipped by the same factor. Without marked copies, torchtitan's function as shipped."""
    import torch

    def is_tied_copy(param) -> bool:
        return getattr(param, TIED_COPY, False)

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        copies = [p for p in parameters if is_tied_copy(p) and p.grad is not None]
        if not copies:
            return original(parameters, max_norm, *args, **kwargs)
        total = original([p for p in parameters if not is_tied_copy(p)], max_norm, *args, **kwargs)
        torch.nn.utils.clip_grads_with_norm_(copies, max_norm, total, kwargs.get("foreach"))
        return total

    return clip_grad_norm_


PIPELINE: tuple[Patch, ...] = (
    Patch(
        "torchtitan.distributed.utils:clip_grad_norm_",
        "under PP it adds up every stage's gradient norm, so a tied embedding/head weight (a copy on the first "
        "and the last stage) would count twice: its copies after the first stage's are left out of the norm "
        "and clipped by the same factor",
        TORCHTITAN, _tied_weight_counted_once,
    ),
)
"""A pipeline-parallel job whose model ties its head to its embedding (``titan_ext.parallel.pipeline``)."""


def _strided_checkpoint(name: str):
    def new(original):
        return resolve(f"titan_ext.strided_checkpoint:{name}")(original)

    return new


STRIDED_CHECKPOINT: tuple[Patch, ...] = tuple(
    Patch(
        f"torch.distributed.tensor:DTensor.{method}",
        "DCP describes each rank's shard of a DTensor as one box, which a _StridedShard that no later placement "
        "refines is not (each expert's [gate; up] rows split over TP): saved as overlapping chunks. Such a "
        "DTensor's local rows become boxes of the full tensor; any other DTensor as torch has it "
        "(titan_ext.strided_checkpoint)",
        TORCH, _strided_checkpoint(replacement),
    )
    for method, replacement in (("__create_write_items__", "create_write_items"),
                                ("__create_chunk_list__", "create_chunk_list"),
                                ("__get_tensor_shard__", "get_tensor_shard"))
)
"""A job that splits its experts' intermediate dims over TP (``titan_ext.parallel.expert_parallel.apply_expert_tp``)."""


def _checkpoints(name: str):
    def new(original):
        return resolve(f"titan_ext.inputs.checkpoints:{name}")(original)

    return new


CHECKPOINT_MANIFEST: tuple[Patch, ...] = (
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemWriter.write_data",
        "each rank records the size and CRC-32 of the files it wrote, as a piece of the step's manifest, while the "
        "page cache holds them (titan_ext.inputs.checkpoints.recording_checksums)",
        TORCH, _checkpoints("recording_checksums"),
    ),
    Patch(
        "torch.distributed.checkpoint.filesystem:FileSystemWriter.finish",
        "DCP records where each tensor lies in a step's files, not their sizes or checksums, so a shard changed "
        "within its size loads as garbage: rank 0, once every rank's files are written and before DCP writes "
        ".metadata, joins the ranks' pieces into the step's manifest (titan_ext.inputs.checkpoints); "
        "HF exports (their own writer's finish) are not changed",
        TORCH, _checkpoints("manifest_before_metadata"),
    ),
)
"""A job that saves DCP checkpoints (``--checkpoint.enable``)."""

SKIP_DAMAGED_STEPS: tuple[Patch, ...] = (
    Patch(
        "torchtitan.components.checkpoint:CheckpointManager._find_load_step",
        "torchtitan resumes from the newest step folder with a .metadata: with --titan_ext.damaged_checkpoint skip, "
        "from the newest whole one (titan_ext.inputs.checkpoints.newest_whole_step, the step the job's checks read)",
        TORCHTITAN, _checkpoints("newest_whole_step_finder"),
    ),
)
"""A job with ``--titan_ext.damaged_checkpoint skip``."""

SIGNALS: tuple[str, ...] = ("SIGINT", "SIGTERM")
"""The Python handlers a titan_ext job installs (``apply_signal_handlers``): Ctrl-C or a scheduler's SIGTERM
ends every rank at once, rank 0 first saying in one line the step reached and what a rerun loads, instead of a
KeyboardInterrupt traceback per rank (``titan_ext.interrupt``). Restored by ``undo()``."""


def _sdpa_for_flash_attn(name: str):
    def new(original):
        return resolve(f"titan_ext.kernels.sdpa_attention:{name}") if original is None else original

    return new


BUILD: tuple[Patch, ...] = (
    Patch(
        "fla.layers.attn:flash_attn_func",
        "fla's Attention refuses to build without the flash-attn package; its forward then runs on SDPA "
        "(titan_ext binds sdpa_attention into the built model)",
        FLA, _sdpa_for_flash_attn("sdpa_attn_func"),
    ),
)


def _resizes_told(original):
    """``resize_`` that then tells the step peaks inside their ``with`` (``planner.memory.storage_resized``)."""
    told = resolve("titan_ext.planner.memory:storage_resized")

    def resize_(storage, size):
        out = original(storage, size)
        told(storage)
        return out

    return resize_


def _shapes_inferred_uncounted(original):
    """DTensor's shape inference with the step peaks looking away (``planner.memory.uncounted``)."""
    uncounted = resolve("titan_ext.planner.memory:uncounted")

    def infer(self, op_schema):
        with uncounted():
            return original(self, op_schema)

    return infer


def _no_packed_sequences(_original):
    return lambda position_ids: None


STORAGE_RESIZES = Patch(
    "torch:UntypedStorage.resize_",
    "FSDP frees a gathered weight's memory by resizing its storage to 0 and gathers into it again by resizing it "
    "back, which no operator dispatch sees: the step's peak (planner.memory.StepPeak, planned and real steps "
    "alike) follows each resize",
    TORCH, _resizes_told,
)
SHAPE_INFERENCE = Patch(
    "torch.distributed.tensor._sharding_prop:ShardingPropagator._propagate_tensor_meta_non_cached",
    "DTensor infers an op's global output shape by running the op on fake tensors of the global shapes, where its "
    "cache does not know the op's inputs yet: no memory, but the step's peak (planner.memory.StepPeak) would count "
    "them (under TP an embedding's whole-vocabulary gradient, twice). A real run's step 2 finds its cache filled "
    "by step 1; the planner's one step (a first one) does not: it counted 1.15-1.5x a TP rank's real peak",
    TORCH, _shapes_inferred_uncounted,
)
WHOLE_WINDOWS = Patch(
    "transformers.masking_utils:find_packed_sequence_indices",
    "the planner's fake batch holds whole windows, no packed documents: transformers finds none in a real batch's "
    "position ids and skips its T x T mask for SDPA's causal flag; on fake tensors it cannot read them and would "
    "build the mask (8192 tokens: 256 MiB per layer) that the real step never holds (planner.rank)",
    "transformers 5.17-5.24", _no_packed_sequences,
)


def _fake_group_read_as_gloo(original):
    """``torch.distributed`` as the schedules module reads it, with a fake group's backend answered as gloo's."""

    class RealLooking:
        def __getattr__(self, name):
            return getattr(original, name)

        @staticmethod
        def get_backend(group=None):
            backend = original.get_backend(group)
            return "gloo" if backend == "fake" else backend

    return RealLooking()


def _sends_told(original):
    """``_batch_p2p`` through the planner's pipelined rank being stepped (``planner.rank.schedule_p2p``)."""
    return functools.partial(resolve("titan_ext.planner.rank:schedule_p2p"), original)


SCHEDULES_ON_A_FAKE_GROUP = Patch(
    "torch.distributed.pipelining.schedules:dist",
    "torch >= 2.15 refuses to build or first step a schedule whose stages infer their shapes on a fake group (its "
    "own dry runs cannot answer the shape messages); the planner answers them, so while it plans a rank the "
    "schedules module reads the fake group's backend as gloo's (planner.rank)",
    TORCH, _fake_group_read_as_gloo,
)
SCHEDULE_SENDS = Patch(
    "torch.distributed.pipelining.schedules:_batch_p2p",
    "a pipelined rank planned with fewer microbatches is extrapolated per microbatch: each send and receive the "
    "schedule posts is tagged with its microbatch (planner.rank._Microbatches)",
    TORCH, _sends_told,
)


class _FakeTensorKey:
    """Marks a fake tensor's metadata in a fake-op cache key made by ``_compact_fake_cache_keys`` (no key torch
    makes holds it, so the two kinds never match)."""


def _compact_fake_cache_keys(original):
    """``FakeTensorMode``'s cache key with each fake tensor's metadata as one tuple: what torch's key holds
    (dtype, shape, strides, device, storage offset and bytes, requires_grad, the quantized, conjugate, negative
    and inference flags; its memory format follows from the shape and strides), made in a fraction of the time
    torch takes to flatten a dataclass of it field by field. Anything else (a dict, a symbolic shape, a sparse
    tensor, another mode's tensor, a value of another type) is keyed, or refused, by torch's own code."""
    import inspect

    import torch

    from titan_ext import compat

    if list(inspect.signature(original).parameters) != ["self", "result", "args", "state", "id_hashed_objects"]:
        return original  # another torch's key builder, which this one calls: left as it is
    fake, strided = compat.fake_process_group().FakeTensor, torch.strided
    plain = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)

    def prep_args_for_hash(mode, result, args, state, id_hashed_objects):
        if isinstance(args, dict):
            return original(mode, result, args, state, id_hashed_objects)
        if isinstance(args, (list, tuple)):
            result += (type(args), len(args))
        for arg in args:
            kind = type(arg)
            if (kind is fake and arg.fake_mode is mode and arg.constant is None and arg.layout is strided
                    and not arg._has_symbolic_sizes_strides):
                result += (_FakeTensorKey, (arg.dtype, arg.shape, arg.stride(), arg.device, arg.storage_offset(),
                                            arg.untyped_storage().nbytes(), arg.requires_grad, arg.is_quantized,
                                            arg.is_conj(), arg.is_neg(), arg.is_inference()))
            elif kind in plain:
                result += (kind, arg)
            elif kind in (list, tuple, torch.Size):
                prep_args_for_hash(mode, result, arg, state, id_hashed_objects)
            else:
                original(mode, result, (arg,), state, id_hashed_objects)

    return prep_args_for_hash


FAKE_CACHE_KEYS = Patch(
    "torch._subclasses.fake_tensor:FakeTensorMode._prep_args_for_hash",
    "a planned step is one fake operator after another, nearly all answered from FakeTensorMode's cache, and torch "
    "spent half of each answer building its key field by field: the planner keys each fake tensor by the same "
    "metadata in one tuple (planner.rank)",
    TORCH, _compact_fake_cache_keys,
)


def _other_ranks_groups_named_only(original):
    """``new_group`` on the fake backend for a group without this rank: only the name it takes (the next
    number, which the groups after it count on), and the non-member marker ``new_group`` returns. torch
    registers nothing else for it, and on a real backend, or with a hashed name, it is called as shipped."""
    import inspect

    from titan_ext import compat

    expected = ["ranks", "timeout", "backend", "backend_options", "pg_tag", "use_local_synchronization", "group_desc",
                "device_id", "sort_ranks"]
    if list(inspect.signature(original).parameters) != expected:
        return original  # another torch's, whose arguments this does not know: left as it is
    c10d = compat.c10d_groups()
    world: list = [None, None]
    """[the default group last seen, its rank where it is fake and without a barrier after each group, else None]"""

    def new_group_with_tag(ranks=None, timeout=None, backend=None, backend_options=None, pg_tag=None,
                           use_local_synchronization=False, group_desc=None, device_id=None, sort_ranks=True):
        default = c10d.default_group()
        if world[0] is not default:
            fake = c10d.backend_of(default) == "fake" and not c10d.barrier_after_init()
            world[:] = [default, default.rank() if fake else None]
        if ranks is None or use_local_synchronization or world[1] is None or world[1] in ranks:
            return original(ranks, timeout, backend, backend_options, pg_tag, use_local_synchronization, group_desc,
                            device_id, sort_ranks)
        c10d.group_name(sorted(ranks) if sort_ranks else ranks)
        return c10d.non_member

    return new_group_with_tag


FAKE_GROUPS_OF_OTHER_RANKS = Patch(
    "torch.distributed.distributed_c10d:_new_group_with_tag",
    "a device mesh makes every subgroup of every dimension on every rank (511 of a dimension of 2's 512 groups at "
    "1,024 ranks are without this rank), and half of a planned rank's mesh build was the bookkeeping of groups it is "
    "not in: on the planner's fake group such a group only takes its name (planner.rank.fake_group)",
    TORCH, _other_ranks_groups_named_only,
)
PLANNER: tuple[Patch, ...] = (STORAGE_RESIZES, SHAPE_INFERENCE, WHOLE_WINDOWS, SCHEDULES_ON_A_FAKE_GROUP, SCHEDULE_SENDS,
                               FAKE_CACHE_KEYS, FAKE_GROUPS_OF_OTHER_RANKS)
"""The planner's, each inside its own blocks only (``scoped``)."""


_undo_stack: list[Callable[[], None]] = []
_applied: set[int] = set()
"""The tables applied in this process (by identity), until ``undo()``."""


def apply(patches: tuple[Patch, ...]) -> None:
    """Apply rows of a table; ``undo()`` reverts them, last first."""
    for patch in patches:
        _undo_stack.append(patch.apply())


def apply_cpu_mode() -> None:
    """``CPU_MODE`` and its warning/log filters, once per process."""
    if id(CPU_MODE) in _applied:
        return
    apply_once(CPU_MODE)
    _quiet([message for message, _ in CPU_MODE_WARNINGS], [(name, part) for name, part, _ in CPU_MODE_LOGS])


def apply_once(patches: tuple[Patch, ...]) -> None:
    """A table's rows, once per process (a process may run several jobs: a bench, the integration matrix)."""
    if id(patches) in _applied:
        return
    _applied.add(id(patches))
    apply(patches)


def apply_signal_handlers(handler: Callable) -> None:
    """``handler`` for each of ``SIGNALS``, once per process; ``undo()`` restores the handlers before."""
    import signal

    if id(SIGNALS) in _applied:
        return
    _applied.add(id(SIGNALS))
    for name in SIGNALS:
        number = getattr(signal, name)
        before = signal.signal(number, handler)
        _undo_stack.append(lambda n=number, b=before: signal.signal(n, b))


def apply_job() -> None:
    """``JOB``'s log filter and its warning/log filters, once per process."""
    if id(JOB) in _applied:
        return
    _applied.add(id(JOB))
    log_filter = _OneLineModelArgs()
    logging.getLogger().addFilter(log_filter)
    _undo_stack.append(lambda: logging.getLogger().removeFilter(log_filter))
    _quiet([message for message, _, _ in JOB_WARNINGS], [(name, part) for name, part, _ in JOB_LOGS])


def quiet_other_rank(log_filter: logging.Filter) -> None:
    """The job's filter on the root logger's handlers (torchtitan's ``init_logger`` makes them anew for each job,
    so a filter ends with its job); ``undo()`` removes it."""
    for handler in list(logging.getLogger().handlers):
        handler.addFilter(log_filter)
        _undo_stack.append(lambda h=handler: h.removeFilter(log_filter))


def _quiet(messages: list[str], logs: list[tuple[str, str]]) -> None:
    """Drop these warnings (message regexes) and log records (logger, message part); ``undo()`` restores them."""
    for message in messages:
        warnings.filterwarnings("ignore", message=message)
        _undo_stack.append(lambda m=message: _remove_warning_filter(m))
    for name, part in logs:
        log_filter = _DropMessages(part)
        logging.getLogger(name).addFilter(log_filter)
        _undo_stack.append(lambda n=name, f=log_filter: logging.getLogger(n).removeFilter(f))


def _remove_warning_filter(message: str) -> None:
    warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] is not None and f[1].pattern == message)]


def undo() -> None:
    while _undo_stack:
        _undo_stack.pop()()
    _applied.clear()


def active() -> bool:
    return bool(_undo_stack)


@contextlib.contextmanager
def scoped(patches: tuple[Patch, ...]) -> Iterator[None]:
    """Rows applied for one ``with`` block; restored right after, last first."""
    undos = [patch.apply() for patch in patches]
    try:
        yield
    finally:
        for undo_one in reversed(undos):
            undo_one()


@contextlib.contextmanager
def building(patches: tuple[Patch, ...] = BUILD) -> Iterator[None]:
    """``BUILD`` rows while titan_ext constructs a model; restored right after."""
    with scoped(patches):
        yield
