"""The consolidator's ingest thread lingers after input (polls every LINGER_MS for
LINGER_ROUNDS quiet rounds) with its wake flag set, so registrations from the leader's
executor thread write no wake byte while batches keep coming; once it sleeps without a timeout,
the next registration wakes it and nothing waits in the queue unapplied."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
from _kvwire import wait_until

from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    load_consolidator_config,
)

BS = 4


@pytest.fixture
def wakes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every wake byte written (``KvEventConsolidator._wake`` calls)."""
    calls: list[int] = []
    original = KvEventConsolidator._wake  # noqa: SLF001

    def counted(self: KvEventConsolidator) -> None:
        calls.append(1)
        original(self)

    monkeypatch.setattr(KvEventConsolidator, "_wake", counted)
    return calls


@pytest.fixture
def consolidator_of() -> Iterator:
    path = tempfile.mkdtemp(prefix="kvl", dir="/tmp")  # ipc paths must stay short
    made: list[KvEventConsolidator] = []

    def make(linger_rounds: int) -> KvEventConsolidator:
        config = load_consolidator_config(
            {EVENTS_ENDPOINT: f"ipc://{path}/ev", OUTPUT_ENDPOINT: f"ipc://{path}/out",
             OUTPUT_REPLAY_ENDPOINT: f"ipc://{path}/outr"}, num_ranks=1)
        consolidator = KvEventConsolidator(config)
        consolidator.LINGER_ROUNDS = linger_rounds
        consolidator.start()
        made.append(consolidator)
        return consolidator

    yield make
    for consolidator in made:
        consolidator.shutdown(5.0)
    shutil.rmtree(path, ignore_errors=True)


def _store(consolidator: KvEventConsolidator, h: int) -> None:
    consolidator.register_store("CPU", 0, h, h - 1 if h > 1 else None, [h] * BS, BS)


def _applied(consolidator: KvEventConsolidator, n: int) -> None:
    wait_until(lambda: consolidator.stats()["registrations"] == n, what=f"{n} registrations")


@pytest.mark.parametrize("linger_rounds", [1_000_000, 0])
def test_registrations_while_the_thread_lingers_write_no_wake_byte(
        consolidator_of, wakes, linger_rounds) -> None:
    consolidator = consolidator_of(linger_rounds)
    _store(consolidator, 1)
    _applied(consolidator, 1)
    if linger_rounds == 0:  # the control: a thread that sleeps at once is woken each time
        wait_until(lambda: not consolidator._wake_pending, what="the thread asleep")  # noqa: SLF001
    before = len(wakes)
    for h in range(2, 40):
        _store(consolidator, h)
        _applied(consolidator, h)
    if linger_rounds:
        assert len(wakes) == before  # lingering: every item was picked up by a poll
    else:
        assert len(wakes) > before


def test_a_registration_after_the_linger_wakes_the_sleeping_thread(consolidator_of) -> None:
    consolidator = consolidator_of(2)
    for h in range(1, 30):
        # Each time only once the thread cleared its flag to sleep without a timeout: the
        # registration must wake it (a lost wake would leave it queued past the deadline).
        wait_until(lambda: not consolidator._wake_pending, what="the thread asleep")  # noqa: SLF001
        _store(consolidator, h)
        _applied(consolidator, h)
