"""Checks of the tokenizer a job loads from ``--model.hf_assets_path`` (torchtitan's ``HuggingFaceTokenizer``)."""

from __future__ import annotations

import os
import shlex

from titan_ext.errors import ConfigError

OPTION = "--model.hf_assets_path"
FIX = "copy the model's tokenizer.json into it, or use 'titan_ext/assets/tiny' for the shipped tokenizer"
TIKTOKEN_FILE = "tiktoken.model"
TIKTOKEN_FIX = "python -m titan_ext.tokenizer_json {given}"
"""The command that writes tokenizer.json for a folder in tiktoken's format (``titan_ext.tokenizer_json``)."""


def check_tokenizer_dir(path: str, given: str, option: str = OPTION) -> None:
    """``path`` (``given`` as the user wrote it) holds a tokenizer torchtitan can load: a ``tokenizer.json``
    the ``tokenizers`` library reads, or ``vocab.json``/``vocab.txt`` (torchtitan's fallback)."""
    where = f"{option}={given!r}"
    if os.path.isfile(path):
        raise ConfigError(f"{where} is a file; point it at the directory holding tokenizer.json "
                          f"({os.path.dirname(given) or '.'!r})")
    if not os.path.isdir(path):
        raise ConfigError(f"{where}: no such directory; use 'titan_ext/assets/tiny' for the shipped tokenizer "
                          "or a directory with tokenizer.json")
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        load_tokenizer_json(tokenizer_json, where)
    elif not any(os.path.isfile(os.path.join(path, name)) for name in ("vocab.json", "vocab.txt")):
        if os.path.isfile(os.path.join(path, TIKTOKEN_FILE)):
            command = TIKTOKEN_FIX.format(given=shlex.quote(given))
            raise ConfigError(f"{where} holds no tokenizer.json but a tokenizer in tiktoken's format "
                              f"({TIKTOKEN_FILE}); write its tokenizer.json: {command}")
        found = sorted(os.listdir(path))
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "") if found else "nothing"
        raise ConfigError(f"{where} holds no tokenizer.json (nor vocab.json/vocab.txt; it holds {shown}); {FIX}")


def load_tokenizer_json(path: str, where: str):
    """The ``tokenizers`` library's tokenizer, or one line instead of its Rust parse error."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception with serde's message
        raise ConfigError(
            f"{where}: tokenizer.json cannot be loaded ({' '.join(str(error).split())[:200]}); the file is "
            "truncated or not a tokenizers file: download it again"
        ) from None
