"""How the workers' reports become tier state: the leader's completed ops.

:class:`OpCompletions` is owned by :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader`
(rank 0, or each attention-DP rank) and called by its hooks and its keeper thread (as the
workers hand reports in, and on idle ticks: ``leader/keeper.py``), under the leader's lock,
through :meth:`OpCompletions.apply`: it drains the completion hub, applies the
intersection rule (an op is done when every rank reported it, failed if any failed it; see
connector/meta.py), and finishes each done op in op-id order: a save or demotion is committed
and its STORE registered (:class:`~kvbm_plugin.leader.offload_tiers.OffloadTiers`), a load's
pin released (or its failure recorded on the request), a write-through handed to the shared
tier. It reads and writes the leader's op table and request states, lent at construction,
and owns nothing else. Never imports torch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import (
    ERR_CORRUPT,
    ERR_FAILED,
    ERR_NONE,
    CompletionHub,
    OpReport,
    ReportBatch,
)
from kvbm_plugin.leader.offload_tiers import RUN_OF_SAVES, OffloadTiers, Write
from kvbm_plugin.leader.requests import LoadRun, Op, OpTable, RequestState, SaveRun, SharedRun
from kvbm_plugin.leader.shared_tier import TIER_SHARED, LeaderSharedTier
from kvbm_plugin.tiers.base import TIER_HOST

# An op that some rank has not reported this long after it was made is failed
# (``OpCompletions.sweep``): a report lost on its way (a connection cut with it in flight, a
# rank's host out of reach) would otherwise keep its tier slot pending, a load's block pinned
# and the request's state for ever. Far beyond what any op may take before its rank reports
# it: a device copy is failed after 60 s (worker/device_copy.py), and a slow disk's or shared
# store's write is reported when it ends; a report arriving after this finds no op
# (``reports_rejected``).
REPORT_DEADLINE_S = 600.0
SWEEP_PERIOD_S = 10.0  # how often the keeper sweeps (a note of the next op id each time)


class OpCompletions:
    """Applies the workers' reports to the leader's ops (see the module docstring)."""

    def __init__(self, *, hub: CompletionHub, ops: OpTable, reqs: dict[int, RequestState],
                 tiers: OffloadTiers, shared: LeaderSharedTier,
                 index_of: Callable[[str], Any], forget: Callable[[RequestState], None],
                 stats: dict[str, int], log: RateLimitedLog, tp_size: int) -> None:
        """``index_of(tier)``: the index holding a plan's ``tier`` blocks (their pins);
        ``forget(state)``: the leader forgets a finished request whose ops are all done."""
        self._hub = hub
        # Whether there is nothing to fold (the hub's queue's own check, no Python frame):
        # the leader's hooks ask it before :meth:`apply`.
        self.idle = hub.empty
        self._ops = ops
        self._reqs = reqs
        self._tiers = tiers
        self._shared = shared
        self._index_of = index_of
        self._forget = forget
        self._stats = stats
        self._log = log
        self._tp_size = tp_size
        self.deadline_s = REPORT_DEADLINE_S
        self._marks: deque[tuple[float, int]] = deque()  # (when, the next op id then): sweep

    def apply(self) -> None:
        """Fold the workers' reports in; an op is final once every rank reported it. Runs
        of saves and demotions are committed together (``OffloadTiers.finish_writes``),
        runs of loads unpinned together; the shared tier's agent is handed its commits
        once at the end."""
        final: list[tuple[int, Op | SaveRun | LoadRun | SharedRun]] = []
        for item in self._hub.take():
            if type(item) is ReportBatch:
                self._fold_batch(item, final)
            elif type(item) is list:
                for report in item:
                    self._fold(report, final)
            else:
                self._fold(item, final)
        self._finish(final)

    def sweep(self, now: float | None = None) -> int:
        """The leader's keeper, every :data:`SWEEP_PERIOD_S`, under the leader's lock: note
        the id the next op gets, and fail the ops made before a note :attr:`deadline_s` old
        that some rank has not reported (:meth:`expire`). O(notes + ops failed); no I/O.
        Returns how many ops were failed."""
        now = time.monotonic() if now is None else now
        marks = self._marks
        marks.append((now, self._ops.next_id))
        below = 0
        while marks and now - marks[0][0] >= self.deadline_s:
            below = marks.popleft()[1]
        return self.expire(below) if below else 0

    def expire(self, below: int) -> int:
        """Fail every op with an id below ``below`` that some rank has not reported: a
        failure is folded in for each rank whose report is missing (those already folded
        stand), and the ops finish as failed ones do: a save's slot freed, not committed, a
        load's pin released. Counted (``ops_expired``) and logged, rate-limited."""
        ops = self._ops
        overdue = []
        for op_id in ops:  # (ids are made in increasing order: the oldest come first)
            if op_id >= below:
                break
            overdue.append(op_id)
        if not overdue:
            return 0
        final: list[tuple[int, Op | SaveRun | LoadRun | SharedRun]] = []
        for op_id in overdue:
            for rank in range(self._tp_size):
                op = ops.get(op_id)
                if op is None:
                    break  # final now (its run's last missing report was just folded)
                if type(op) is Op and rank in op.reports:
                    continue  # (a run's mark ignores a rank's block reported before)
                self._fold(OpReport(op_id, rank, False, ERR_FAILED), final)
        self._finish(final)
        self._stats["ops_expired"] += len(overdue)
        self._log.log(logging.WARNING, "expired", "kvbm_plugin: %d ops that some rank had not "
                      "reported %.0f s after they were made were failed (their tier blocks "
                      "freed, not committed; a report was lost on its way from a rank)",
                      len(overdue), self.deadline_s)
        return len(overdue)

    def _finish(self, final: list[tuple[int, Op | SaveRun | LoadRun | SharedRun]]) -> None:
        """Finish the ops every rank reported, in op-id order (:meth:`apply`)."""
        if not final:
            return  # (most calls: nothing to commit, nothing for the shared tier's agent)
        if len(final) > 1:  # op ids grow along each chain: parents are registered first
            final.sort(key=_op_id)  # (usually in order already: one pass)
        i, n = 0, len(final)
        while i < n:  # runs of loads, runs of writes (saves, demotions, writes-through)
            loads = final[i][1].kind == "load"
            j = i + 1
            while j < n and (final[j][1].kind == "load") == loads:
                j += 1
            if loads:
                self._finish_loads(final[i:j])
            else:
                self._finish_writes(final[i:j])
            i = j
        self._shared.wake_agent()  # once for the shared-tier blocks these reports committed

    def _fold(self, report: OpReport, final: list[tuple[int, Any]]) -> None:
        """One rank's report of one op: a run's block marked (a duplicate counts once), its
        error and signature kept; an op or run every rank reported goes to ``final``."""
        op_id, rank = report.op_id, report.rank
        op = self._ops.get(op_id)
        kind = type(op)
        tp_size = self._tp_size
        if (kind is SaveRun or kind is LoadRun or kind is SharedRun) and 0 <= rank < tp_size:
            k = op_id - op.first
            done = op.mark(rank, 1 << k, tp_size)
            if done < 0:
                return  # a rank's duplicate report counts once (as in Op.reports)
            if not report.ok:
                op.fail(k, report.error)
            if report.signature is not None:
                op.sign(k, rank, report.signature)
            if done:
                self._retire(op, final)
            return
        if op is None or not 0 <= rank < tp_size:
            # A rank outside the group must not count towards "every rank reported" (the
            # block would be advertised before its bytes are on every rank); an unknown op
            # id is a late duplicate or a report meant for another leader.
            self._stats["reports_rejected"] += 1
            self._log.log(logging.WARNING, "report", "kvbm_plugin: completion report for "
                          "op %d from rank %d ignored (%s; tp_size %d)", op_id,
                          rank, "unknown op" if op is None else "rank out of range",
                          tp_size)
            return
        reports = op.reports
        reports[rank] = report
        if not report.ok:
            op.failed = True
        if len(reports) >= tp_size:
            del self._ops[op_id]
            final.append((op_id, op))

    def _fold_batch(self, batch: ReportBatch, final: list[tuple[int, Any]]) -> None:
        """One rank's copy batch: each stretch of consecutive op ids of one run, all ok,
        marked in one step (:meth:`_Run.mark`); anything else (a failure, ids out of order,
        a duplicate, an op that is not a run) folds report by report from there."""
        rank, op_ids, oks = batch.rank, batch.op_ids, batch.oks
        ops, tp_size = self._ops, self._tp_size
        n = len(op_ids)
        i = 0
        while i < n and 0 <= rank < tp_size:
            op_id = op_ids[i]
            op = ops.get(op_id)
            kind = type(op)
            if not (kind is SaveRun or kind is LoadRun or kind is SharedRun):
                break
            k = op_id - op.first
            # The stretch: the most ids from here that continue op_id within the run. A
            # batch's ids ascend (its loads', then its saves', each run's in order), where
            # "op_ids[i + t] == op_id + t" holds for a prefix: bisected, then checked whole.
            lo, hi = 1, min(len(op.entries) - k, n - i)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if op_ids[i + mid - 1] == op_id + mid - 1:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo
            if (m > 1 and op_ids[i:i + m] != list(range(op_id, op_id + m))) \
                    or not all(oks[i:i + m]):
                break
            done = op.mark(rank, ((1 << m) - 1) << k, tp_size)
            if done < 0:
                break  # (some block reported before: each counts once, below)
            if done:
                self._retire(op, final)
            i += m
        for j in range(i, n):  # (bounded: one failed stretch sends the rest this way)
            ok = oks[j]
            self._fold(OpReport(op_ids[j], rank, ok, ERR_NONE if ok else ERR_FAILED), final)

    def _retire(self, run: SaveRun | LoadRun | SharedRun, final: list[tuple[int, Any]]) -> None:
        """Every rank reported every block of ``run``: its ids leave the table, it is final."""
        ops, first = self._ops, run.first
        for op_id in range(first, first + len(run.entries)):
            del ops[op_id]
        final.append((first, run))

    def _finish_writes(self, run: list[tuple[int, Op | SaveRun]]) -> None:
        """A run of saves and demotions, committed and their STOREs registered together;
        then the run's writes through to the shared tier (each names its host copy's block,
        committed by then)."""
        self._tiers.finish_writes(_writes(run))
        for op_id, op in run:
            if type(op) is SharedRun:
                self._shared.run_done(op)
            else:
                self._release(op_id, op)

    def _finish_loads(self, run: list[tuple[int, Op | LoadRun]]) -> None:
        """A run of loads (op-id order): the request's runs from the host and disk tiers
        (:meth:`_finish_load_run`) and the shared tier's loads (:meth:`_finish_load`)."""
        for op_id, op in run:
            if type(op) is LoadRun:
                self._finish_load_run(op)
            else:
                self._finish_load(op_id, op)

    def _finish_load_run(self, run: LoadRun) -> None:
        """Every rank reported every block of ``run``: a block every rank loaded from a
        host or disk block still there is unpinned here, in one pass; any other (failed,
        its block gone) goes through :meth:`_unpin_load`. Then the request lets the run go."""
        host, disk = self._tiers.host, self._tiers.disk
        errors, cancelled, tiers = run.errors, run.cancelled, run.tiers
        entries: Any = run.entries
        todo: Any = range(len(entries))
        if errors is None and not cancelled and host is not None and len(tiers) > 1 \
                and tiers.count(TIER_HOST) == len(tiers):
            # The common run: every block loaded from the host tier, none failed or taken
            # back: unpinned in one index call; only the blocks it missed go the long way.
            todo = host.unpin_live_all(entries)
        for k in todo:
            entry = entries[k]
            if cancelled and k in cancelled:
                continue  # taken back before the metadata left: unpinned then
            failed = errors[k] if errors is not None else 0
            index = host if tiers[k] == TIER_HOST else disk
            if failed or index is None or not index.unpin_live(entry):
                self._unpin_load(tiers[k], entry, run.req_id, not failed,
                                 bool(failed >> ERR_CORRUPT & 1))
        state = self._reqs.get(run.req_id)
        if state is not None:
            state.loads_inflight.discard(run.first)
            if state.finished and not state.saves_inflight and not state.loads_inflight:
                self._forget(state)

    def _finish_load(self, op_id: int, op: Op) -> None:
        """A load from the shared tier, reported by every rank."""
        self._unpin_load(op.tier, op.entry, op.req_id, not op.failed,
                         any(r.error == ERR_CORRUPT for r in op.reports.values()))
        self._release(op_id, op)

    def _unpin_load(self, tier: str, entry: Any, req_id: int | None, ok: bool,
                    corrupt: bool) -> None:
        """Unpin a finished load's block; a failed load is recorded on its request, and a
        corrupt source block is forgotten (with its descendants)."""
        index = self._index_of(tier)
        if entry is not None and entry.pins > 0:
            index.unpin(entry)
        source = entry
        if entry is not None and index is not None and not index.holds(entry):
            source = None  # forgotten meanwhile
        if ok:
            return
        self._stats["loads_failed"] += 1
        state = self._reqs.get(req_id) if req_id is not None else None
        if state is not None:
            self._load_failed(state, entry)
        if tier == TIER_SHARED:
            self._stats["shared_loads_failed"] += 1
        if corrupt:
            self._stats["corrupt_blocks"] += 1
            if source is not None and index is not None:
                self._tiers.drop(index, source)

    def _release(self, op_id: int, op: Op) -> None:
        """Op ``op_id`` of a request is done: the leader forgets a finished request once
        none of its ops is left."""
        state = self._reqs.get(op.req_id) if op.req_id is not None else None
        if state is None:
            return
        (state.loads_inflight if op.kind == "load" else state.saves_inflight).discard(op_id)
        if state.finished and not state.saves_inflight and not state.loads_inflight:
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


def _op_id(item: tuple[int, Any]) -> int:
    return item[0]


def _writes(run: list[tuple[int, Op | SaveRun]]) -> Iterator[Write]:
    """Each block write of ``run`` (saves and demotions, op-id order; a SaveRun's blocks in
    chain order) as ``OffloadTiers.finish_writes`` takes it; the writes-through are not
    among them."""
    for _, op in run:
        if type(op) is SaveRun:
            tier, tainted, errors = op.tier, op.tainted, op.errors
            signatures = op.signatures
            if errors is None and signatures is None and not tainted:
                yield RUN_OF_SAVES, tier, op, True, None, False  # (all at once)
                continue
            for k, entry in enumerate(op.entries):
                yield ("save", tier, entry, errors is None or not errors[k],
                       None if signatures is None else signatures[k], tainted)
        elif type(op) is not SharedRun:
            yield op.kind, op.tier, op.entry, not op.failed, op.signatures(), op.tainted
