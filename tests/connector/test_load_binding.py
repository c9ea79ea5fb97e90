"""The leader's binding of a matched plan to TensorRT-LLM's device blocks
(``leader/load_binding.py``): its C-level fast path makes exactly what the block-by-block
reference makes (the same copies, op ids, LoadRun and host run), and every other case goes to
the reference."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvbm_plugin.leader import load_binding
from kvbm_plugin.leader.load_binding import _bind_each, bind_loads
from kvbm_plugin.leader.requests import OpTable, RequestState
from kvbm_plugin.leader.shared_tier import TIER_SHARED
from kvbm_plugin.tiers.base import TIER_DISK, TIER_HOST


def _state(plan_tiers: list[str], lo: int, alloc_pages: list[list[int]] | None = None,
           ) -> RequestState:
    state = RequestState(7, keys=[1000 + i for i in range(lo + len(plan_tiers))])
    state.plan = [(lo + k, tier, SimpleNamespace(slot=50 + k, key=1000 + lo + k, pins=1,
                                                 digest=b"d" * 16 if tier == TIER_SHARED
                                                 else None))
                  for k, tier in enumerate(plan_tiers)]
    state.alloc_pages = alloc_pages or []
    return state


def _bound(bind, plan_tiers: list[str], lo: int, block_ids: list[int], **kw):
    ops = OpTable()
    ops.new("save", TIER_HOST, 1, None)  # (op ids start past 1: not the first)
    state = _state(plan_tiers, lo, **kw)
    unpinned: list[tuple[str, int]] = []
    load = bind(state, block_ids, ops, lambda tier, e: unpinned.append((tier, e.slot)),
                lambda s, i: (i, -1))
    runs = {op_id: (type(op).__name__, getattr(op, "first", None), getattr(op, "tiers", None))
            for op_id, op in ops.items()}
    return load, sorted(state.loads_inflight), state.host_matched, unpinned, runs


@pytest.mark.parametrize("seed", range(20))
def test_the_fast_path_is_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    lo = rng.randrange(0, 4)
    host = rng.randrange(0, n + 1)  # a leading host run, then disk blocks
    plan_tiers = [TIER_HOST] * host + [TIER_DISK] * (n - host)
    block_ids = [rng.randrange(0, 1000) for _ in range(lo + n + rng.randrange(3))]
    fast = _bound(bind_loads, plan_tiers, lo, block_ids)
    assert fast == _bound(_bind_each, plan_tiers, lo, block_ids)
    assert [c.device_block for c in fast[0].copies] == block_ids[lo:lo + n]
    assert fast[2] == ((lo, lo + host) if host else None)


@pytest.mark.parametrize("case", ["unallocated", "short", "shared", "grouped"])
def test_every_other_case_goes_block_by_block(case: str, monkeypatch) -> None:
    """A block TensorRT-LLM did not allocate (unpinned), fewer ids than the plan, a shared
    tail, several layer groups: the reference binds them (its result, not the fast path's)."""
    calls = []
    reference = load_binding._bind_each

    def counted(*args):
        calls.append(1)
        return reference(*args)

    monkeypatch.setattr(load_binding, "_bind_each", counted)
    tiers, ids, kw = [TIER_HOST, TIER_HOST, TIER_DISK], [5, 6, 7, 8], {}
    if case == "unallocated":
        ids = [5, -1, 7, 8]
    elif case == "short":
        ids = [5, 6]
    elif case == "shared":
        tiers = [TIER_HOST, TIER_SHARED]
    else:
        kw = {"alloc_pages": [[5, 6, 7, 8], [9, 10, 11, 12]]}
    load, inflight, _, unpinned, _ = _bound(bind_loads, tiers, 0, ids, **kw)
    assert calls == [1]
    if case == "unallocated":
        assert unpinned == [(TIER_HOST, 51)] and [c.device_block for c in load.copies] == [5, 7]
    if case == "short":
        assert unpinned == [(TIER_DISK, 52)]
    if case == "shared":
        assert load.copies[-1].digest == b"d" * 16 and len(inflight) == 2
    if case == "grouped":
        assert [c.pages for c in load.copies] == [(0, -1), (1, -1), (2, -1)]
