"""fla's softmax-attention ``TransformerForCausalLM``."""

from __future__ import annotations

from torch.distributed.tensor import Shard

from model_plans.base import IfPresent, Plan, TPPlan
from model_plans.registry import register_tp_plan
from model_plans.styles import NormParallel


@register_tp_plan("transformer")
class TransformerTPPlan(TPPlan):
    """Heads split across ranks; the optional q/k norms run per local head."""

    def attn_plan(self) -> Plan:
        return {
            **self.gather("attn", kwarg="hidden_states"),
            "attn.q_proj": self.colwise(),
            "attn.k_proj": self.colwise(),
            "attn.v_proj": self.colwise(),
            # present with qk_norm only
            "attn.q_norm": IfPresent(NormParallel(Shard(-2), use_local_output=True)),
            "attn.k_norm": IfPresent(NormParallel(Shard(-2), use_local_output=True)),
            "attn.o_proj": self.out_proj(),
        }
