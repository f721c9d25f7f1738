"""fla's per-layer cache helpers, without a guard on the layer's index under compile.

fla's ``get_layer_cache`` and ``update_layer_cache`` read ``module.layer_idx``
on every call, to check it against a cache that training never passes.
torch 2.11's dynamo guards on that integer's value (torch 2.13's does not), so
each per-block compile matched only its own block: one recompile per block,
and past the recompile limit the remaining blocks ran eager. Without a cache
these return what fla's would (None) without reading the index.
"""

from fla.layers.utils import get_layer_cache as _fla_get_layer_cache
from fla.layers.utils import update_layer_cache as _fla_update_layer_cache

from titan_ext.kernels.table import Kernel


def get_layer_cache(module, past_key_values):
    if past_key_values is None:
        return None
    return _fla_get_layer_cache(module, past_key_values)


def update_layer_cache(module, past_key_values, **kwargs):
    if past_key_values is None:
        return None
    return _fla_update_layer_cache(module, past_key_values, **kwargs)


LAYER_IDX = (
    "reads module.layer_idx even without a cache; torch 2.11's dynamo guards on its value, so per-block compile "
    "recompiled for every block (torch 2.13 does not guard it)"
)

KERNELS = (
    Kernel("fla.layers.utils:get_layer_cache", get_layer_cache, LAYER_IDX, ("portable", "fla")),
    Kernel("fla.layers.utils:update_layer_cache", update_layer_cache, LAYER_IDX, ("portable", "fla")),
)
"""What titan_ext's models call instead of fla's functions (``kernels.replacements``)."""

SIGNATURES = {
    "fla.layers.utils:get_layer_cache": "module, past_key_values",
    "fla.layers.utils:update_layer_cache": "module, past_key_values, **kwargs",
}
"""Parameters (``name=default``) of the functions replaced or called by keyword, as written against them
(``host.checks.check_fla_signatures``)."""
