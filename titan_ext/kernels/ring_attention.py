"""torch's ring attention on the CPU: the two entries its context-parallel dispatcher lacks.

Under CP, softmax attention runs as torchtitan runs its own models': a module
calling ``F.scaled_dot_product_attention``, made context parallel by
torchtitan's ``apply_cp_to_attention_module``, sees its query, key and value
as sequence-sharded DTensors, and torch's DTensor dispatcher hands the SDPA
kernel to its ring template (``_templated_ring_attention``: each rank's
queries against every rank's keys and values in turn, merged by logsumexp).
That dispatcher knows CUDA's kernels only (flash, efficient, cuDNN). On a CPU,
SDPA's kernel is ``_scaled_dot_product_flash_attention_for_cpu``: the handlers
below route it and its backward through the same template, one CPU flash call
per block. ``host.cpu_patches.CPU_MODE`` adds them to torch's table; on CUDA torch
runs as shipped.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from titan_ext import compat

aten = torch.ops.aten
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2
"""``[B, H, T, D]``: torch's ``_ContextParallel(seq_dim=2)`` shards the sequence, as torchtitan applies it."""


def _forward_arguments(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return query, key, value, dropout_p, is_causal, attn_mask, scale


def _backward_arguments(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                        scale=None):
    return grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale


def _local(tensor: DTensor) -> torch.Tensor:
    if tuple(tensor.placements) != (Shard(SEQ_DIM),):
        raise NotImplementedError(f"ring attention takes tensors sharded along dim {SEQ_DIM}, not {tensor.placements}")
    return tensor.to_local()


def _as_shards(results, mesh) -> tuple:
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) if isinstance(t, torch.Tensor) else t
                 for t in results)


def ring_flash_forward(op_call, args, kwargs):
    query, key, value, dropout_p, is_causal, attn_mask, scale = _forward_arguments(*args, **kwargs)
    if attn_mask is not None:
        raise NotImplementedError("ring attention takes no attn_mask (titan_ext all-gathers keys for masked attention)")
    mesh = query.device_mesh
    out = compat.torch_ring_template().forward(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu,
        _local(query), _local(key), _local(value), is_causal=is_causal, dropout_p=dropout_p, scale=scale,
    )
    return _as_shards(out, mesh)  # output and logsumexp, both sharded along the sequence


def ring_flash_backward(op_call, args, kwargs):
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask, scale = _backward_arguments(
        *args, **kwargs)
    mesh = query.device_mesh
    grads = compat.torch_ring_template().backward(
        mesh.get_group(), SEQ_DIM, BACKWARD, _local(grad_out), "grad_out", _local(query), _local(key), _local(value),
        _local(out), _local(logsumexp), is_causal, dropout_p=dropout_p, attn_mask=attn_mask, scale=scale,
    )
    return _as_shards(grads, mesh)


HANDLERS = {FORWARD: ring_flash_forward, BACKWARD: ring_flash_backward}
