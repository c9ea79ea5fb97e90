"""The leader's fold of the workers' reports: a rank's copy batch (``ReportBatch``) is folded a
stretch of one run at a time, and must end exactly where folding its reports one by one ends,
whatever the batch holds (other runs, single ops, failures, duplicates, ids out of order,
unknown ids, a rank out of range)."""

from __future__ import annotations

import logging
import random

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import (
    ERR_CORRUPT,
    ERR_FAILED,
    ERR_NONE,
    CompletionHub,
    OpReport,
    ReportBatch,
)
from kvbm_plugin.leader.op_completions import OpCompletions
from kvbm_plugin.leader.requests import LoadRun, OpTable, SaveRun

TP = 2


def _completions(ops: OpTable) -> tuple[OpCompletions, dict[str, int]]:
    stats = {"reports_rejected": 0}
    return OpCompletions(hub=CompletionHub("fold"), ops=ops, reqs={}, tiers=None,  # type: ignore[arg-type]
                         shared=None, index_of=lambda tier: None,  # type: ignore[arg-type]
                         forget=lambda state: None, stats=stats,
                         log=RateLimitedLog(logging.getLogger("test.fold")), tp_size=TP), stats


def _table(sizes: list[int]) -> OpTable:
    """Runs of ``sizes`` blocks, saves and loads alternating, with a plain op between two."""
    ops = OpTable()
    for n, size in enumerate(sizes):
        if n % 2:
            ops.new_load_run(n, ["host"] * size, [object() for _ in range(size)])
        else:
            ops.new_run("host", n, [object() for _ in range(size)])
        if n == 1:
            ops.new("demote", "disk", 0xD, None, object())
    return ops


def _state(ops: OpTable, final: list, stats: dict) -> tuple:
    runs = {id(op): op for op in ops.values()}
    return (sorted(ops), [(first, type(op).__name__, op.errors, op.seen, op.done_ranks)
                          if hasattr(op, "seen") else (first, op.kind, op.failed)
                          for first, op in final],
            sorted((op.first, op.errors, op.seen, op.done_ranks) for op in runs.values()
                   if hasattr(op, "seen")), dict(stats))


def test_a_batch_folds_as_its_reports_one_by_one() -> None:
    rng = random.Random(7)
    sizes = [5, 3, 64, 1, 7, 2]
    total = sum(sizes) + 1
    for _ in range(300):
        batches = []
        for rank in list(range(TP)) + [TP]:  # (rank TP is out of range: every report refused)
            ids = list(range(1, total + 1))
            if rng.random() < 0.5:
                ids = [i for i in ids if rng.random() < 0.8]  # some not reported yet
            if rng.random() < 0.3:
                ids += rng.sample(ids, min(3, len(ids)))  # duplicates
            if rng.random() < 0.3:
                rng.shuffle(ids)
            if rng.random() < 0.2:
                ids.append(total + 5)  # no such op
            oks = [rng.random() > 0.05 for _ in ids]
            batches.append(ReportBatch(rank, ids, oks))
        rng.shuffle(batches)
        one_by_one, stats_a = _completions(ops_a := _table(sizes))
        batched, stats_b = _completions(ops_b := _table(sizes))
        final_a: list = []
        final_b: list = []
        for batch in batches:
            for report in batch.reports():
                one_by_one._fold(report, final_a)  # noqa: SLF001
            batched._fold_batch(batch, final_b)  # noqa: SLF001
        assert _state(ops_b, final_b, stats_b) == _state(ops_a, final_a, stats_a)


def test_a_run_is_final_once_every_rank_reported_every_block() -> None:
    ops = _table([4, 3])
    completions, _ = _completions(ops)
    final: list = []
    save_ids, load_ids = [1, 2, 3, 4], [5, 6, 7]
    completions._fold_batch(ReportBatch(0, save_ids + load_ids, [True] * 7), final)  # noqa: SLF001
    assert final == [] and len(ops) == 8  # rank 1 has reported nothing
    completions._fold_batch(ReportBatch(1, save_ids[:3], [True, False, True]), final)  # noqa: SLF001
    assert final == []
    completions._fold(OpReport(4, 1, True), final)  # noqa: SLF001
    (first, run), = final
    assert first == 1 and type(run) is SaveRun
    assert run.errors == [0, 1 << ERR_FAILED, 0, 0]  # rank 1 failed block 1
    completions._fold(OpReport(6, 1, False, ERR_CORRUPT), final)  # noqa: SLF001
    completions._fold(OpReport(6, 1, True), final)  # a duplicate: counted once  # noqa: SLF001
    completions._fold_batch(ReportBatch(1, [5, 7], [True, True]), final)  # noqa: SLF001
    assert [type(op) for _, op in final] == [SaveRun, LoadRun]
    assert final[1][1].errors == [0, 1 << ERR_CORRUPT, 0]
    assert list(ops) == [8]  # only the plain op is left


