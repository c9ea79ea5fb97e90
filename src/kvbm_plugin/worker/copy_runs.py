"""Pure helpers of the worker's copy bookkeeping: coalescing block copies into runs, and
counting a request's transfers down to terminal. Called by the worker's threads (callers hold
``RequestProgress``'s lock where it says so)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

_T = TypeVar("_T")


def runs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce (src, dst) index pairs into runs ``(src0, dst0, n)`` where both advance by 1."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs, key=lambda p: p[1]):
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def count_down(inflight: dict[int, int], req_ids: Sequence[int]) -> list[int]:
    """One terminal op per id in ``req_ids``; returns the ids with none left in flight.
    Callers hold the lock of the dict's owner (``RequestProgress``)."""
    drained: list[int] = []
    for req_id in req_ids:
        left = inflight.get(req_id, 0) - 1
        if left > 0:
            inflight[req_id] = left
        else:
            inflight.pop(req_id, None)
            drained.append(req_id)
    return drained


def chunked(items: Sequence[_T], batch: int) -> Iterator[Sequence[_T]]:
    """A job's host copies in batches of ``batch`` blocks (0: one batch)."""
    step = batch or len(items) or 1  # no items: no batch (and no 0 step)
    for start in range(0, len(items), step):
        yield items[start:start + step]
