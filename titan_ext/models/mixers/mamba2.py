"""Mamba2 mixers: transformers' ``Mamba2Mixer`` and the copies hybrids make of it (Bamba, Granite 4.0 hybrid,
Nemotron-H, Zamba2), known by what they hold and call, whatever the family; and fla's own ``Mamba2`` layer. Both
hold the same parameters and train on the same forward (``kernels.transformers_mamba2.mamba2_mix``)."""

from __future__ import annotations

from model_plans.styles import Composed, GatheredHiddenStates, PlaceParameters

from titan_ext.kernels.state_passing import DiagonalDecay
from titan_ext.models.mixers.base import Mixer, forward_globals, kernel_name

HELD = ("in_proj", "conv1d", "norm", "out_proj", "A_log", "D", "dt_bias")
"""The modules holding parameters and the parameters a Mamba2 mixer holds: nothing else, and no buffer."""
CALLS = ("causal_conv1d_fn", "mamba_chunk_scan_combined")
"""The kernels its forward calls (transformers' hub wrappers, by the kernel they name)."""
GATED_NORM = ("weight", "variance_epsilon", "group_size")
"""``MambaRMSNormGated``'s attributes: gate first, then the root mean square over ``group_size`` channels. Falcon-H1's
norm (``n_groups``, ``norm_before_gate``) and its μP multipliers (``mup_vector``) differ: not this mixer."""


def ssd_flops(heads: int, state: int, head_dim: int, chunk: int = 64) -> int:
    """The chunked scan (fla's simple GLA with key dim ``state`` and value dim ``head_dim``), per token, forward x 3.

    Per head, with chunk C (64, fla's): the in-chunk query-key scores, 2*C*N, applied to the values, 2*C*P;
    reading the chunk's incoming state and adding the chunk to it, 2 * 2*N*P."""
    return 3 * heads * (2 * chunk * (state + head_dim) + 4 * state * head_dim)


def held_parameters(module) -> set[str]:
    """The children holding parameters and the module's own parameters, by name."""
    held = {name for name, child in module.named_children() if next(child.parameters(), None) is not None}
    return held | {name for name, _ in module.named_parameters(recurse=False)}


class Mamba2Heads(Mixer):
    """What Mamba2 mixers share: heads of a scalar-decay scan (state passing under CP, its halo for the
    convolution), split across TP ranks, and their FLOPs."""

    cp_kernels = {"chunk_simple_gla": DiagonalDecay(gate="g")}

    def __init__(self, path="", module=None):
        super().__init__(path, module)
        self.heads, self.groups = getattr(module, "num_heads", None), getattr(module, "n_groups", None)
        self.state, self.head_dim = getattr(module, "ssm_state_size", None), getattr(module, "head_dim", None)

    def tp_entries(self, plan):
        """Heads split across ranks, for the titan_ext forward: ``A_log``, ``D``, ``dt_bias`` and the gated norm's
        weight sharded per head, ``out_proj`` rowwise.

        ``in_proj`` packs z, x, B, C and dt, the ``conv1d`` x, B and C, each part over all heads or groups: a rank's
        rows are a slice of each part, a layout no DTensor placement expresses. Their weights stay replicated over
        the TP ranks (FSDP still shards them); the forward multiplies this rank's rows only, and their gradients
        are summed over the TP ranks. The forward computes the gated norm itself, on this rank's channels. Its
        layer passes the hidden states first or by name (``GatheredHiddenStates``).
        """
        from torch.distributed.tensor import Replicate, Shard

        at = self.path
        return {
            at: Composed(GatheredHiddenStates(plan.activation), PlaceParameters(Shard(0))),  # A_log, D, dt_bias
            f"{at}.in_proj": PlaceParameters(Replicate()),
            f"{at}.conv1d": PlaceParameters(Replicate()),
            f"{at}.norm": PlaceParameters(Shard(0)),
            f"{at}.out_proj": plan.out_proj(),
        }

    def tensor_parallel_blocker(self, degree: int) -> str | None:
        heads, groups = self.heads, self.groups
        if heads % degree or (groups % degree and degree % groups):
            return (f"its {heads} heads in {groups} groups do not split over {degree} ranks (the heads must, and the "
                    "groups split or each be shared by whole ranks); pick a degree that divides them")
        return None

    def flops_per_token(self, config, layer, seq_len):
        return None if self.heads is None else ssd_flops(self.heads, self.state, self.head_dim)


class TransformersMamba2(Mamba2Heads):
    """A module that holds Mamba2's parts (``HELD``), whose forward calls the convolution and the chunked scan
    (``CALLS``), and whose gated norm is ``MambaRMSNormGated``. In titan_ext's training models it runs
    ``kernels.transformers_mamba2``'s forward: fla's ``causal_conv1d`` and ``chunk_simple_gla``, so state passing
    (a scalar decay per head) and the convolution's halo under CP, documents restarting both, and its rank's heads
    under TP."""

    name = "transformers' mamba2"
    recurrent_documents = True

    @classmethod
    def recognizes(cls, module):
        calls = {kernel_name(value) for value in forward_globals(module).values()}
        norm = getattr(module, "norm", None)
        return (set(CALLS) <= calls and held_parameters(module) == set(HELD) and next(module.buffers(), None) is None
                and all(hasattr(norm, attribute) for attribute in GATED_NORM))

    @classmethod
    def near_miss(cls, module):
        """A module calling Mamba2's kernels whose parts differ (Falcon-H1's: μP multipliers in a ``mup_vector``
        buffer, its gated norm optional): what differs, in a few words."""
        if not set(CALLS) <= {kernel_name(value) for value in forward_globals(module).values()}:
            return None
        held, buffers = held_parameters(module), [name for name, _ in module.named_buffers()]
        lacks = set(HELD) - held - {"norm"}
        differences = [f"also holds {', '.join(sorted(held - set(HELD)))}" if held - set(HELD) else "",
                       f"lacks {', '.join(sorted(lacks))}" if lacks else "",
                       f"holds buffers {', '.join(buffers)}" if buffers else ""]
        if not all(hasattr(getattr(module, "norm", None), attribute) for attribute in GATED_NORM):
            differences.append("has no MambaRMSNormGated norm")
        found = "; ".join(d for d in differences if d)
        return f"it calls Mamba2's kernels but {found}: not the Mamba2 math titan_ext computes" if found else None

    def training_forward(self):
        from titan_ext.kernels import transformers_mamba2

        return transformers_mamba2.mamba2_forward


class FlaMamba2(Mamba2Heads):
    """fla's ``Mamba2`` layer with its gated norm (``rmsnorm=True``, fla's default; without it the layer holds no
    norm and stays an unknown mixer). In titan_ext's training models it runs ``kernels.fla_mamba2``'s forward:
    transformers' Mamba2 math on fla's kernels, documents from the ``cu_seqlens`` fla's blocks pass."""

    name = "fla mamba2"
    classes = ("fla.layers.mamba2:Mamba2",)

    @classmethod
    def recognizes(cls, module):
        return super().recognizes(module) and held_parameters(module) == set(HELD)

    def training_forward(self):
        from titan_ext.kernels import fla_mamba2

        return fla_mamba2.fla_mamba2_forward
