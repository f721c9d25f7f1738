"""``parallelize_fn`` for HF-layout models: TP, CP, AC, compile, then FSDP/HSDP or DDP.

The order is torchtitan's. Each step is a small function over the HF layout
(the layer stack, final norm and head found in the model: ``models.structure``), because
torchtitan's own ``apply_tp``/``apply_fsdp`` hard-code its Llama names. Every
choice was made once, in the job plan the model's args carry (``titan_ext.job_plan``).
"""

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_ext.cpu_mode import on_gloo
from titan_ext.data.documents import apply_document_attention
from titan_ext.job_plan import job_plan_of
from titan_ext.models.forward_plan import decide_forward
from titan_ext.models.loss import apply_chunked_loss
from titan_ext.models.moe.bias_router import apply_expert_bias
from titan_ext.models.moe.blocks import moe_blocks
from titan_ext.models.moe.records import apply_router_records
from titan_ext.parallel import host_patches
from titan_ext.parallel.activation_checkpoint import apply_ac
from titan_ext.parallel.compile import apply_compile
from titan_ext.parallel.expert_parallel import apply_ep, apply_expert_tp
from titan_ext.parallel.float8 import keep_high_precision

logger = logging.getLogger()


def parallelize_hf_model(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    plan = job_plan_of(model)  # the model's args carry the job plan
    tp_mesh = parallel_dims.get_mesh("tp") if plan.tp is not None else None
    cp_mesh = parallel_dims.get_mesh("cp") if plan.cp is not None else None
    forward = model.forward_plan = decide_forward(model, plan, tp_mesh, cp_mesh)  # read by its forward and hooks
    cp_group = cp_mesh.get_group() if cp_mesh is not None else None
    apply_router_records(model, plan.moe, cp_group)  # for the routers' balancing loss
    if plan.moe is not None and plan.moe.balance == "bias":
        apply_expert_bias(model)
    if plan.float8 is not None and plan.float8.high_precision:
        keep_high_precision(model, plan.float8.high_precision)
    if plan.moe is not None and plan.moe.split_intermediate:  # TP without EP, or ETP=TP
        apply_expert_tp(model, parallel_dims.get_mesh(["ep", "etp"] if plan.moe.ep > 1 else "tp"))
    elif plan.moe is not None and plan.moe.ep > 1:
        apply_ep(model, parallel_dims.get_mesh("ep"), parallel_dims.get_mesh("tp") if plan.tp is not None else None)
    if forward.head_in_loss:
        apply_chunked_loss(model, plan.loss)
    if forward.document_attention:
        apply_document_attention(model)
    if plan.tp is not None:
        from titan_ext.parallel.tensor_parallel import apply_tp_from_plan

        apply_tp_from_plan(model, tp_mesh, plan.tp, head_in_loss=forward.head_in_loss)
    if plan.cp is not None:
        from titan_ext.parallel.context_parallel import apply_cp

        apply_cp(model, cp_mesh, plan.cp, forward.cp_layout)
    apply_ac(model, plan.ac, dump_folder=job_config.job.dump_folder)
    if plan.compile.model:
        apply_compile(model, plan.compile.backend)

    dp = plan.data_parallel
    if dp.kind in ("fsdp", "hsdp"):
        dims = ["dp_replicate", "fsdp"] if dp.kind == "hsdp" else ["fsdp"]
        expert_dims = ["dp_replicate", "efsdp"] if dp.kind == "hsdp" else ["efsdp"]
        expert_mesh = parallel_dims.get_optional_mesh(expert_dims) if parallel_dims.ep_enabled else None
        apply_fsdp(model, parallel_dims.get_mesh(dims), dp, expert_mesh, head_alone=forward.head_in_loss)
        logger.info(f"Applied {dp.kind.upper()} to the model")
    elif dp.kind == "ddp":
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), plan.compile.model)
    return model


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, dp, expert_mesh: DeviceMesh | None = None, head_alone: bool = False
) -> None:
    """FSDP2 (HSDP on a 2D mesh) over embeddings, each block, and norm + head together; under expert
    parallelism a block's experts are sharded on their own (``expert_mesh``: the data-parallel ranks of one
    expert-parallel rank, torchtitan's ``efsdp``).

    ``head_alone`` (the chunked loss, which calls the head after the model's forward): the head is a group
    of its own, gathered when the loss calls it; the final norm stays with the root.

    The loss is already divided by the global token count, so gradients are
    summed, not averaged. gloo has no ``PREMUL_SUM``: there the reduction is
    forced to a plain sum, which with a divide factor of 1 is the same math.
    """
    config = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dp.param_dtype, reduce_dtype=dp.reduce_dtype),
        # Pinned host memory needs an accelerator; without one the offload is a plain copy.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.accelerator.is_available()) if dp.cpu_offload else OffloadPolicy(),
    }
    tied = model.structure.tied
    # A pipeline stage holds the embedding, the final norm or the head only where it runs them (and a tied
    # head's stage the embedding too, as the owner of the head's weight: the root group owns both).
    embeddings = model.get_input_embeddings()
    if not tied and embeddings is not None:
        fully_shard(embeddings, **config, reshard_after_forward=dp.reshard_blocks)
    for block in model.blocks():
        if expert_mesh is not None:
            for moe_block in moe_blocks(block):
                fully_shard(moe_block.experts, **{**config, "mesh": expert_mesh}, reshard_after_forward=dp.reshard_blocks)
        fully_shard(block, **config, reshard_after_forward=dp.reshard_blocks)
    head = [m for m in (model.final_norm(), model.get_output_embeddings()) if m is not None and any(True for _ in m.parameters())]
    if head_alone:
        head = [m for m in head if m is model.get_output_embeddings()]
    if not tied and head:
        # Gathered last in forward and first in backward: keeping them unsharded
        # in between saves one all-gather.
        fully_shard(head, **config, reshard_after_forward=dp.reshard_head)
    fully_shard(model, **config)
    force_sum = on_gloo(dp_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if force_sum:
                module.set_force_sum_reduction_for_comms(True)


# No postponed annotations in this module: DDP checks this hook's annotations as real types.
def _allreduce_sum_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, compile_enabled: bool) -> None:
    """DDP that sums gradients, as FSDP does here.

    torch's DDP averages over ranks; with torchtitan's loss (a sum divided by
    the global token count) that would scale gradients by 1/world_size.
    """
    if compile_enabled:
        host_patches.OPTIMIZE_DDP.set("ddp_optimizer")
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
    model.register_comm_hook(dp_mesh.get_group(), _allreduce_sum_hook)
    logger.info("Applied DDP (gradient sum) to the model")
