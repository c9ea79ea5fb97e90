"""How the workers' reports become tier state: the leader's completed ops.

:class:`OpCompletions` is owned by :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader`
(rank 0, or each attention-DP rank) and called by its hooks and its idle keeper, under the
leader's lock, through :meth:`OpCompletions.apply`: it drains the completion hub, applies the
intersection rule (an op is done when every rank reported it, failed if any failed it; see
connector/meta.py), and finishes each done op in op-id order: a save or demotion is committed
and its STORE registered (:class:`~kvbm_plugin.leader.offload_tiers.OffloadTiers`), a load's
pin released (or its failure recorded on the request), a write-through handed to the shared
tier. It reads and writes the leader's op table and request states, lent at construction,
and owns nothing else. Never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import ERR_CORRUPT, CompletionHub
from kvbm_plugin.leader.offload_tiers import OffloadTiers
from kvbm_plugin.leader.requests import Op, OpTable, RequestState
from kvbm_plugin.leader.shared_tier import TIER_SHARED, LeaderSharedTier
from kvbm_plugin.tiers.base import TIER_DISK, TIER_HOST

# ops that write a tier (committed in runs)
_WRITES = frozenset(("save", "demote", "shared_save"))


class OpCompletions:
    """Applies the workers' reports to the leader's ops (see the module docstring)."""

    def __init__(self, *, hub: CompletionHub, ops: OpTable, reqs: dict[int, RequestState],
                 tiers: OffloadTiers, shared: LeaderSharedTier,
                 index_of: Callable[[str], Any], forget: Callable[[RequestState], None],
                 stats: dict[str, int], log: RateLimitedLog, tp_size: int) -> None:
        """``index_of(tier)``: the index holding a plan's ``tier`` blocks (their pins);
        ``forget(state)``: the leader forgets a finished request whose ops are all done."""
        self._hub = hub
        self._ops = ops
        self._reqs = reqs
        self._tiers = tiers
        self._shared = shared
        self._index_of = index_of
        self._forget = forget
        self._stats = stats
        self._log = log
        self._tp_size = tp_size

    def apply(self) -> None:
        """Fold the workers' reports in; an op is final once every rank reported it. Runs
        of saves and demotions are committed together (``OffloadTiers.finish_writes``),
        runs of loads unpinned together; the shared tier's agent is handed its commits
        once at the end."""
        final: list[tuple[int, Op]] = []
        tp_size = self._tp_size
        ops = self._ops
        in_order = True  # reports usually arrive in op-id order: then no sort
        last = 0
        for report in self._hub.drain():
            op_id = report.op_id
            op = ops.get(op_id)
            if op is None or not 0 <= report.rank < tp_size:
                # A rank outside the group must not count towards "every rank reported" (the
                # block would be advertised before its bytes are on every rank); an unknown op
                # id is a late duplicate or a report meant for another leader.
                self._stats["reports_rejected"] += 1
                self._log.log(logging.WARNING, "report", "kvbm_plugin: completion report for "
                              "op %d from rank %d ignored (%s; tp_size %d)", op_id,
                              report.rank, "unknown op" if op is None else "rank out of range",
                              tp_size)
                continue
            reports = op.reports
            reports[report.rank] = report
            if len(reports) >= tp_size:
                del ops[op_id]
                final.append((op_id, op))
                in_order = in_order and op_id > last
                last = op_id
        if not in_order:  # op ids grow along each chain: parents are registered first
            final.sort(key=lambda item: item[0])
        i, n = 0, len(final)
        while i < n:
            kind = final[i][1].kind
            if kind == "load":
                j = i + 1
                while j < n and final[j][1].kind == "load":
                    j += 1
                self._finish_loads(final[i:j])
                i = j
                continue
            if kind not in _WRITES:
                self._finalize(*final[i])
                i += 1
                continue
            # A run of saves and demotions: committed, and their STOREs registered, together;
            # then the run's writes through to the shared tier (each names its host copy's
            # block, committed by then).
            j = i + 1
            while j < n and final[j][1].kind in _WRITES:
                j += 1
            run = final[i:j]
            self._tiers.finish_writes([op for _, op in run if op.kind != "shared_save"])
            reqs = self._reqs
            for op_id, op in run:
                if op.kind == "shared_save":
                    self._shared.save_done(op_id, op, all(r.ok for r in op.reports.values()))
                state = reqs.get(op.req_id) if op.req_id is not None else None
                if state is not None:
                    state.saves_inflight.discard(op_id)
                    if state.finished and not state.saves_inflight and not state.loads_inflight:
                        self._forget(state)
            i = j
        self._shared.wake_agent()  # once for the shared-tier blocks these reports committed

    def _finish_loads(self, run: list[tuple[int, Op]]) -> None:
        """:meth:`_finalize` of a run of loads (op-id order): a load every rank did from a
        host or disk block still there is unpinned here, in one pass; any other load (failed,
        from the shared tier, its block gone) goes through :meth:`_finalize`."""
        reqs, host, disk = self._reqs, self._tiers.host, self._tiers.disk
        for op_id, op in run:
            reports = op.reports
            if len(reports) == 1:
                ok = next(iter(reports.values())).ok
            else:
                ok = all(r.ok for r in reports.values())
            index = host if op.tier == TIER_HOST else disk if op.tier == TIER_DISK else None
            entry = op.entry
            if not ok or index is None or entry is None or not index.holds(entry) \
                    or entry.pins <= 0:
                self._finalize(op_id, op)
                continue
            index.unpin(entry)
            state = reqs.get(op.req_id) if op.req_id is not None else None
            if state is not None:
                state.loads_inflight.discard(op_id)
                if state.finished and not state.saves_inflight and not state.loads_inflight:
                    self._forget(state)

    def _finalize(self, op_id: int, op: Op) -> None:
        reports = op.reports
        if len(reports) == 1:
            ok = next(iter(reports.values())).ok
        else:
            ok = all(r.ok for r in reports.values())
        index = self._index_of(op.tier)
        state = self._reqs.get(op.req_id) if op.req_id is not None else None
        if op.kind == "shared_save":
            self._shared.save_done(op_id, op, ok)
        elif op.kind in ("save", "demote"):
            self._tiers.finish_write(op, ok)
            if state is not None:
                state.saves_inflight.discard(op_id)
        else:  # load: unpin; a corrupt source block is forgotten (with its descendants)
            entry = op.entry
            if entry is not None and entry.pins > 0:
                index.unpin(entry)  # type: ignore[union-attr]
            if entry is not None and index is not None and not index.holds(entry):
                entry = None  # forgotten meanwhile
            if not ok:
                self._stats["loads_failed"] += 1
                if state is not None:
                    self._load_failed(state, op.entry)
                if op.tier == TIER_SHARED:
                    self._stats["shared_loads_failed"] += 1
                if any(r.error == ERR_CORRUPT for r in op.reports.values()):
                    self._stats["corrupt_blocks"] += 1
                    if entry is not None and index is not None:
                        self._tiers.drop(index, entry)
            if state is not None:
                state.loads_inflight.discard(op_id)
        if state is not None and state.finished and not state.saves_inflight \
                and not state.loads_inflight:
            self._forget(state)

    def _load_failed(self, state: RequestState, entry: Any) -> None:
        """A load of ``state`` failed. Where TensorRT-LLM recomputes it (load errors) the first
        report's position is the truth, so the tokens the load promised are forgotten. Where it
        does not, the request computes on the unfilled block, and nothing of it from that block
        on may be offloaded: a well-formed tier copy of wrong KV would pass every later check.
        Told apart at the first report (:meth:`OffloadPlanner.absorb`); already reported:
        stop at once."""
        state.match_base = None
        index = next((i for i, _, e in state.plan if e is entry), None)
        if index is None:
            return
        if state.reported:
            stop = state.offload_stop
            state.offload_stop = index if stop is None else min(index, stop)
        elif state.load_failed_at is None or index < state.load_failed_at:
            state.load_failed_at = index