def test_a_run_taken_back_block_by_block_ends_when_the_rest_is_reported() -> None:
    ops = _table([1, 3])
    run = ops[2]
    assert type(run) is LoadRun
    assert not run.take_back(1, TP)
    final: list = []
    completions, _ = _completions(ops)
    completions._fold_batch(ReportBatch(0, [2, 4], [True, True]), final)  # noqa: SLF001
    completions._fold_batch(ReportBatch(1, [2], [True]), final)  # noqa: SLF001
    assert final == []
    assert run.take_back(2, TP)  # block 2 was never reported by rank 1: now done


def test_the_hub_hands_a_uniform_batch_over_as_one_item_per_rank() -> None:
    hub = CompletionHub("fold-hub")
    hub.put_many([OpReport(1, 0, True), OpReport(2, 1, True), OpReport(3, 0, False, ERR_FAILED)])
    hub.put_many([OpReport(4, 0, True), OpReport(5, 0, False, ERR_CORRUPT)])  # not uniform
    hub.put_many([OpReport(6, 0, True, ERR_NONE, (1, 2))])  # a signature
    hub.put_batch(1, [7, 8], [True, False])
    items = hub.take()
    assert items[:2] == [ReportBatch(0, [1, 3], [True, False]), ReportBatch(1, [2], [True])]
    assert isinstance(items[2], list) and isinstance(items[3], list)
    assert items[4] == ReportBatch(1, [7, 8], [True, False])
    hub.put_batch(1, [7, 8], [True, False])
    assert hub.drain() == [OpReport(7, 1, True), OpReport(8, 1, False, ERR_FAILED)]


class _Writes:
    """The tiers' side of finishing writes, recorded (host and disk absent)."""

    host = disk = None

    def __init__(self) -> None:
        self.writes: list[tuple] = []

    def finish_writes(self, writes) -> None:  # noqa: ANN001
        self.writes.extend(writes)


def test_an_op_some_rank_never_reported_is_failed_once_its_deadline_passed() -> None:
    """The keeper's sweep notes the next op id each time; ops made before a note the deadline
    old that some rank has not reported are failed: a rank's report already folded stands,
    the missing ones count as failures, and the run finishes as a failed one does (its
    blocks not committed). Ops younger than that are left alone."""
    ops = OpTable()
    old_run = ops.new_run("host", 1, [object() for _ in range(3)])  # ids 1..3
    old_op = ops[ops.new("demote", "disk", 0xD, None, object())]  # id 4
    tiers = _Writes()
    stats = {"reports_rejected": 0, "ops_expired": 0}
    completions = OpCompletions(
        hub=CompletionHub("expire"), ops=ops, reqs={}, tiers=tiers,  # type: ignore[arg-type]
        shared=type("Shared", (), {"wake_agent": lambda self: None})(),  # type: ignore[arg-type]
        index_of=lambda tier: None, forget=lambda state: None, stats=stats,
        log=RateLimitedLog(logging.getLogger("test.expire")), tp_size=TP)
    deadline = completions.deadline_s
    final: list = []
    completions._fold_batch(ReportBatch(0, [1, 2, 3, 4], [True] * 4), final)  # noqa: SLF001
    completions._fold(OpReport(2, 1, True), final)  # rank 1 reported block 1 only  # noqa: SLF001
    assert final == []
    assert completions.sweep(now=0.0) == 0  # notes id 5: ops 1..4 were made before it
    young = ops.new_run("host", 2, [object()])  # id 5, after that note
    assert completions.sweep(now=deadline / 2) == 0
    assert completions.sweep(now=deadline - 0.001) == 0  # not yet the deadline
    assert stats["ops_expired"] == 0 and tiers.writes == []
    assert completions.sweep(now=deadline) == 4  # the note of time 0: ids below 5
    assert stats["ops_expired"] == 4
    assert list(ops) == [5]  # the young run is left
    # Rank 1's missing reports failed blocks 0 and 2; block 1 stands as every rank did it.
    assert old_run.errors == [1 << ERR_FAILED, 0, 1 << ERR_FAILED]
    assert old_op.failed and old_op.reports[0].ok and not old_op.reports[1].ok
    assert [w[2] for w in tiers.writes] == [old_run.entries[0], old_run.entries[1],
                                            old_run.entries[2], old_op.entry]
    assert [w[3] for w in tiers.writes] == [False, True, False, False]  # committed or not
    # A lost report arriving after all finds no op: refused, nothing committed again.
    completions._fold(OpReport(1, 1, True), final)  # noqa: SLF001
    assert stats["reports_rejected"] == 1 and final == []
    assert completions.sweep(now=deadline / 2 + deadline) == 1  # the note after id 5
    assert young.errors == [1 << ERR_FAILED] and list(ops) == []
