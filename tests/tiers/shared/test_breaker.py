"""GuardedStore's circuit breaker on a scripted store and a manual clock: when it opens, what it
answers while open, when it probes, when it closes, and what it counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvbm_plugin.tiers.shared.breaker import GuardedStore
from kvbm_plugin.tiers.shared.store import FAILED, FULL, MISSING, OK, UNAVAILABLE, SharedStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Scripted(SharedStore):
    """Answers every key with ``code``; each call advances the clock by ``cost``."""

    name = "scripted"

    def __init__(self, clock: Clock) -> None:  # noqa: D107 - a test double
        self.clock = clock
        self.code = OK
        self.cost = 0.0
        self.problem: str | None = None
        self.calls = 0
        self.health_calls = 0
        self.raises = False

    def _answer(self, keys: Sequence[str]) -> list[int]:
        self.calls += 1
        self.clock.now += self.cost
        if self.raises:
            raise RuntimeError("boom")
        return [self.code] * len(keys)

    def exists(self, keys: Sequence[str]) -> list[int]:
        return [1 if c == OK else c for c in self._answer(keys)]

    def put(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        return self._answer(keys)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        return [64 if c == OK else c for c in self._answer(keys)]

    def health(self) -> str | None:
        self.health_calls += 1
        return self.problem

    def stats(self) -> dict[str, int]:
        return {"inner": 7}


@pytest.fixture
def rig() -> tuple[Clock, Scripted, GuardedStore]:
    clock = Clock()
    inner = Scripted(clock)
    return clock, inner, GuardedStore(inner, threshold=3, slow_call_s=1.0, backoff_s=0.5,
                                      max_backoff_s=4.0, clock=clock)


def test_consecutive_unavailable_calls_open_it(rig: Any) -> None:
    clock, inner, guarded = rig
    inner.code = UNAVAILABLE
    for _ in range(3):
        assert guarded.exists(["a", "b"]) == [UNAVAILABLE] * 2
    assert not guarded.available and inner.calls == 3
    for _ in range(5):  # open: answered at once, the store is not called
        assert guarded.put(["a"], [(0, 1)]) == [UNAVAILABLE]
    assert inner.calls == 3 and inner.health_calls == 0
    stats = guarded.stats()
    assert stats["opened"] == 1 and stats["short_circuited"] == 5
    assert stats["exists_unavailable"] == 6 and stats["put_unavailable"] == 5
    assert stats["store_inner"] == 7 and stats["open"] == 1
    assert "3 calls in a row" in guarded.reason
    assert guarded.health().startswith("circuit open")


def test_other_results_reset_the_count(rig: Any) -> None:
    clock, inner, guarded = rig
    for code in (UNAVAILABLE, UNAVAILABLE, MISSING, UNAVAILABLE, UNAVAILABLE, FULL, FAILED):
        inner.code = code
        guarded.get_into(["a"], [(0, 64)])
    assert guarded.available
    stats = guarded.stats()
    assert (stats["get_into_unavailable"], stats["get_into_missing"], stats["get_into_full"],
            stats["get_into_failed"]) == (4, 1, 1, 1)


def test_one_slow_unavailable_call_opens_it(rig: Any) -> None:
    """Mooncake's calls take ~4.5 s with the master down: only the first may pay it."""
    clock, inner, guarded = rig
    inner.code, inner.cost = UNAVAILABLE, 4.5
    assert guarded.exists(["a"]) == [UNAVAILABLE]
    assert not guarded.available
    assert "took 4.5 s" in guarded.reason
    inner.code = OK  # slow but fine: counted, does not open
    clock.now += 1
    inner.problem = None
    assert guarded.exists(["a"]) == [1]
    assert guarded.available and guarded.stats()["slow_calls"] == 2


def test_probes_back_off_and_a_healthy_probe_closes_it(rig: Any) -> None:
    clock, inner, guarded = rig
    inner.code, inner.cost = UNAVAILABLE, 2.0
    guarded.exists(["a"])
    inner.cost = 0.0
    inner.problem = "master down"
    probes_at = []
    for _ in range(400):  # 0.05 s steps over 20 s
        clock.now += 0.05
        before = inner.health_calls
        assert guarded.exists(["a"]) == [UNAVAILABLE]
        if inner.health_calls > before:
            probes_at.append(clock.now)
    gaps = [round(b - a, 1) for a, b in zip(probes_at, probes_at[1:], strict=False)]
    assert gaps[:3] == [1.0, 2.0, 4.0] and set(gaps[3:]) == {4.0}  # doubling, capped at 4 s
    assert inner.calls == 1  # no call reached the store while open
    inner.problem, inner.code = None, OK
    clock.now += 4.0
    assert guarded.exists(["a"]) == [1]  # the probe succeeded: this call went through
    assert guarded.available
    stats = guarded.stats()
    assert stats["closed"] == 1 and stats["probes"] == len(probes_at) + 1
    assert stats["probes_failed"] == len(probes_at)


def test_a_raising_store_counts_failed_and_never_raises(rig: Any, expect_errors: Any) -> None:
    clock, inner, guarded = rig
    inner.raises = True
    assert guarded.put(["a", "b"], [(0, 1), (1, 1)]) == [FAILED, FAILED]
    assert guarded.available  # a bug is not an outage
    assert guarded.stats()["exceptions"] == 1 and guarded.stats()["put_failed"] == 2
    assert expect_errors.wait_for("RuntimeError: boom")


def test_concurrent_callers_probe_once(rig: Any) -> None:
    """While one caller probes (on its own thread), the others are answered at once."""
    clock, inner, guarded = rig
    inner.code = UNAVAILABLE
    for _ in range(3):
        guarded.exists(["a"])
    clock.now += 1.0
    answers: list[list[int]] = []

    def health() -> str | None:
        inner.health_calls += 1
        answers.append(guarded.exists(["b"]))  # another caller during the probe
        return None

    inner.health = health  # type: ignore[method-assign]
    inner.code = OK
    assert guarded.exists(["a"]) == [1]
    assert answers == [[UNAVAILABLE]] and inner.health_calls == 1


def test_a_promised_read_goes_to_the_store_while_open_and_closes_it(rig: Any) -> None:
    """A load the leader already promised is tried even while the circuit is open (this
    client's breaker can still be open after the store came back; failing it at once would
    leave the request computing on blocks nobody filled); the store answering closes it."""
    clock, inner, guarded = rig
    inner.code = UNAVAILABLE
    for _ in range(3):
        guarded.get_into(["a"], [(0, 64)])
    assert not guarded.available
    assert guarded.get_into(["a"], [(0, 64)]) == [UNAVAILABLE]  # an ordinary read: at once
    calls = inner.calls
    assert guarded.get_promised(["a"], [(0, 64)]) == [UNAVAILABLE]  # still down: tried
    assert inner.calls == calls + 1 and not guarded.available
    inner.code = OK
    assert guarded.get_promised(["a", "b"], [(0, 64), (64, 64)]) == [64, 64]
    assert guarded.available and inner.calls == calls + 2
    assert inner.health_calls == 0  # no probe needed: the read itself answered
    stats = guarded.stats()
    assert stats["closed"] == 1 and stats["get_into_ok"] == 2
