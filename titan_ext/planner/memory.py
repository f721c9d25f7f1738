"""What a rank holds, read from its tensors' local shards (planned and real runs alike)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

GIB, MIB = 2**30, 2**20


def local_bytes(tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def param_bytes(model_parts) -> int:
    return sum(local_bytes(p) for part in model_parts for p in part.parameters())


def grad_bytes(model_parts) -> int:
    return sum(local_bytes(p.grad) for part in model_parts for p in part.parameters() if p.grad is not None)


def optimizer_bytes(optimizers) -> int:
    """Every tensor of every optimizer's state (AdamW: both moments and the step counter)."""
    return sum(
        local_bytes(value)
        for optimizer in optimizers.optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
