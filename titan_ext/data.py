"""The shipped corpus and tokenizer, usable from a TOML by name.

``[training] dataset = "titan_ext_tiny"`` reads the corpus that ships in
``titan_ext/assets/tiny`` (or any JSON-lines file with a ``"text"`` field
given as ``dataset_path``); ``[model] hf_assets_path = "titan_ext/assets/tiny"``
loads the shipped tokenizer from any working directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from datasets import Dataset
from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

PACKAGE_ROOT = Path(__file__).resolve().parent
TINY_ASSETS = PACKAGE_ROOT / "assets" / "tiny"
TINY_DATASET = "titan_ext_tiny"


def resolve_asset_path(path: str) -> str:
    """A ``titan_ext/...`` path that is not under the working directory names the installed package's file."""
    if os.path.exists(path):
        return path
    parts = Path(path).parts
    if parts and parts[0] == PACKAGE_ROOT.name:
        return str(PACKAGE_ROOT.joinpath(*parts[1:]))
    return path


def load_jsonl_text(path: str) -> Dataset:
    path = resolve_asset_path(path)
    if not os.path.isfile(path):
        raise ValueError(
            f"--training.dataset_path={path!r}: no such file; give a JSON-lines file with a 'text' field "
            f"or leave it unset to use the shipped corpus"
        )
    with open(path) as f:
        return Dataset.from_list([json.loads(line) for line in f if line.strip()])


def register_datasets() -> None:
    DATASETS[TINY_DATASET] = DatasetConfig(
        path=str(TINY_ASSETS / "corpus.jsonl"),
        loader=load_jsonl_text,
        sample_processor=lambda sample: sample["text"],
    )


def build_tokenizer(job_config):
    """torchtitan's HF tokenizer, with ``titan_ext/...`` asset paths resolved."""
    path = resolve_asset_path(job_config.model.hf_assets_path)
    if not os.path.isdir(path):
        raise ValueError(
            f"--model.hf_assets_path={job_config.model.hf_assets_path!r}: no such directory; "
            f"use 'titan_ext/assets/tiny' for the shipped tokenizer or a directory with tokenizer.json"
        )
    job_config.model.hf_assets_path = path
    return build_hf_tokenizer(job_config)
