"""What the portable kernels share to take fla's signature whole: fla's own checks, and one-line refusals.

Each portable kernel lists fla 0.6.0's parameters, names and defaults, in fla's order; where fla's function
has ``**kwargs``, the replacement lists instead, as keyword-only parameters, the keys fla's body reads from
them (``transpose_state_layout``, ``head_first``, ``chunk_size``, ``A_log``, ...). A key fla reads only by
its presence (``'head_first' in kwargs``) defaults to ``ABSENT``. Nothing is swallowed: an argument a
portable kernel does not honour is refused in one line (``refuse``), and a key fla's body never reads is
a ``TypeError`` (no ``**kwargs``). ``tests/test_kernel_signatures.py`` compares every replacement's
parameters with fla's, the keys read from ``**kwargs`` taken from fla's source.
"""

from __future__ import annotations

import warnings
from typing import NoReturn

from titan_ext.kernels.varlen import check_packed_batch


class _Absent:
    """The default of a keyword fla reads only when it is passed (``'name' in kwargs``)."""

    def __repr__(self) -> str:
        return "ABSENT"

    def __reduce__(self):
        return "ABSENT"


ABSENT = _Absent()


def refuse(kernel: str, argument: str, fix: str = "") -> NoReturn:
    """One line: ``kernel`` does not honour ``argument`` off CUDA (and what to do instead)."""
    raise ValueError(f"{kernel} does not support {argument} off CUDA" + (f"; {fix}" if fix else ""))


def state_v_first(state_v_first: bool, transpose_state_layout) -> bool:
    """fla 0.6's deprecated ``transpose_state_layout``, read as fla reads it: an alias of ``state_v_first``
    (with fla's warning), refused together with ``state_v_first=True``."""
    if transpose_state_layout is ABSENT:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return transpose_state_layout


def no_head_first(head_first) -> None:
    """fla 0.6 removed ``head_first`` and raises when it is passed at all (its own exception type)."""
    if head_first is not ABSENT:
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")


def check_chunk_size(kernel: str, chunk_size, allowed: tuple[int, ...]) -> None:
    """fla's refusal of a chunk size its kernel does not tile (the math does not depend on it)."""
    if chunk_size not in allowed:
        sizes = ", ".join(map(str, allowed[:-1])) + f" or {allowed[-1]}" if len(allowed) > 1 else str(allowed[0])
        raise ValueError(f"`chunk_size` must be {sizes} for {kernel}, got {chunk_size}.")


def check_varlen(q, initial_state, cu_seqlens) -> None:
    """fla's checks of packed sequences: one row, one initial state per sequence."""
    if cu_seqlens is None:
        return
    check_packed_batch(q.shape[0])
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError("The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")


def check_neg_eigval(allow_neg_eigval: bool, use_beta_sigmoid_in_kernel: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")
