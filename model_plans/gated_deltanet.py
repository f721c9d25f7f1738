"""fla's Gated DeltaNet (``GatedDeltaNetForCausalLM``)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput

from model_plans.base import IfPresent, Plan, TPPlan, short_conv_plan
from model_plans.registry import register_tp_plan
from model_plans.styles import Composed, NormParallel, PlaceParameters


@register_tp_plan("gated_deltanet")
class GatedDeltaNetTPPlan(TPPlan):
    """Heads are split across ranks: q/k/v, the per-value-head gate and beta (a/b) and the output
    gate colwise, o_proj rowwise; the short convolutions and ``A_log``/``dt_bias`` (one per value
    head) are sharded with them. Splitting query/key heads and value heads contiguously keeps each
    value head's query/key head (``i // (num_v_heads // num_heads)``) on its rank.

    The kernels read the sharded conv weights and ``A_log``/``dt_bias`` directly: the model must
    run titan_ext's kernel binding (``titan_ext.kernels``, either path), which hands them local
    shards and keeps fla's fused q/k/v conv (global widths) off under TP. The per-head output norm
    runs on the local heads. The input is gathered in high precision even with Float8: ``a_proj``
    and ``b_proj`` (``num_v_heads`` outputs) are usually too narrow for Float8Linear.
    """

    def attn_plan(self) -> Plan:
        gather = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": self.activation},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        return {
            "attn": Composed(gather, PlaceParameters(Shard(0))),  # its own parameters: A_log, dt_bias
            "attn.q_proj": self.colwise(),
            "attn.k_proj": self.colwise(),
            "attn.v_proj": self.colwise(),
            "attn.a_proj": self.colwise(),
            "attn.b_proj": self.colwise(),
            **short_conv_plan(),
            "attn.g_proj": IfPresent(self.colwise()),  # present with use_gate
            "attn.o_norm": NormParallel(Shard(-2), use_local_output=True),
            "attn.o_proj": self.out_proj(),
        }
