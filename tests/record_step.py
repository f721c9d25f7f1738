"""A real job's step 2 as the planner sees one: preloaded by ``tests/matrix_driver.py`` for ``tests/test_plan.py``.

With ``RECORD_STEP_DIR`` set, torchtitan's ``Trainer.forward_backward_step`` of
the job's second step (the first one's optimizer state exists; on gloo a
pipeline's first step is a warm-up) runs under the planner's collective
recorder, and each rank writes what it held and issued to ``rank<R>.json``:
the same accounting ``python -m titan_ext.plan`` prints.
"""

import json
import os
from pathlib import Path

import torch.distributed as dist
from torchtitan.train import Trainer

from titan_ext.planner import collectives, memory

_forward_backward_step = Trainer.forward_backward_step
RECORDED_CALL = 2


def _recorded(self, **kwargs):
    folder = os.environ.get("RECORD_STEP_DIR")
    self._record_calls = getattr(self, "_record_calls", 0) + 1
    if not folder or self._record_calls != RECORDED_CALL:
        return _forward_backward_step(self, **kwargs)
    held = {"param_bytes": memory.param_bytes(self.model_parts), "optimizer_bytes": memory.optimizer_bytes(self.optimizers)}
    recorder, peak = collectives.Recorder(collectives.group_labels(self.parallel_dims)), memory.StepPeak()
    with peak, recorder:
        loss = _forward_backward_step(self, **kwargs)
    held["grad_bytes"] = memory.grad_bytes(self.model_parts)
    held["peak_bytes"] = memory.step_peak_bytes(peak, self.model_parts, self.gradient_accumulation_steps)
    held["collectives"] = collectives.summary(recorder.log)
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"rank{dist.get_rank()}.json").write_text(json.dumps(held))
    return loss


Trainer.forward_backward_step = _recorded
