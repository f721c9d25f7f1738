"""``python -m titan_ext.tokenizer_json FOLDER [--overwrite]``

Writes FOLDER/tokenizer.json, the file torchtitan's tokenizer reads (``--model.hf_assets_path``), for a hub folder
that ships its tokenizer in tiktoken's format (Kimi Linear, Kimi K2): ``tiktoken.model`` (a line ``base64(token
bytes) rank`` per token), the ``pat_str`` regex in the folder's Python tokenizer code, and the special tokens in
``tokenizer_config.json``'s ``added_tokens_decoder`` (ids after the ranks; a gap is a ``<|reserved_token_ID|>``,
as Kimi's code names it). The Python files are read as text (``ast``), never run. transformers'
``TikTokenConverter`` builds the tokenizer: a byte-level BPE whose merges come from the ranks. Not imported by
``import titan_ext``.
"""

from __future__ import annotations

import argparse
import ast
import base64
import binascii
import json
import sys
from pathlib import Path

from titan_ext.errors import ConfigError

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
OUTPUT_FILE = "tokenizer.json"
PATTERN_NAME = "pat_str"


def read_ranks(path: str) -> dict[bytes, int]:
    """tiktoken's BPE ranks, read without the ``tiktoken`` package (which caches a local file by its path);
    the ranks must be 0..n-1, so that the special tokens' ids follow them."""
    ranks = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(f"{path}:{number}: {line[:60]!r} is not 'base64(token bytes) rank'; the file is not a "
                              "tiktoken BPE file: download it again") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{path}: its ranks are not 0..{len(ranks) - 1}, each once; the file is not a tiktoken "
                          "BPE file: download it again")
    return ranks


def _string_value(node: ast.expr):
    """A string literal, ``a + b`` of them, or ``"sep".join([...])`` of them; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string_value(node.left), _string_value(node.right)
        return None if left is None or right is None else left + right
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))):
        separator, parts = _string_value(node.func.value), [_string_value(part) for part in node.args[0].elts]
        return None if separator is None or None in parts else separator.join(parts)
    return None


def patterns_in(source: str) -> list:
    """The values of every ``pat_str = ...`` assignment in Python source (None where not built of literals)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == PATTERN_NAME for target in targets):
            found.append(_string_value(node.value))
    return found


def read_pattern(folder: Path) -> str:
    """The pre-tokenization regex: the one ``pat_str`` the folder's Python files assign."""
    found = set()
    for path in sorted(folder.glob("*.py")):
        try:
            found |= {(path.name, value) for value in patterns_in(path.read_text())}
        except SyntaxError as error:
            raise ConfigError(f"{path} is not Python ({error.msg}, line {error.lineno}); download it again") from None
    values = {value for _, value in found}
    files = sorted({name for name, _ in found})
    if None in values:
        raise ConfigError(f"{folder}: {PATTERN_NAME} in {files} is not built of string literals; the folder's "
                          f"tokenizer code is not Kimi's: write its tokenizer.json with its own tools")
    if len(values) != 1:
        where = f"{len(values)} different ones in {files}" if values else "none in its *.py files"
        raise ConfigError(f"{folder}: needs one {PATTERN_NAME} assignment (the tokenizer's regex), found {where}; "
                          f"download the folder's tokenization_*.py beside {RANKS_FILE}")
    return values.pop()


def read_special_tokens(folder: Path, first_id: int) -> list[str]:
    """The special tokens of ids ``first_id`` onward, in id order, from ``added_tokens_decoder``."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{folder}: no {CONFIG_FILE} (its special tokens); download it beside {RANKS_FILE}")
    try:
        added = json.loads(path.read_text()).get("added_tokens_decoder", {})
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not JSON ({error}); download it again") from None
    by_id = {int(token_id): token["content"] if isinstance(token, dict) else token for token_id, token in added.items()}
    inside = sorted(token_id for token_id in by_id if token_id < first_id)
    if inside:
        raise ConfigError(f"{path}: added_tokens_decoder gives ids {inside[:3]} that {RANKS_FILE}'s ranks hold "
                          f"(0..{first_id - 1}); it is not this {RANKS_FILE}'s config")
    last_id = max(by_id, default=first_id - 1)
    return [by_id.get(token_id, f"<|reserved_token_{token_id}|>") for token_id in range(first_id, last_id + 1)]


def converted(folder: Path):
    """The folder's tokenizer as a ``tokenizers.Tokenizer``."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_ranks(str(folder / RANKS_FILE))
    specials = read_special_tokens(folder, len(ranks))
    pattern = read_pattern(folder)

    class FolderConverter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path: str) -> dict[bytes, int]:  # TikTokenConverter reads the ranks through it
            return ranks

    converter = FolderConverter(vocab_file=str(folder / RANKS_FILE), pattern=pattern, extra_special_tokens=specials)
    tokenizer = converter.converted()
    moved = [token for offset, token in enumerate(specials) if tokenizer.token_to_id(token) != len(ranks) + offset]
    if moved:
        raise ConfigError(f"{folder / CONFIG_FILE}: special tokens {moved[:3]} are also BPE tokens of {RANKS_FILE}; "
                          "they cannot keep their ids in a tokenizer.json")
    return tokenizer


def write_tokenizer_json(folder: str, overwrite: bool = False) -> Path:
    """FOLDER/tokenizer.json from FOLDER's tiktoken files; checks first, writes last."""
    root = Path(folder)
    output = root / OUTPUT_FILE
    if not (root / RANKS_FILE).is_file():
        raise ConfigError(f"{folder!r} holds no {RANKS_FILE}; point it at a hub folder in tiktoken's format "
                          "(tiktoken.model, tokenization_*.py, tokenizer_config.json)")
    if output.exists() and not overwrite:
        raise ConfigError(f"{output} exists; pass --overwrite to replace it")
    tokenizer = converted(root)
    tokenizer.save(str(output))
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_ext.tokenizer_json", description=__doc__.split("\n\n")[1])
    parser.add_argument("folder", help=f"the hub folder holding {RANKS_FILE}, its tokenization_*.py and {CONFIG_FILE}")
    parser.add_argument("--overwrite", action="store_true", help=f"replace an existing {OUTPUT_FILE}")
    options = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        output = write_tokenizer_json(options.folder, options.overwrite)
    except ConfigError as error:
        print(f"titan_ext: {error}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
