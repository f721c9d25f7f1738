"""Every check of a job's config, run before any process group or model exists.

``check_job_config`` runs when torchtitan's Trainer imports titan_ext, for
any model (torchtitan's own too): numbers, parallel degrees against the world
size, names, and the data file. ``check_model_job`` runs once titan_ext's
model args see the config: what depends on the architecture (TP, AC with
compile, Float8, document masking, CP, the HF config, checkpoints to load). Each failure is one
``ConfigError`` line naming the option, its value and the fix.
"""

from __future__ import annotations

import logging
import os

from titan_ext.checkpoints import dcp_steps, hf_files
from titan_ext.errors import ConfigError, rank
from titan_ext.inputs import degrees, jsonl, names, tokenizer
from titan_ext.parallel.compile import model_compile_enabled

logger = logging.getLogger()

def check_job_config(job_config, world_size: int) -> None:
    degrees.check_positive_numbers(job_config)
    degrees.check_parallel_degrees(job_config, world_size)
    names.check_names(job_config)
    _check_model_name_and_flavor(job_config)
    _check_dataset(job_config)
    _check_tokenizer(job_config)
    _check_document_mask(job_config)
    _check_titan_ext_parallelism(job_config, world_size)
    _check_steps_to_resume(job_config)


def _check_steps_to_resume(job_config) -> None:
    """The step a resume loads is whole, read before anything is built (``dcp_steps.resume_from``); the step
    folders it passes over (unfinished saves, and damaged ones with ``damaged_checkpoint`` "skip") are named in
    one WARNING."""
    dcp_steps.damaged_checkpoint_policy(job_config)
    found = dcp_steps.resume(job_config)
    if found is None or not found.passed_over or rank() != 0:
        return
    folder = os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)
    then = f"resuming from {os.path.basename(found.path)}" if found.path else "training starts from step 1"
    logger.warning(f"titan_ext: --checkpoint.folder={folder!r}: passed over {', '.join(found.passed_over)}; {then}")


def _titan_ext_spec(name: str) -> bool:
    """A registered spec whose models titan_ext builds (its own, and any a user registers over its adapter)."""
    from torchtitan.protocols import train_spec as registry

    from titan_ext.models.adapter import build_model

    spec = registry._extra_train_specs.get(name)
    return spec is not None and spec.model_cls is build_model


def _check_model_name_and_flavor(job_config) -> None:
    """Only titan_ext's and torchtitan's specs exist yet when ``custom_import`` is titan_ext itself."""
    from torchtitan.protocols import train_spec as registry

    name, flavor = job_config.model.name, job_config.model.flavor
    if job_config.experimental.custom_import == "titan_ext":
        from torchtitan.experiments import _supported_experiments
        from torchtitan.models import _supported_models

        own = set(registry._extra_train_specs)
        if name not in own | set(_supported_models) | set(_supported_experiments):
            raise names.unknown_name(f"--model.name={name!r}", name, "a registered train spec",
                                     {"titan_ext": own, "torchtitan": set(_supported_models) - own},
                                     set(_supported_experiments) - own, "torchtitan experiments")
    if _titan_ext_spec(name):
        flavors = registry.get_train_spec(name).model_args
        if flavor not in flavors:
            raise names.unknown_name(f"--model.flavor={flavor!r}", flavor, f"a flavor of {name}",
                                     {"flavors": set(flavors)})


def _check_dataset(job_config) -> None:
    """The training data, and the validation data when validation is on (same checks, its own options)."""
    from titan_ext.data import TINY_DATASET, dataset_file, sections
    from titan_ext.data.text_stream import STREAM_DATASET, bad_records_policy, check_stream, stream_options

    text_field, buffer = stream_options(job_config)
    bad_records = bad_records_policy(job_config)
    if buffer < 0:
        raise ConfigError(f"--titan_ext.shuffle_buffer={buffer} is negative; use 0 (stream order) or more")
    for section in sections(job_config):
        options, option = getattr(job_config, section), f"--{section}.dataset_path"
        if options.dataset == TINY_DATASET:
            jsonl.check_jsonl_dataset(dataset_file(options.dataset_path), option=option)
        if options.dataset == STREAM_DATASET:
            check_stream(options.dataset_path, text_field, option, bad_records)
        workers = options.dataloader.num_workers
        if options.dataset in (TINY_DATASET, STREAM_DATASET) and workers > 1:
            raise ConfigError(
                f"--{section}.dataloader.num_workers={workers}: {options.dataset} reads one stream per data-parallel "
                "rank, and each worker would read all of it (every document that many times); use 1 (the data "
                "off the training loop's thread) or 0"
            )


