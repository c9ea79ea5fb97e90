"""A report lost on its way from a rank (a connection cut with it in flight, a host out of
reach) must not keep its op for ever: the leader's keeper fails the ops some rank has not
reported within the deadline (``leader/op_completions.py``), so their tier slots, the loads'
pins and the request's state are let go, and the blocks are offloaded again next time."""

from __future__ import annotations

import threading
from typing import Any

from _engines import prompt, tiers
from _kvwire import wait_until

import kvbm_plugin.connector_leader as connector_leader
from kvbm_plugin.connector.meta import CompletionHub
from kvbm_plugin.leader import op_completions

BS = 16


class _Lossy:
    """Drops rank 1's reports handed to any completion hub while ``lose`` is set (kept, to be
    delivered late); counts the op ids of rank 0's, handed in."""

    def __init__(self, monkeypatch: Any) -> None:
        self.lose = threading.Event()
        self.lost: list[tuple[int, list[int], list[bool]]] = []
        self.delivered: set[int] = set()  # rank 0's op ids
        original = CompletionHub.put_batch

        def put_batch(hub: CompletionHub, rank: int, op_ids: list[int], oks: list[bool]) -> None:
            if rank == 1 and self.lose.is_set():
                self.lost.append((rank, list(op_ids), list(oks)))
                return
            original(hub, rank, op_ids, oks)
            if rank == 0:
                self.delivered.update(op_ids)

        monkeypatch.setattr(CompletionHub, "put_batch", put_batch)

    def lost_ids(self) -> set[int]:
        return {op_id for _, op_ids, _ in self.lost for op_id in op_ids}


def test_ops_a_rank_never_reported_are_failed_after_the_deadline(make_engine,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(connector_leader, "SWEEP_PERIOD_S", 0.05)
    lossy = _Lossy(monkeypatch)
    engine = make_engine(num_gpu_blocks=32, tp_size=2, tokens_per_block=BS,
                         env=tiers(host=64))
    leader = engine.leader
    completions = leader._completions  # noqa: SLF001 - its deadline, shortened below
    assert completions.deadline_s == op_completions.REPORT_DEADLINE_S == 600.0
    tokens = prompt(5, 4 * BS + 1)
    lossy.lose.set()
    engine.submit(tokens, 1)
    while engine.active():  # (not run_until_idle: the leader's ops wait for rank 1 for ever)
        engine.step()
    wait_until(lambda: len(lossy.lost_ids()) == 4 and len(lossy.delivered) == 4
               and completions.idle(), 10, "rank 0's reports in, rank 1's lost")
    stats = leader.stats()
    assert stats["saves_scheduled"] == 4 and stats["saves_committed"] == 0
    assert stats["ops_expired"] == 0  # (600 s)
    completions.deadline_s = 0.2
    wait_until(lambda: leader.stats()["ops_expired"] == 4, 10, "the keeper's sweep")
    lossy.lose.clear()
    stats = leader.stats()
    assert stats["saves_committed"] == 0 and stats["saves_failed"] == 4
    with leader._lock:  # noqa: SLF001 - the state the lost reports held
        assert len(leader._tiers.host) == 0  # noqa: SLF001 - no slot left pending
        assert leader._reqs == {}  # noqa: SLF001 - the request is forgotten
    # The lost reports arrive after all: refused, nothing committed.
    for rank, op_ids, oks in lossy.lost:
        leader._hub.put_batch(rank, op_ids, oks)  # noqa: SLF001
    wait_until(lambda: leader.stats()["reports_rejected"] == 4, 10, "the late reports")
    assert leader.stats()["saves_committed"] == 0
    # The same prompt again: offloaded again, now that every rank reports.
    engine.submit(tokens, 1)
    engine.run_until_idle()
    wait_until(lambda: leader.stats()["saves_committed"] == 4, 10, "the offloads")
    with leader._lock:  # noqa: SLF001
        assert len(leader._tiers.host.resident_entries()) == 4  # noqa: SLF001
    assert leader.stats()["ops_expired"] == 4
