"""``parallelize_fn`` for HF-layout models: TP, AC, compile, then FSDP/HSDP or DDP.

The order is torchtitan's. Each step is a small function over the HF layout
(``model.model.layers``, ``model.model.norm``, ``model.lm_head``), because
torchtitan's own ``apply_tp``/``apply_fsdp`` hard-code its Llama names.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from titan_ext.activation_checkpoint import apply_ac
from titan_ext.compile import apply_compile, model_compile_enabled
from titan_ext.cpu_mode import on_gloo


def parallelize_hf_model(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """The job config was checked before the model was built (``titan_ext.preflight``)."""
    if parallel_dims.tp_enabled:
        from titan_ext.tensor_parallel import apply_tp_from_config

        apply_tp_from_config(model, parallel_dims, job_config)

    compile_model = model_compile_enabled(job_config)
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config)
    if compile_model:
        apply_compile(model, job_config.compile)

    if parallel_dims.fsdp_enabled:
        dims = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(dims),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        logger.info(f"Applied {'HSDP' if parallel_dims.dp_replicate_enabled else 'FSDP'} to the model")
    elif parallel_dims.dp_replicate_enabled:
        dp_mesh = parallel_dims.get_mesh("dp_replicate")
        if dp_mesh.size() != parallel_dims.world_size:
            raise ValueError(
                "DDP (--parallelism.data_parallel_replicate_degree) cannot combine with TP or PP; "
                "use HSDP (also set --parallelism.data_parallel_shard_degree) instead"
            )
        apply_ddp(model, dp_mesh, compile_model)
    return model


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        # With PP, resharding would re-gather the weights for every microbatch.
        return not pp_enabled
    raise ValueError(
        f"--parallelism.fsdp_reshard_after_forward={policy!r} is not one of 'default', 'always', 'never'"
    )


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    pp_enabled: bool = False,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
) -> None:
    """FSDP2 (HSDP on a 2D mesh) over embeddings, each block, and norm + head together.

    The loss is already divided by the global token count, so gradients are
    summed, not averaged. gloo has no ``PREMUL_SUM``: there the reduction is
    forced to a plain sum, which with a divide factor of 1 is the same math.
    """
    reshard = _reshard_after_forward(reshard_after_forward_policy, pp_enabled)
    config = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # Pinned host memory needs an accelerator; without one the offload is a plain copy.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.accelerator.is_available()) if cpu_offload else OffloadPolicy(),
    }
    decoder = model.get_decoder()
    tied = model.config.tie_word_embeddings
    if not tied:
        fully_shard(model.get_input_embeddings(), **config, reshard_after_forward=reshard)
    for block in decoder.layers:
        fully_shard(block, **config, reshard_after_forward=reshard)
    if not tied:
        # Gathered last in forward and first in backward: keeping them unsharded
        # in between saves one all-gather.
        fully_shard(
            [decoder.norm, model.get_output_embeddings()],
            **config,
            reshard_after_forward=reshard_after_forward_policy == "always",
        )
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
        torch._dynamo.config.optimize_ddp = "ddp_optimizer"
    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
    model.register_comm_hook(dp_mesh.get_group(), _allreduce_sum_hook)
    logger.info("Applied DDP (gradient sum) to the model")
