"""Pure helpers of the worker's copy bookkeeping: coalescing block copies into runs, and
counting a request's transfers down to terminal. Called by the worker's threads (callers hold
the worker's lock where it says so)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


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
    Callers hold the worker's lock."""
    drained: list[int] = []
    for req_id in req_ids:
        left = inflight.get(req_id, 0) - 1
        if left > 0:
            inflight[req_id] = left
        else:
            inflight.pop(req_id, None)
            drained.append(req_id)
    return drained
