"""Binding a request's matched tier blocks to the device blocks TensorRT-LLM allocated: the
loads that go into the next metadata.

Called by the leader's ``update_state_after_alloc`` (rank 0 / each attention-DP rank, the
executor thread, under the leader's lock), once per request with a match. The host and disk
blocks become one :class:`~kvbm_plugin.leader.requests.LoadRun` (consecutive op ids from
``ops.next_id``: their copies are made first); each shared-tier block (the plan's tail) one op.
A matched block TensorRT-LLM did not allocate cannot be loaded: it is unpinned (the request
still gets a LoadOp, so its id finishes). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbm_plugin.connector.meta import DISK, HOST, SHARED, LoadCopy, LoadOp, record
from kvbm_plugin.leader.requests import OpTable, RequestState
from kvbm_plugin.leader.shared_tier import TIER_SHARED
from kvbm_plugin.tiers.base import TIER_DISK, TIER_HOST

_TIER_CODE = {TIER_HOST: HOST, TIER_DISK: DISK, TIER_SHARED: SHARED}


def bind_loads(state: RequestState, block_ids: list[int], ops: OpTable,
               unpin: Callable[[str, Any], None],
               load_pages: Callable[[RequestState, int], tuple[int, ...]]) -> LoadOp:
    """The request's LoadOp for ``state.plan`` bound to ``block_ids`` (its ops registered in
    ``ops`` and ``state.loads_inflight``, ``state.host_matched`` set to the leading run of host
    blocks bound); ``unpin(tier, entry)`` releases a block that cannot be loaded,
    ``load_pages`` gives a several-group model's pages of a block. (A loop: building the
    records with ``map`` over ``zip`` measured slower on CPython 3.11, cold and warm.)"""
    copies: list[LoadCopy] = []
    inflight, req_id = state.loads_inflight, state.req_id
    keys = state.keys  # the match's keys: plan block i's entry holds keys[i]
    n_ids = len(block_ids)
    grouped = bool(state.alloc_pages)
    first = ops.next_id
    run_tiers: list[str] = []
    run_entries: list[Any] = []
    shared: list[tuple[int, Any, int]] = []
    host_lo = host_hi = state.plan[0][0]  # the plan's leading run of host blocks bound
    for index, tier, entry in state.plan:
        block = block_ids[index] if index < n_ids else -1
        if block < 0:
            unpin(tier, entry)
            continue
        if tier == TIER_SHARED:
            shared.append((index, entry, block))
            continue
        copies.append(record(LoadCopy, (
            first + len(run_entries), _TIER_CODE[tier], entry.slot, keys[index],
            int(block), None, load_pages(state, index) if grouped else ())))
        run_tiers.append(tier)
        run_entries.append(entry)
        if index == host_hi and tier == TIER_HOST:
            host_hi += 1
    if run_entries:
        inflight.add(ops.new_load_run(req_id, run_tiers, run_entries).first)
    if host_hi > host_lo:
        state.host_matched = (host_lo, host_hi)
    for index, entry, block in shared:
        op_id = ops.new("load", TIER_SHARED, entry.key, req_id, entry)
        inflight.add(op_id)
        copies.append(LoadCopy(op_id, SHARED, entry.slot, entry.key, int(block), entry.digest,
                               load_pages(state, index) if grouped else ()))
    return LoadOp(req_id, tuple(copies))
