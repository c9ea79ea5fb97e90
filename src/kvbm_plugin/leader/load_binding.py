"""Binding a request's matched tier blocks to the device blocks TensorRT-LLM allocated: the
loads that go into the next metadata; and taking them back before that metadata leaves: a
range the runtime will not consume (:func:`unbind_range`, the leader's ``cancel_load``), or all
of a request TensorRT-LLM terminated (:func:`unbind_all`); same thread and lock.

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
from kvbm_plugin.leader.requests import LoadRun, OpTable, RequestState
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


def unbind_range(state: RequestState, start: int, end: int, block_size: int, ops: OpTable,
                 pending_loads: list[LoadOp], unpin: Callable[[str, Any], None], tp_size: int,
                 stats: dict[str, int]) -> None:
    """Take tokens ``[start, end)`` of the request's offer back (the leader's ``cancel_load``:
    TensorRT-LLM's KVCacheManagerV2 will not consume them). Every matched block overlapping
    the range leaves ``state.plan`` and is unpinned; where the request's LoadOp still waits in
    ``pending_loads`` (not yet in metadata), its copies of those blocks leave it and their ops
    leave ``ops`` (a block of a LoadRun is marked cancelled and counts as reported by every
    rank; the run's ids leave where that completes it). A LoadOp already handed to the
    workers cannot be taken back: it completes and the runtime recomputes those tokens
    (``cancels_too_late`` counted in ``stats``). ``state.match_base`` becomes the end of what
    is left."""

    def dropped(index: int) -> bool:
        return index * block_size < end and (index + 1) * block_size > start

    if state.load is not None:
        if state.load not in pending_loads:
            if any(dropped(i) for i, _, _ in state.plan):
                stats["cancels_too_late"] += 1
            return
        keep_ops = set()
        for index, tier, entry in state.plan:
            copy_op = next((c.op_id for c in state.load.copies if c.key == entry.key), None)
            if not dropped(index):
                if copy_op is not None:
                    keep_ops.add(copy_op)
                continue
            if copy_op is not None:  # its pin is released when the op would have been
                op = ops.get(copy_op)
                if type(op) is LoadRun:  # one block of the run: never reported now
                    op.cancelled.add(copy_op - op.first)
                    # (its ids stay mapped while any block is left)
                    if op.take_back(copy_op - op.first, tp_size):
                        for op_id in range(op.first, op.first + len(op.entries)):
                            del ops[op_id]
                        state.loads_inflight.discard(op.first)
                else:
                    ops.pop(copy_op, None)
                    state.loads_inflight.discard(copy_op)
                unpin(tier, entry)
        load = LoadOp(state.req_id, tuple(c for c in state.load.copies
                                           if c.op_id in keep_ops))
        pending_loads[pending_loads.index(state.load)] = load
        state.load = load
    else:
        for index, tier, entry in state.plan:
            if dropped(index):
                unpin(tier, entry)
    kept = [item for item in state.plan if not dropped(item[0])]
    stats["cancelled_tokens"] += (len(state.plan) - len(kept)) * block_size
    state.plan = kept
    # The first report subtracts only what the runtime counted as loaded.
    state.match_base = (kept[-1][0] + 1) * block_size if kept else None


def unbind_all(state: RequestState, ops: OpTable, pending_loads: list[LoadOp],
               unpin: Callable[[str, Any], None]) -> None:
    """Take every block of the request's LoadOp back while it still waits in ``pending_loads``
    (bound, never sent: the leader's handling of a request TensorRT-LLM terminated): its ops
    leave ``ops`` and their blocks are unpinned (a LoadRun's blocks cancelled before were
    unpinned then); the LoadOp stays, with no copy, so its id still finishes on every rank."""
    for op_id in list(state.loads_inflight):
        op = ops.pop(op_id, None)
        if type(op) is LoadRun:
            for k, entry in enumerate(op.entries):
                ops.pop(op.first + k, None)
                if k not in op.cancelled:
                    unpin(op.tiers[k], entry)
        elif op is not None and op.entry is not None:
            unpin(op.tier, op.entry)
    state.loads_inflight.clear()
    i = pending_loads.index(state.load)
    pending_loads[i] = state.load = LoadOp(state.req_id, ())
