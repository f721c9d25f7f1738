"""transformers' sparse MoE blocks, recognised by what they hold: a router (``router_of``: Qwen's ``gate``,
gpt-oss's ``router``; ``router_logits, scores, indices = router(x)``) and one ``experts`` module of stacked
weights. Every MoE feature (the balancing loss, the routing bias, expert parallelism, the plan's checks) finds
the blocks here, never by model type.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch.nn as nn


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """transformers' sparse MoE blocks: a router (``router_of``) beside an ``experts`` module."""
    return [m for m in model.modules() if router_of(m) is not None]


def router_of(block: nn.Module) -> nn.Module | None:
    """A MoE block's router, whatever the block calls it (Qwen's ``gate``, gpt-oss's ``router``): beside the
    block's ``experts``, which its forward hands the router's choice (``experts(hidden, indices, weights)``), the
    module choosing ``top_k`` of them (its contract is probed at the job's start: ``host.checks``). Llama 4's
    experts take the tokens already weighted: no such block."""
    experts = getattr(block, "experts", None)
    if not isinstance(experts, nn.Module) or not _experts_take_the_choice(type(block)):
        return None
    router = next((child for child in block.children() if child is not experts and hasattr(child, "top_k")), None)
    return router if router is not None and _scores_each_expert(router, experts) else None


def _scores_each_expert(router: nn.Module, experts: nn.Module) -> bool:
    """Whether a linear of the router has one row per expert (LongCat's scores computeless experts too: its
    logits are not the experts', which the balancing loss counts)."""
    stacked = getattr(experts, "gate_up_proj", None)
    count = getattr(router, "num_experts", None) or (stacked.shape[0] if stacked is not None else None)
    weights = [p for p in router.parameters() if p.ndim == 2]
    return count is None or not weights or any(w.shape[0] == count for w in weights)


@functools.cache
def _experts_take_the_choice(cls: type) -> bool:
    """Whether ``cls.forward`` calls ``self.experts`` with three arguments or more (hidden states, the top-k
    experts and their weights); True where its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "experts"
               and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
               and len(node.args) + len(node.keywords) >= 3 for node in ast.walk(tree))


def without_moe_blocks(model: nn.Module) -> str:
    """What a model without MoE blocks (``moe_blocks``) holds, for a refusal: no experts, or the first experts that
    are not a block's router's top-k choice, and why (Zaya's and LongCat's routers also choose computeless experts)."""
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if isinstance(experts, nn.Module) and router_of(block) is None:
            return f"its experts ({type(experts).__name__} at {name}.experts) {_not_chosen_because(block, experts)}"
    return "this model has no experts (a dense model)"


def _not_chosen_because(block: nn.Module, experts: nn.Module) -> str:
    """Why ``router_of(block)`` found no router for ``experts``."""
    if not _experts_take_the_choice(type(block)):
        return "take no router's top-k choice from their block's forward (they are not a MoE block titan_ext reads)"
    router = next((child for child in block.children() if child is not experts and hasattr(child, "top_k")), None)
    if router is None:
        return "have no module beside them choosing top_k of them (not a MoE block titan_ext reads)"
    return (f"are chosen by {type(router).__name__}, no linear of which has one row per expert: it also chooses "
            "computeless experts, which titan_ext's balancing loss and expert parallelism do not count: its blocks "
            "train as transformers writes them, without either")


def routers(model: nn.Module) -> list[nn.Module]:
    return [router_of(block) for block in moe_blocks(model)]


STACKED = ["down_proj", "gate_up_proj"]
"""The experts' parameters expert parallelism and expert TP split and compute: ``down(act(gate) * up)``."""


def stacked_plainly(experts: nn.Module) -> bool:
    """Experts of stacked ``gate_up_proj`` and ``down_proj`` alone (not gpt-oss's, which add biases, a clamped
    SwiGLU and interleaved gate/up rows)."""
    return sorted(name for name, _ in experts.named_parameters()) == STACKED


def moe_layer_indices(model: nn.Module) -> list[int]:
    """The decoder layers (their indices in the whole model, also in a pipeline stage) holding a MoE block."""
    from titan_ext.models.structure import layer_stack

    return [int(name) for name, layer in layer_stack(model).named_children() if moe_blocks(layer)]
