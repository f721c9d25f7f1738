"""A mixture-of-experts model's per-step metrics (the balancing loss, tokens per expert), logged beside
torchtitan's (``titan_ext.host.metrics``) from the routers' records of the steps since the last log."""

from __future__ import annotations

import torch.distributed as dist

from titan_ext.models.moe.records import RECORDS


def step_metrics(group: dist.ProcessGroup | None, pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """The balancing loss (per valid token, over the global batch) and tokens per expert (max and mean over MoE
    layers and experts) of the steps since the last log, summed over the ranks of ``group`` (the batch's) and
    of ``pp_group`` (the pipeline's: each stage counts its own MoE layers, the last one the loss)."""
    stats = RECORDS.stats
    if RECORDS.choice is None or stats is None:
        return {}
    for ranks in (group, pp_group):
        if ranks is not None and dist.is_initialized():
            dist.all_reduce(stats, group=ranks)
    RECORDS.reset_step()
    stats = stats.cpu()
    counts = stats[2:]
    balance = {} if RECORDS.choice.balance == "bias" else {"moe/aux_loss": (stats[0] / stats[1].clamp_min(1)).item()}
    return {
        **balance,
        "moe/tokens_per_expert_max": counts.max().item(),
        "moe/tokens_per_expert_mean": counts.mean().item(),
    }
