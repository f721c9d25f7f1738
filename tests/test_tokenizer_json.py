"""``python -m titan_ext.tokenizer_json``: a hub folder in tiktoken's format (Kimi's) gets the tokenizer.json
torchtitan reads, whose ids are tiktoken's on the folder's files (``tests/tiktoken_folder.py``)."""

from __future__ import annotations

import json

import pytest
import tiktoken_folder

from titan_ext.tokenizer_json import main, read_pattern

RANKS = tiktoken_folder.train_ranks(tiktoken_folder.TRAINING_TEXT, merges=200)
CL100K_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""transformers' TikTokenConverter's default regex: the ids it gives ``TEXTS`` differ from Kimi's regex's."""
TEXTS = (
    tiktoken_folder.TRAINING_TEXT,
    "HelloWorld, it's 12345 and 中文abc! WorldWide\n\n\tand   spaces  ",
    "unseen words: zebra, Ωmega and 🙂, THE END's near.\r\n",
)
SPECIAL_TEXT = "[BOS]the cat<|im_user|>HelloWorld<|im_end|>[EOS]"


@pytest.fixture
def folder(tmp_path):
    tiktoken_folder.write_folder(tmp_path, RANKS)
    return tmp_path


def test_the_ids_are_tiktokens_and_torchtitans_tokenizer_round_trips_them(folder, capsys):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assert main([str(folder)]) == 0
    assert capsys.readouterr().out == f"wrote {folder / 'tokenizer.json'}\n"
    tokenizer = HuggingFaceTokenizer(str(folder))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_bos=False, add_eos=False)
        assert ids == tiktoken_folder.tiktoken_encode(text, RANKS)
        assert tokenizer.decode(ids) == text
    assert [tiktoken_folder.tiktoken_encode(text, RANKS) for text in TEXTS] != [
        tiktoken_folder.tiktoken_encode(text, RANKS, CL100K_PATTERN) for text in TEXTS]  # the folder's regex decides
    specials = tiktoken_folder.special_ids(RANKS)
    ids = tokenizer.encode(SPECIAL_TEXT, add_bos=False, add_eos=False)
    assert ids == tiktoken_folder.tiktoken_encode(SPECIAL_TEXT, RANKS)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (specials["[BOS]"], specials["[EOS]"])
    assert tokenizer.tokenizer.id_to_token(len(RANKS) + 4) == f"<|reserved_token_{len(RANKS) + 4}|>"  # the gap
    assert tokenizer.get_vocab_size() == max(specials.values()) + 1


def test_the_pattern_is_read_from_the_python_file_never_run(folder):
    (folder / "tokenization_kimi.py").write_text(
        (folder / "tokenization_kimi.py").read_text() + "\nopen(__file__ + '.ran', 'w')\n")
    assert read_pattern(folder) == tiktoken_folder.KIMI_PATTERN
    assert not (folder / "tokenization_kimi.py.ran").exists()


def test_an_existing_tokenizer_json_is_replaced_only_when_asked(folder, capsys):
    (folder / "tokenizer.json").write_text("mine")
    assert main([str(folder)]) == 2
    assert capsys.readouterr().err == f"titan_ext: {folder / 'tokenizer.json'} exists; pass --overwrite to replace it\n"
    assert (folder / "tokenizer.json").read_text() == "mine"
    assert main([str(folder), "--overwrite"]) == 0
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "BPE"
