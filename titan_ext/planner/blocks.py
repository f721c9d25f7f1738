"""A model of identical blocks planned with fewer blocks per pipeline stage, and extrapolated to its own count.

Every block adds the same parameters, gradients, optimizer state, saved activations and collectives, and,
where the step's peak comes after the blocks' forwards (their saved tensors all held), the same bytes to the
peak: f(k) = f(2) + (k - 2) (f(3) - f(2)). ``tests/test_plan.py`` plans layouts of each kind both ways and finds
every field equal.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, replace

BLOCK_POINTS = (2, 3)
"""Blocks per pipeline stage (or in the model, without PP) of the two smaller models a model of identical
blocks is planned with: two, so that a stage's first block (which takes the embedding's output) and its last
(before the norm, or the next stage) are both there in each."""


@dataclass(frozen=True)
class Blocks:
    """Where a model's blocks are: how many each pipeline stage holds (the model's, without PP), and each
    stage's module FQNs as block indices (None for a module that is no block; None without PP)."""

    counts: tuple[int, ...]
    indices: tuple[tuple[int | None, ...], ...] | None


def alike(model_args, plan) -> bool:
    """Every block the same module: one token mixer throughout, every FFN alike (no dense layers among MoE
    ones), and AC the same for each (not every Nth)."""
    config = model_args.to_hf_config()
    if model_args.structure().hybrid:
        return False
    if len(set(getattr(config, "layer_types", None) or [None])) != 1 or getattr(config, "attn", None):
        return False
    if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) > 1:
        return False
    if getattr(config, "first_k_dense_replace", 0):
        return False
    return plan.ac is None or plan.ac.every is None


def blocks_of(model_args, plan) -> Blocks | None:
    """The model's blocks per stage; None with several stages per rank (their counts differ)."""
    if plan.pp is None:
        return Blocks((model_args.to_hf_config().num_hidden_layers,), None)
    if len(plan.pp.stages) != plan.pp.degree:
        return None
    indices = tuple(tuple(_block_index(name) for name in stage) for stage in plan.pp.stages)
    return Blocks(tuple(sum(index is not None for index in stage) for stage in indices), indices)


def worth_it(blocks: Blocks, forced: bool) -> bool:
    """Whether planning ``BLOCK_POINTS`` blocks per stage steps fewer blocks than the model's own (always where
    ``forced``, for the tests), and a stage holds more than the fewer."""
    low, high = BLOCK_POINTS
    counts = blocks.counts
    cost = sum(k + 1 for k in counts)  # a stage's blocks and one block's worth for its embedding, head, loss, step
    if all(k <= low for k in counts):
        return False
    return forced or sum(min(k, low) + min(k, high) + 2 for k in counts) < cost


def smaller_job(job_config, model_args, plan, blocks: Blocks, point: int, folder: str):
    """The job with ``point`` blocks per stage (each stage keeps its first ones, and its embedding, norm or
    head), its model's HF config written into ``folder``."""
    import copy

    config = model_args.to_hf_config()
    job = copy.deepcopy(job_config)
    fields = {"model_type": model_args.model_type, **model_args.architecture(),
              "num_hidden_layers": sum(min(k, point) for k in blocks.counts)}
    if isinstance(getattr(config, "layer_types", None), list):
        fields["layer_types"] = config.layer_types[: fields["num_hidden_layers"]]
    path = os.path.join(folder, f"{point}.json")
    with open(path, "w") as f:
        json.dump(fields, f)
    job.titan_ext.hf_config = path
    if blocks.indices is not None:
        job.parallelism.module_fqns_per_model_part = fewer_blocks(plan.pp.stages, blocks.indices, point)
    return job


def extrapolated(smaller: list, blocks: Blocks, plan) -> list | None:
    """Each rank's figures from its plans at ``BLOCK_POINTS`` blocks (``smaller``: a layout's RankPlans per
    point) extrapolated to its stage's own count (without PP, every rank the model's); None where a count
    would go negative."""
    counts = blocks.counts if blocks.indices is not None else blocks.counts * len(smaller[0])
    out = []
    for two, three, k in zip(*smaller, counts):
        found = block_line(two, three, k - BLOCK_POINTS[0])
        if found is None:
            return None
        out.append(replace(found, plan=plan))
    return out


def _block_index(name: str) -> int | None:
    """A stage's module FQN that names a block (``model.layers.7``): its index."""
    last = name.rsplit(".", 1)[-1]
    return int(last) if last.isdigit() else None


def fewer_blocks(stages, indices, point: int) -> list[list[str]]:
    """The stages with their first ``point`` blocks each, renumbered in order; their other modules kept."""
    out, number = [], 0
    for stage, found in zip(stages, indices):
        kept, count = [], 0
        for name, index in zip(stage, found):
            if index is None:
                kept.append(name)
            elif count < point:
                kept.append(f"{name.rsplit('.', 1)[0]}.{number}")
                count, number = count + 1, number + 1
        out.append(kept)
    return out


def block_line(two, three, more: int):
    """``two`` plus ``more`` times what a block added from ``two`` to ``three``; None where a count goes
    negative. The collectives in the order they first came, each repeated its count."""
    assert (two.rank, two.stages) == (three.rank, three.stages)
    low, high = Counter(two.collectives), Counter(three.collectives)
    counts = {c: low[c] + more * (high[c] - low[c]) for c in {*low, *high}}
    if any(n < 0 for n in counts.values()):
        return None
    ordered = [c for c in dict.fromkeys([*three.collectives, *two.collectives]) for _ in range(counts[c])]

    def line(name):
        return getattr(two, name) + more * (getattr(three, name) - getattr(two, name))

    figures = {name: line(name) for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "saved_bytes", "peak_bytes")}
    if any(v < 0 for v in figures.values()):
        return None
    return replace(two, **figures, collectives=tuple(ordered), microbatch=None)
