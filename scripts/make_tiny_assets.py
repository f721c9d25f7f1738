"""Regenerate ``titan_ext/assets/tiny``: a synthetic English corpus and a BPE tokenizer.

The project ships both so training needs no download. The corpus is made
from a fixed grammar and seed, so it has real structure for a tiny model to
learn (the loss falls within a few steps), and this script reproduces it
byte for byte: ``python scripts/make_tiny_assets.py``.
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parents[1] / "titan_ext" / "assets" / "tiny"
VOCAB_SIZE = 2048
DOCUMENTS = 4000

NAMES = ["Ada", "Boris", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kemal", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "goat", "crow", "otter", "badger", "heron"]
PLACES = ["the river", "the old mill", "the market", "the forest", "the harbor", "the hill", "the library", "the bridge"]
OBJECTS = ["a red kite", "a wooden box", "a silver key", "a bag of apples", "a map", "a lantern", "a letter", "a clock"]
VERBS = [("found", "finds"), ("carried", "carries"), ("lost", "loses"), ("painted", "paints"), ("sold", "sells")]
TIMES = ["In the morning", "At noon", "In the evening", "Before dawn", "After the rain", "On Sunday"]
WEATHER = ["cold", "warm", "windy", "quiet", "bright", "grey"]


def sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    name, other = rng.sample(NAMES, 2)
    if kind == 0:
        past, _ = rng.choice(VERBS)
        return f"{rng.choice(TIMES)}, {name} {past} {rng.choice(OBJECTS)} near {rng.choice(PLACES)}."
    if kind == 1:
        return f"The {rng.choice(ANIMALS)} that {name} saw at {rng.choice(PLACES)} was {rng.choice(WEATHER)} and tired."
    if kind == 2:
        a, b = rng.randrange(1, 50), rng.randrange(1, 50)
        return f"{name} had {a} coins and {other} gave {b} more, so {name} had {a + b} coins."
    if kind == 3:
        _, present = rng.choice(VERBS)
        return f"Every day {name} {present} {rng.choice(OBJECTS)}, and {other} watches from {rng.choice(PLACES)}."
    return f"It was {rng.choice(WEATHER)} at {rng.choice(PLACES)} when {name} met {other} and the {rng.choice(ANIMALS)}."


def corpus(rng: random.Random) -> list[str]:
    return [" ".join(sentence(rng) for _ in range(rng.randrange(3, 9))) for _ in range(DOCUMENTS)]


def train_tokenizer(documents: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def main() -> None:
    documents = corpus(random.Random(0))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    train_tokenizer(documents).save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}, indent=2) + "\n"
    )
    print(f"wrote {len(documents)} documents and a {VOCAB_SIZE}-token tokenizer to {OUT}")


if __name__ == "__main__":
    main()
