"""fla's own Mamba2 layer (``fla.layers.Mamba2``) for training, on the same kernel contracts as transformers'
(``kernels.transformers_mamba2``, whose math it shares: ``mamba2_mix``).

fla's layer runs mamba_ssm's kernels where they are installed and a naive chunked scan in torch elsewhere; both
are Mamba-2's scalar-decay recurrence, which is fla's simple GLA (``q = C``, ``k = B``, ``v = dt x``, ``g = dt A``,
scale 1). Here the layer calls fla's ``causal_conv1d`` and ``chunk_simple_gla`` by global name, so the kernel paths
(portable off CUDA), CP's state passing and the convolution's halo rebind them, packed documents restart both at
the ``cu_seqlens`` fla's blocks hand their mixer, and under TP each rank runs its heads. Training only: a cache, a
padding mask and attention outputs are refused.
"""

from __future__ import annotations

from fla.modules.causal_conv1d.ops import causal_conv1d
from fla.ops.simple_gla.chunk import chunk_simple_gla

from titan_ext.kernels.transformers_mamba2 import GatedNorm, mamba2_mix


def fla_mamba2_forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                       output_attentions=False, cu_seqlens=None, **kwargs):
    """``fla.layers.Mamba2.forward``: (output, no attentions, the cache as given)."""
    if past_key_values is not None or use_cache or output_attentions or attention_mask is not None or kwargs:
        raise ValueError(f"titan_ext's {type(self).__name__} trains without a cache, padding mask or attention "
                         f"outputs (got use_cache={use_cache}, output_attentions={output_attentions}, "
                         f"attention_mask {'given' if attention_mask is not None else 'None'}, {sorted(kwargs)})")
    norm = GatedNorm(self.norm.eps, before_gate=self.norm.norm_before_gate)
    output = mamba2_mix(self, hidden_states, cu_seqlens, self.dt_limit, norm, causal_conv1d, chunk_simple_gla)
    return output, None, past_key_values
