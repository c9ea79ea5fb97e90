"""The leader's binding of a matched plan to TensorRT-LLM's device blocks
(``leader/load_binding.py``): the copies, op ids and runs it makes, the leading host run it
notes, and the blocks it cannot load (unpinned, the request's LoadOp still made)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbm_plugin.connector.meta import DISK, HOST, SHARED, LoadCopy
from kvbm_plugin.leader.load_binding import bind_loads
from kvbm_plugin.leader.requests import LoadRun, Op, OpTable, RequestState
from kvbm_plugin.leader.shared_tier import TIER_SHARED
from kvbm_plugin.tiers.base import TIER_DISK, TIER_HOST


def _bound(plan_tiers: list[str], lo: int, block_ids: list[int],
           alloc_pages: list[list[int]] | None = None):
    ops = OpTable()
    ops.new("save", TIER_HOST, 1, None)  # op 1: the binding's ids start at 2
    state = RequestState(7, keys=[1000 + i for i in range(lo + len(plan_tiers))])
    state.plan = [(lo + k, tier, SimpleNamespace(slot=50 + k, key=1000 + lo + k, pins=1,
                                                 digest=b"d" * 16))
                  for k, tier in enumerate(plan_tiers)]
    state.alloc_pages = alloc_pages or []
    unpinned: list[tuple[str, int]] = []
    load = bind_loads(state, block_ids, ops, lambda tier, e: unpinned.append((tier, e.slot)),
                      lambda s, i: (i, -1))
    return load, state, ops, unpinned


def test_host_and_disk_blocks_are_one_run_with_consecutive_op_ids() -> None:
    load, state, ops, unpinned = _bound([TIER_HOST, TIER_HOST, TIER_DISK], 2,
                                        [9, 9, 20, 21, 22, 9])
    assert load.req_id == 7 and unpinned == []
    assert load.copies == (LoadCopy(2, HOST, 50, 1002, 20, None, ()),
                           LoadCopy(3, HOST, 51, 1003, 21, None, ()),
                           LoadCopy(4, DISK, 52, 1004, 22, None, ()))
    run = ops[2]
    assert type(run) is LoadRun and run.first == 2 and run.tiers == [TIER_HOST, TIER_HOST,
                                                                      TIER_DISK]
    assert state.loads_inflight == {2} and ops.next_id == 5
    assert state.host_matched == (2, 4)  # the leading host run, for the offload planner


def test_a_plan_that_starts_on_disk_notes_no_host_run() -> None:
    _, state, _, _ = _bound([TIER_DISK, TIER_HOST], 0, [5, 6])
    assert state.host_matched is None


@pytest.mark.parametrize("ids", [[5, -1, 7], [5, 6]])
def test_a_block_not_allocated_is_unpinned_and_the_rest_still_load(ids: list[int]) -> None:
    """A -1 device block, or fewer ids than the plan: that block cannot be loaded."""
    load, state, _, unpinned = _bound([TIER_HOST, TIER_HOST, TIER_DISK], 0, ids)
    lost = 1 if -1 in ids else 2
    assert unpinned == [([TIER_HOST, TIER_HOST, TIER_DISK][lost], 50 + lost)]
    assert [c.device_block for c in load.copies] == [b for b in ids if b >= 0][:2]
    assert [c.op_id for c in load.copies] == [2, 3]  # consecutive: the run's ids
    assert state.host_matched == ((0, 1) if lost == 1 else (0, 2))


def test_shared_blocks_are_one_op_each_after_the_run() -> None:
    load, state, ops, _ = _bound([TIER_HOST, TIER_SHARED, TIER_SHARED], 0, [5, 6, 7])
    assert [(c.op_id, c.tier, c.device_block, c.digest) for c in load.copies] == [
        (2, HOST, 5, None), (3, SHARED, 6, b"d" * 16), (4, SHARED, 7, b"d" * 16)]
    assert type(ops[3]) is Op and ops[3].kind == "load" and ops[3].tier == TIER_SHARED
    assert state.loads_inflight == {2, 3, 4}


def test_several_layer_groups_carry_every_groups_pages() -> None:
    load, *_ = _bound([TIER_HOST, TIER_DISK], 0, [5, 6], alloc_pages=[[5, 6], [9, 10]])
    assert [c.pages for c in load.copies] == [(0, -1), (1, -1)]


def test_nothing_allocated_still_makes_the_requests_load_op() -> None:
    load, state, ops, unpinned = _bound([TIER_HOST], 0, [])
    assert load.copies == () and unpinned == [(TIER_HOST, 50)]
    assert state.loads_inflight == set() and ops.next_id == 2