def _check_tokenizer(job_config) -> None:
    """The spec's tokenizer loads from ``--model.hf_assets_path`` (before any model or process group), else a
    missing or broken tokenizer.json ends in a FileNotFoundError or a Rust parse error on every rank."""
    from torchtitan.protocols import train_spec as registry

    from titan_ext.inputs.assets import resolve_asset_path

    name = job_config.model.name
    known = name in registry._extra_train_specs or name in _torchtitan_model_names()
    if known and registry.get_train_spec(name).build_tokenizer_fn is not None:
        given = job_config.model.hf_assets_path
        tokenizer.check_tokenizer_dir(resolve_asset_path(given), given)


def _torchtitan_model_names() -> set[str]:
    from torchtitan.models import _supported_models

    return set(_supported_models)


def _check_document_mask(job_config) -> None:
    """Document masking needs a titan_ext model and boundaries from the dataloader: only titan_ext's own
    datasets emit them."""
    from titan_ext.data import TINY_DATASET, documents, sections
    from titan_ext.data.text_stream import STREAM_DATASET

    if not documents.enabled(job_config):
        return
    if not _titan_ext_spec(job_config.model.name):
        raise ConfigError(
            f"{documents.OPTION} applies to titan_ext's models, not --model.name={job_config.model.name!r} "
            "(torchtitan's own models mask documents with their flex-attention flavors); turn it off"
        )
    for section in sections(job_config):
        dataset = getattr(job_config, section).dataset
        if dataset not in (TINY_DATASET, STREAM_DATASET):
            raise ConfigError(
                f"{documents.OPTION} needs document boundaries from the dataloader, which --{section}.dataset="
                f"{dataset!r} does not emit; use dataset {STREAM_DATASET!r} (any text shards) "
                f"or {TINY_DATASET!r}, or turn document_mask off"
            )


def _check_titan_ext_parallelism(job_config, world_size: int) -> None:
    """What titan_ext's specs do not support yet, or what torchtitan would get wrong."""
    p = job_config.parallelism
    if not _titan_ext_spec(job_config.model.name):
        return
    shard = degrees.shard_degree(p, world_size)
    if p.data_parallel_replicate_degree > 1 and shard == 1 and p.tensor_parallel_degree > 1:
        raise ConfigError(
            "DDP (--parallelism.data_parallel_replicate_degree) cannot combine with "
            f"--parallelism.tensor_parallel_degree={p.tensor_parallel_degree}; use HSDP (also set "
            "--parallelism.data_parallel_shard_degree > 1) or FSDP instead"
        )
    if p.data_parallel_replicate_degree > 1 and shard == 1 and p.context_parallel_degree == 1 \
            and p.pipeline_parallel_degree > 1:
        raise ConfigError(  # torchtitan's own models refuse it too ("DDP has not supported > 1D parallelism")
            f"DDP (--parallelism.data_parallel_replicate_degree={p.data_parallel_replicate_degree}) cannot combine with "
            f"--parallelism.pipeline_parallel_degree={p.pipeline_parallel_degree}: torch's pipeline stages defer the "
            "gradient reduction to a step's last micro-batch for FSDP modules, not for DDP's replicate, which would "
            "sum earlier micro-batches' gradients again; use HSDP (also set --parallelism.data_parallel_shard_degree > 1) "
            "or FSDP instead"
        )
    if p.expert_tensor_parallel_degree > 1 and p.expert_parallel_degree == 1:
        raise ConfigError(
            f"--parallelism.expert_tensor_parallel_degree={p.expert_tensor_parallel_degree} needs "
            "--parallelism.expert_parallel_degree > 1 (it splits the experts EP places); set it to 1"
        )
    if p.enable_async_tensor_parallel and not model_compile_enabled(job_config):
        raise ConfigError(
            "--parallelism.enable_async_tensor_parallel needs the model compiled (its collective-matmul fusion "
            "is an inductor pass); add --compile.enable with 'model' in --compile.components, or drop async TP"
        )


