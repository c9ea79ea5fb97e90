"""The checks of the block hashes a tier registers with the consolidator: each a signed or
unsigned 64-bit ``int`` (a bool, a float or anything else is refused), raised on the caller's
thread before anything of the call is queued. Called by ``KvEventConsolidator``'s
``register_*`` methods on whichever thread registers (the leader's executor thread for its
tiers); pure functions, no state.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

_first, _second = operator.itemgetter(0), operator.itemgetter(1)
_NONE = type(None)


def all_hashes(stores: Sequence[Sequence[Any]]) -> bool:
    """Whether the block hash and the parent hash (None allowed) of every store of
    ``stores`` (``register_stores``' tuples) pass :func:`check_hash`, in C-level passes (the
    set of types, min, max): a run of blocks is checked without a Python call per hash.
    False says only that :func:`check_hash` of each must name the bad one."""
    hashes, parents = list(map(_first, stores)), list(map(_second, stores))
    if set(map(type, hashes)) != {int}:
        return False
    kinds = set(map(type, parents))
    kinds.discard(_NONE)
    if kinds - {int}:
        return False
    # (filter(None): the None parents out, and 0s, which are in range anyway)
    values = hashes + list(filter(None, parents))
    return min(values) >= -(1 << 63) and max(values) < (1 << 64)


def check_hash(value: int) -> None:
    if type(value) is not int or not -(1 << 63) <= value < (1 << 64):
        raise ValueError(f"block hash {value!r} is not a signed or unsigned 64-bit integer")
