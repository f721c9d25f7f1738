"""The shipped corpus and tokenizer, usable from a TOML by name.

``[training] dataset = "titan_ext_tiny"`` reads the corpus that ships in
``titan_ext/assets/tiny`` (or any JSON-lines file with a ``"text"`` field
given as ``dataset_path``); ``[model] hf_assets_path = "titan_ext/assets/tiny"``
loads the shipped tokenizer from any working directory.
"""

from __future__ import annotations

from titan_ext.inputs import jsonl, tokenizer
from titan_ext.inputs.assets import PACKAGE_ROOT, resolve_asset_path

TINY_ASSETS = PACKAGE_ROOT / "assets" / "tiny"
TINY_DATASET = "titan_ext_tiny"


def dataset_file(dataset_path: str | None) -> str:
    """The JSON-lines file ``titan_ext_tiny`` reads: ``--training.dataset_path`` or the shipped corpus."""
    return resolve_asset_path(dataset_path) if dataset_path else str(TINY_ASSETS / "corpus.jsonl")


def load_jsonl_text(path: str):
    from datasets import Dataset

    return Dataset.from_list(jsonl.load_jsonl_records(resolve_asset_path(path)))


def register_datasets() -> None:
    """``titan_ext_tiny`` and ``titan_ext_stream`` in torchtitan's registry (its config checks look there)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from titan_ext.data.text_stream import STREAM_DATASET, open_stream

    DATASETS[TINY_DATASET] = DatasetConfig(
        path=dataset_file(None), loader=load_jsonl_text, sample_processor=lambda sample: sample["text"]
    )
    # built by titan_ext's own dataloader (build_dataloader), which reads [titan_ext] text_field
    DATASETS[STREAM_DATASET] = DatasetConfig(path="", loader=open_stream, sample_processor=lambda sample: sample["text"])


def sections(job_config) -> tuple[str, ...]:
    """The config sections whose windows the job reads: ``training``, and ``validation`` when it is on."""
    return ("training", "validation") if job_config.validation.enable else ("training",)


def streamed(job_config, section: str) -> bool:
    """Whether the section's data comes through titan_ext's streaming dataloader: ``titan_ext_stream``, and
    ``titan_ext_tiny`` with document masking (torchtitan's does not emit document boundaries)."""
    from titan_ext.data import documents
    from titan_ext.data.text_stream import STREAM_DATASET

    dataset = getattr(job_config, section).dataset
    return dataset == STREAM_DATASET or (dataset == TINY_DATASET and documents.enabled(job_config))


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, *args, section: str = "training",
                     infinite: bool = True, **kwargs):
    """The dataloader of ``[training]`` (or of ``[validation]``): titan_ext's streaming one where the section
    is ``streamed``, else torchtitan's text dataloader."""
    from titan_ext.data.text_stream import STREAM_DATASET, build_stream_dataloader

    options = getattr(job_config, section)
    if streamed(job_config, section):
        path = None if options.dataset == STREAM_DATASET else dataset_file(options.dataset_path)
        return build_stream_dataloader(dp_world_size, dp_rank, tokenizer, job_config, section=section,
                                       infinite=infinite, path=path)
    if section == "validation":
        from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

        return build_text_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=infinite)
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    return build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, *args, **kwargs)


def build_tokenizer(job_config):
    """torchtitan's HF tokenizer, with ``titan_ext/...`` asset paths resolved."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    path = resolve_asset_path(job_config.model.hf_assets_path)
    tokenizer.check_tokenizer_dir(path, job_config.model.hf_assets_path)
    return HuggingFaceTokenizer(path)


def ending_dataloader_workers(close):
    """torchtitan's ``Trainer.close``, then its dataloaders' worker processes ended: torchdata keeps a
    dataloader's last iterator, whose worker (``[training.dataloader] num_workers``), forked from the job's
    process with its process groups, otherwise outlives the job in a process that runs more than one (a bench,
    the integration matrix) until the garbage collector frees the trainer."""
    from titan_ext.compat import end_dataloader_workers

    trainer = close.__self__

    def close_then_end_workers():
        try:
            close()
        finally:
            validator = getattr(trainer, "validator", None)
            for loader in (getattr(trainer, "dataloader", None), getattr(validator, "validation_dataloader", None)):
                if loader is not None:
                    end_dataloader_workers(loader)

    return close_then_end_workers
