"""fla's Gated Linear Attention (``GLAForCausalLM``)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from model_plans.base import IfPresent, Plan, TPPlan, short_conv_plan
from model_plans.registry import register_tp_plan
from model_plans.styles import NormParallel


@register_tp_plan("gla")
class GLATPPlan(TPPlan):
    """Heads are split across ranks: q/k/v/g and the gate's up-projection colwise, o_proj rowwise.

    The low-rank gate's down-projection ``gk_proj.0`` (hidden -> 16) is too
    small to shard: its weight is replicated. The optional short convolutions
    are sharded with the projections feeding them (``short_conv_plan``). The
    per-head output norm runs on the local heads (``Shard(-2)``) with its
    gate. The input is gathered in high precision even with Float8:
    ``gk_proj.0`` is not a Float8 colwise linear and would receive a float8
    tensor.
    """

    def attn_plan(self) -> Plan:
        from fla.modules.parallel import PrepareModuleWeight

        gather = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": self.activation},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        head_norm = NormParallel(Shard(-2), use_local_output=True)
        return {
            "attn": gather,
            "attn.q_proj": self.colwise(),
            "attn.k_proj": self.colwise(),
            "attn.v_proj": self.colwise(),
            "attn.g_proj": self.colwise(),
            "attn.gk_proj.0": PrepareModuleWeight(layouts=Replicate()),
            "attn.gk_proj.1": self.colwise(),
            **short_conv_plan(),
            # fla builds one of the two: the fused norm-and-gate when fuse_norm is on, else a plain norm.
            "attn.g_norm_swish_gate": IfPresent(head_norm),
            "attn.g_norm": IfPresent(head_norm),
            "attn.o_proj": self.out_proj(),
        }