def check_model_job(model_args, job_config, kernel_path: str, world_size: int):
    """What needs the architecture; ``model_args`` already carries any ``[titan_ext] hf_config``.

    Returns the meta-device model the checks read (the job plan reads it too).
    """
    from titan_ext.data import documents
    from titan_ext.host import checks
    from titan_ext.models.adapter import meta_model
    from titan_ext.models.moe.blocks import moe_blocks
    from titan_ext.parallel import activation_checkpoint, context_parallel, float8, moe_plan

    model = meta_model(model_args)  # a config the library refuses stops here
    uses = {checks.FEATURES[0]: job_config.parallelism.context_parallel_degree > 1 or documents.enabled(job_config),
            checks.FEATURES[1]: moe_plan.balance_option(job_config) == "bias",
            checks.FEATURES[2]: job_config.parallelism.expert_parallel_degree > 1
            or moe_plan.splits_intermediate(job_config.parallelism, moe_blocks(model))}
    checks.check_host(model_args, frozenset(feature for feature, used in uses.items() if used))
    if kernel_path == "portable":
        _check_portable(model_args, model)
        _check_runs_here(model_args)
    _check_vocabulary(model_args, model, job_config)
    _check_initialized(model_args, job_config)
    documents.check_model(model_args, job_config)
    moe_plan.check_moe(model, job_config)
    context_parallel.check_cp(model_args, job_config)
    activation_checkpoint.check_ac(job_config.activation_checkpoint, model_compile_enabled(job_config))
    float8.check_float8(job_config)
    _check_checkpoint_to_load(model_args, model, job_config, world_size)
    return model


def _check_initialized(model_args, job_config) -> None:
    """A parameter only its module's constructor sets holds garbage after the meta-device build torchtitan
    trains from, unless a checkpoint loads it: checked on a small copy of the model."""
    from titan_ext.host.checks import tiny_copy
    from titan_ext.models.adapter import unset_by_initializers

    model = None if dcp_steps.checkpoint_to_load(job_config) else tiny_copy(model_args)
    unset = unset_by_initializers(model) if model is not None else []
    if unset:
        raise ConfigError(
            f"{model_args.model_type!r} models' {', '.join(unset[:3])} are set by their modules' constructors only, "
            "which torchtitan's meta-device build skips: training would start from garbage; load a checkpoint "
            "that holds them (--checkpoint.initial_load_path, or --checkpoint.initial_load_in_hf)"
        )


def _check_runs_here(model_args) -> None:
    """Off CUDA an fla model must run on the CPU: a small copy's forward and backward, on the portable kernels,
    meets a Triton kernel titan_ext has no version of, an op fla runs on CUDA only, or a package it lacks
    here, before the build (transformers' models run their own torch code; fla's GLA, Gated DeltaNet, KDA
    and transformer, titan_ext's own architectures, are tested)."""
    from titan_ext.models.architecture import FlaArchitecture

    if type(model_args.arch) is not FlaArchitecture:
        return
    import torch

    from titan_ext.host.checks import tiny_copy

    model = tiny_copy(model_args)
    if model is None:
        return
    try:
        with torch.random.fork_rng(devices=[]):
            out = model.train()(input_ids=torch.randint(0, 64, (1, 16)), use_cache=False)
            out.logits.float().sum().backward()
    except Exception as error:  # noqa: BLE001  (whatever fla raises: its message is the diagnosis)
        detail = " ".join(str(error).split())[:200] or "no message"
        raise ConfigError(
            f"{model_args.model_type!r} models cannot train on the CPU ({type(error).__name__}: {detail}); train "
            "this model on a CUDA GPU, or pick one titan_ext runs on the CPU (docs/models.md)"
        ) from None


def _check_portable(model_args, model) -> None:
    """Off CUDA an fla model runs on titan_ext's portable kernels: one it lacks would fail mid-step."""
    from titan_ext import kernels

    missing = kernels.unported(model)
    if missing:
        kernel, caller = next(iter(missing.items()))
        raise ConfigError(
            f"{model_args.model_type!r} models call fla's Triton kernel {kernel} (from {caller}), which has no "
            "portable path on CPU; train this model on a CUDA GPU, or pick an architecture titan_ext runs on CPU "
            "(gla, gated_deltanet, kda, transformer)"
        )


def _check_checkpoint_to_load(model_args, model, job_config, world_size: int) -> None:
    from titan_ext.checkpoints.hf import check_hf_config

    found = dcp_steps.checkpoint_to_load(job_config)
    if found is None:
        return
    path, kind = found
    checkpoint = job_config.checkpoint
    if path == checkpoint.initial_load_path:
        option = "--checkpoint.initial_load_path"
    elif kind == "hf":  # initial_load_in_hf without a path loads the HF assets
        option = "--model.hf_assets_path"
    else:
        option = "--checkpoint.folder"
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if kind == "hf":
        check_hf_config(model_args, path)  # the model first: a wrong model is the likelier mistake
        hf_files.check_hf_checkpoint_dir(path, option)
        hf_files.check_hf_checkpoint_shapes(path, shapes, option)
        _check_hub_tensors(model, path, option)
    else:
        initial = option == "--checkpoint.initial_load_path"
        where = f"{option}={path!r}" if initial else f"{path!r} (resumed from {option})"
        dcp_steps.check_dcp_checkpoint(path, shapes, where)
    _check_data_parallel_degree(job_config, world_size)


