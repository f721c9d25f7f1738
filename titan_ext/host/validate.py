"""Validation (``[validation] enable``) for titan_ext's models: the loss over held-out windows.

torchtitan 0.2.2's ``Validator`` assumes its own models: it asks the first
model part for attention masks (``get_attention_masks``, which HF models lack:
an ``AttributeError`` at the first validation), builds a CP context from each
part's ``freqs_cis``, and reads its data through torchtitan's text dataloader,
which emits no document boundaries (with document masking, validation would
score packed windows as one sequence). titan_ext's validator reads
``[validation]`` through titan_ext's dataloader, so windows are cut and masked
as in training, hands the model what the trainer hands it (under CP
torchtitan's sharded ``positions``), and logs the mean loss per valid token
over ``validation.steps`` batches through torchtitan's metrics processor.
"""

from __future__ import annotations

import torch
from torchtitan.components.validate import BaseValidator


def build_validator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn, validation_context,
                    maybe_enable_amp, metrics_processor=None, pp_schedule=None, pp_has_first_stage=None,
                    pp_has_last_stage=None):
    """A train spec's ``build_validator_fn`` (torchtitan's signature)."""
    from titan_ext.data import build_dataloader

    loader = build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, section="validation",
                              infinite=job_config.validation.steps != -1)
    return Validator(job_config, loader, parallel_dims, loss_fn, validation_context, maybe_enable_amp,
                     metrics_processor, pp_schedule, pp_has_first_stage, pp_has_last_stage)


class Validator(BaseValidator):
    def __init__(self, job_config, loader, parallel_dims, loss_fn, validation_context, maybe_enable_amp,
                 metrics_processor, pp_schedule, pp_has_first_stage, pp_has_last_stage):
        super().__init__(job_config)
        self.loader, self.parallel_dims, self.loss_fn = loader, parallel_dims, loss_fn
        self.context, self.amp, self.metrics = validation_context, maybe_enable_amp, metrics_processor
        self.pp_schedule, self.first_stage, self.last_stage = pp_schedule, pp_has_first_stage, pp_has_last_stage

    @torch.no_grad()
    def validate(self, model_parts, step: int) -> None:
        from torchtitan.distributed import utils as dist_utils

        for part in model_parts:
            part.eval()
        steps, losses = self.job_config.validation.steps, []
        for batch, labels in self.loader:
            if steps != -1 and len(losses) >= steps:
                break
            self.metrics.ntokens_since_last_log += labels.numel()
            losses.append(self._mean_loss(model_parts, batch, labels))
        loss = torch.stack(losses).mean()
        # each rank holds its share of every batch's token mean: their sum over the batch (DP x CP) ranks
        mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
        self.metrics.log_validation(loss=dist_utils.dist_sum(loss, mesh), step=step)
        for part in model_parts:
            part.train()

    def _mean_loss(self, model_parts, batch: dict, labels: torch.Tensor) -> torch.Tensor:
        """This rank's loss sum over the batch's global valid-token count (0 on pipeline stages without the loss)."""
        from torchtitan.components.loss import IGNORE_INDEX
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.distributed.context_parallel import prepare_context_parallel_input
        from torchtitan.tools.utils import device_type

        dims = self.parallel_dims
        batch = {name: x.to(device_type) for name, x in batch.items()}
        inputs, labels, kwargs = batch.pop("input"), labels.to(device_type), {}
        tokens = (labels != IGNORE_INDEX).sum()  # of whole rows: CP ranks each hold a share of them
        tokens = dist_utils.dist_sum(tokens, dims.get_mesh("batch")) if dims.dp_enabled else tokens.float()
        if dims.cp_enabled:  # torchtitan's sharding of tokens, labels and positions, as in training
            inputs, labels, kwargs = prepare_context_parallel_input(
                inputs, labels, kwargs, dims.get_mesh("cp"), inputs.device,
                self.job_config.parallelism.context_parallel_load_balancer,
            )
        with self.context(), self.amp:
            if dims.pp_enabled:
                losses = [] if self.last_stage else None
                first = (inputs,) if self.first_stage else ()
                self.pp_schedule.eval(*first, **batch, **kwargs,  # document boundaries: every stage's
                                      target=labels if self.last_stage else None, losses=losses)
                loss_sum = torch.stack(losses).sum() if self.last_stage else torch.zeros((), device=inputs.device)
            else:
                loss_sum = self.loss_fn(model_parts[0](inputs, **batch, **kwargs), labels)
        return loss_sum / tokens
