"""The non-finite-loss guard and the JSON-lines metrics logger, in one process (the matrix runs them in jobs)."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from torchtitan.components.optimizer import OptimizersContainer

from titan_ext.errors import ConfigError
from titan_ext.host import nonfinite
from titan_ext.host.metrics import JsonlLogger


class Optimizers(OptimizersContainer):
    def __init__(self):  # no torch optimizers: only the step the guard wraps
        self.steps, self.zeroed = 0, 0

    def step(self, *args, **kwargs):
        self.steps += 1

    def zero_grad(self):
        self.zeroed += 1


def guarded(policy: str):
    """An optimizers container and LR schedulers wired to a fresh guard, as a job builds them."""
    nonfinite._guard.start_job()
    optimizers = Optimizers()
    optimizers.model_parts = [SimpleNamespace(model_args=SimpleNamespace(plan=SimpleNamespace(nonfinite=policy)))]
    schedulers = SimpleNamespace(schedulers=[SimpleNamespace(last_epoch=4)])
    nonfinite.guard_optimizer_step(lambda *args: schedulers)(optimizers, None, 10)
    return optimizers


def test_finite_losses_step():
    optimizers = guarded("stop")
    nonfinite._guard.record(torch.tensor(2.0))
    optimizers.step()
    assert optimizers.steps == 1


def test_stop_names_the_step_and_skips_the_update():
    optimizers = guarded("stop")
    nonfinite._guard.record(torch.tensor(1.0))
    nonfinite._guard.record(torch.tensor(math.inf))  # one bad microbatch is enough
    with pytest.raises(FloatingPointError, match="non-finite loss \\(NaN or Inf\\) at step 5: stopped"):
        optimizers.step()
    assert optimizers.steps == 0


def test_skip_drops_one_update_then_trains_on():
    optimizers = guarded("skip")
    nonfinite._guard.record(torch.tensor(math.nan))
    optimizers.step()
    assert (optimizers.steps, optimizers.zeroed) == (0, 1)
    nonfinite._guard.record(torch.tensor(1.0))
    optimizers.step()
    assert optimizers.steps == 1


def test_validation_losses_are_not_watched():
    loss_fn = nonfinite.watch_loss(lambda job_config, **kw: (lambda pred, labels: pred.sum()))(None)
    optimizers = guarded("stop")
    with torch.no_grad():  # torchtitan's validator runs without gradients
        loss_fn(torch.tensor([math.nan]), None)
    optimizers.step()
    assert optimizers.steps == 1


def test_policy_names_the_option():
    assert nonfinite.policy(None) == "stop"
    with pytest.raises(ConfigError, match="--titan_ext.nonfinite_loss='never'"):
        nonfinite.policy(SimpleNamespace(nonfinite_loss="never"))


def test_jsonl_logger_keeps_full_precision_and_forwards(tmp_path):
    logged = []
    inner = SimpleNamespace(log=lambda metrics, step: logged.append(step), close=lambda: None)
    path = tmp_path / "sub" / "metrics.jsonl"
    logger = JsonlLogger(inner, str(path))
    logger.log({"loss": 1.0 / 3.0}, step=1)
    logger.log({"loss": 0.25}, step=2)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 1.0 / 3.0}, {"step": 2, "loss": 0.25}] and logged == [1, 2]