def _check_hub_tensors(model, path: str, option: str) -> None:
    """Every tensor of the model made from the HF folder's (through transformers' conversion), with the model's
    shape: a checkpoint of another layout fails here, not in DCP's load on every rank."""
    from titan_ext.checkpoints import hub_layout

    _check_not_quantized(path, option)
    plan = hub_layout.import_plan(model, path)
    expected = model.state_dict()
    if missing := plan.missing(expected):
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"{option}={path!r} holds nothing {type(model).__name__}'s {missing[0]!r}{more} loads from, directly or "
            "through transformers' checkpoint conversion; point it at a checkpoint of this model"
        )
    for key, shape in hub_layout.target_shapes(plan).items():
        if tuple(expected[key].shape) != shape:
            sources = plan.sources_of(key)
            raise ConfigError(
                f"{option}={path!r}: {sources[0]!r}{' and the rest of its group' if len(sources) > 1 else ''} make "
                f"{key!r} of shape {list(shape)}, this model needs {list(expected[key].shape)}; the folder lacks tensors "
                "or its config.json does not describe its weights: download it again or fix its config.json"
            )


def _check_not_quantized(path: str, option: str) -> None:
    """A hub folder of quantized weights (DeepSeek-V3's fp8 blocks with their scales, gpt-oss's mxfp4) holds no
    tensor titan_ext trains: its values are codes, read as weights they would be garbage."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            quantization = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return  # the folder's own checks say what is wrong with it
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ConfigError(
            f"{option}={path!r} holds quantized weights (config.json's quantization_config: {method}); titan_ext "
            "trains from full-precision weights: dequantize the checkpoint to bf16 first (its authors' conversion "
            "script, or transformers' from_pretrained and save_pretrained without the quantization config)"
        )


def _check_data_parallel_degree(job_config, world_size: int) -> None:
    """torchtitan's dataloaders keep one position per data-parallel rank and stop with an AssertionError
    traceback when the degree changed; titan_ext_stream over local shards re-splits them, nothing else can.
    Only a load that restores the dataloader matters (``dcp_steps.dataloader_to_load``: not a seed's step-0)."""
    from titan_ext.data.text_stream import STREAM_DATASET, local_shards

    path = dcp_steps.dataloader_to_load(job_config)
    training = job_config.training
    if path is None or training.dataset == STREAM_DATASET and local_shards(training.dataset_path) is not None:
        return  # nothing to re-split, or StreamDataloader re-splits the saved positions
    saved = dcp_steps.dcp_dataloader_ranks(path)
    p = job_config.parallelism
    now = degrees.shard_degree(p, world_size) * p.data_parallel_replicate_degree
    option = "--checkpoint.folder" if path != job_config.checkpoint.initial_load_path else "--checkpoint.initial_load_path"
    if saved and saved != now:
        raise ConfigError(
            f"{option} ({path}) was saved by {saved} data-parallel ranks, this job has {now}: "
            f"--training.dataset={job_config.training.dataset!r} cannot re-split its data position over another number "
            f"of ranks; resume with {saved} data-parallel ranks, or add --checkpoint.exclude_from_loading dataloader "
            "(model and optimizer resume, the data starts again from its beginning)"
        )


def _check_vocabulary(model_args, model, job_config) -> None:
    """Every id the tokenizer can produce (special tokens included) must index the embedding: a smaller
    vocabulary ends in 'index out of range' in the middle of the first forward."""
    from titan_ext.inputs.assets import resolve_asset_path

    assets = resolve_asset_path(job_config.model.hf_assets_path)
    path = os.path.join(assets, "tokenizer.json") if assets else ""
    if not os.path.isfile(path):
        return  # no HF tokenizer to compare with (the tokenizer's own build reports a missing one)
    vocab = tokenizer.load_tokenizer_json(path, f"--model.hf_assets_path={job_config.model.hf_assets_path!r}")
    needed = max(vocab.get_vocab(with_added_tokens=True).values()) + 1
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < needed:
        hf_config = getattr(getattr(job_config, "titan_ext", None), "hf_config", "")
        source = f"--titan_ext.hf_config={hf_config!r}" if hf_config else f"--model.flavor={job_config.model.flavor!r}"
        raise ConfigError(
            f"vocab_size={rows} ({source}) is smaller than the tokenizer's {needed} ids (--model.hf_assets_path="
            f"{job_config.model.hf_assets_path!r}, special tokens included); set vocab_size to at least {needed}, "
            "or use the tokenizer the model was made for"
        )
