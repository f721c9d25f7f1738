"""A tokenizer in tiktoken's format as Kimi's hub folders ship it, tiny, and tiktoken's encoding computed from it.

``write_folder`` writes ``tiktoken.model`` (ranks learned here: a byte-level BPE over a text, its merges free to
cross words, so that the pre-tokenization regex decides where tokens end), a ``tokenization_kimi.py`` whose
``pat_str`` is Kimi's, and a ``tokenizer_config.json`` with special tokens after the ranks. ``tiktoken_encode``
is tiktoken's algorithm on those files, written out (``tiktoken`` is no dependency here): special tokens split
out, the regex's pieces, each piece's bytes merged lowest rank first.

The config leaves out the hub's ``auto_map`` (it names the Python code for transformers' ``AutoTokenizer``, which
would then refuse to load the folder without ``trust_remote_code``): the integration matrix loads its exports'
tokenizers with ``AutoTokenizer``.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import regex

KIMI_PATTERN_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
"""Kimi's pre-tokenization regex (``pat_str`` of Kimi-Linear-48B-A3B-Instruct's tokenization_kimi.py), in parts."""
KIMI_PATTERN = "|".join(KIMI_PATTERN_PARTS)

SPECIAL_TOKENS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 5: "[PAD]"}
"""Id after the ranks -> special token, as Kimi's added_tokens_decoder lists them (id 4 left out: a gap)."""

TRAINING_TEXT = (
    "The cat sat on the mat; the dog sat on the log. HelloWorld and HelloThere are CamelCase names, "
    "as are MyWorld and TheWorld. It's what we've said and they'll see. 中文abc and 中文的文本, 文字abc. "
    "Numbers: 12345, 2026 and 3.14159.\n\nThen the cat and the dog ran to the park; the park was green. "
    "WorldWide HelloWorld! 中文xyz: it's the end, and the end's near. 4096 tokens, 8 GPUs, 256 experts.\n"
)
"""What ``train_ranks`` learns from: CamelCase words and Han next to Latin letters, where Kimi's regex ends pieces
that the default (cl100k's) one does not, so that merges across those ends change the ids."""

TOKENIZER_CODE = '''"""Kimi's tokenizer as its hub folder ships it, abridged: it imports tiktoken, never run here."""
import tiktoken


class TikTokenTokenizer:
    num_reserved_special_tokens = 256

    pat_str = "|".join(
        [
{parts}
        ]
    )
'''


def train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """Each byte at its own rank, then ``merges`` tokens, each the commonest adjacent pair of ``text``'s tokens."""
    ranks = {bytes([b]): b for b in range(256)}
    tokens = [bytes([b]) for b in text.encode()]
    for _ in range(merges):
        pairs = Counter(zip(tokens, tokens[1:]))
        (left, right), count = pairs.most_common(1)[0]
        if count < 2:
            break
        ranks[left + right] = len(ranks)
        merged, i = [], 0
        while i < len(tokens):
            if i + 1 < len(tokens) and tokens[i] == left and tokens[i + 1] == right:
                merged.append(left + right)
                i += 2
            else:
                merged.append(tokens[i])
                i += 1
        tokens = merged
    return ranks


def write_folder(folder: Path, ranks: dict[bytes, int], pattern_parts=KIMI_PATTERN_PARTS) -> None:
    """``tiktoken.model``, ``tokenization_kimi.py`` and ``tokenizer_config.json`` of a Kimi-style hub folder."""
    folder.mkdir(parents=True, exist_ok=True)
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in by_rank]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    parts = "\n".join(f'            r"""{part}""",' for part in pattern_parts)
    (folder / "tokenization_kimi.py").write_text(TOKENIZER_CODE.replace("{parts}", parts))
    added = {str(len(ranks) + offset): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": True}
             for offset, token in SPECIAL_TOKENS.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576}, indent=2))


def special_ids(ranks: dict[bytes, int]) -> dict[str, int]:
    return {token: len(ranks) + offset for offset, token in SPECIAL_TOKENS.items()}


def _merge(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's byte-pair merge of one piece: the adjacent pair whose join has the lowest rank first, leftmost."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while True:
        joins = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
        if not joins:
            break
        _, i = min(joins)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[part] for part in parts]


def tiktoken_encode(text: str, ranks: dict[bytes, int], pattern: str = KIMI_PATTERN) -> list[int]:
    """The ids tiktoken gives ``text`` (special tokens allowed, as Kimi's tokenizer encodes)."""
    specials = special_ids(ranks)
    split = "(" + "|".join(regex.escape(token) for token in sorted(specials, key=len, reverse=True)) + ")"
    compiled, ids = regex.compile(pattern, flags=regex.V1), []
    for i, chunk in enumerate(regex.split(split, text)):
        if i % 2:
            ids.append(specials[chunk])
            continue
        for piece in compiled.findall(chunk):
            data = piece.encode()
            ids.extend([ranks[data]] if data in ranks else _merge(data, ranks))
    return ids
