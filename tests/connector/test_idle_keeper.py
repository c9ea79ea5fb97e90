"""While TensorRT-LLM's loop blocks (no connector call at all), the leader's idle keeper keeps
the router's view live: completed offloads are registered and published, and the GPU-tier
events TensorRT-LLM produced are published, within 1 s."""

from __future__ import annotations

import gc
import threading
import time
from collections import deque
from typing import Any

import pytest
from _engines import held_disk, prompt, tiers
from _kvwire import wait_until

from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.leader.keeper import LeaderKeeper
from kvbm_plugin.leader.lifetime import request_gone, request_handle
from kvbm_plugin.tiers.disk import DiskTier

BOUND_S = 1.0  # the promise: at most this long after the transfer completed
# The shipped period, read at collection (tests/conftest.py shortens it for each other test).
SHIPPED_PERIOD_S = KvbmConnectorLeader.IDLE_PERIOD_S


@pytest.fixture(autouse=True)
def _the_shipped_period(monkeypatch: pytest.MonkeyPatch) -> None:
    """The promise is the shipped keeper's: these tests run it at its shipped period."""
    monkeypatch.setattr(KvbmConnectorLeader, "IDLE_PERIOD_S", SHIPPED_PERIOD_S)


class TierRecorder:
    def __init__(self) -> None:
        self.stores: list[tuple[str, int, float]] = []

    def register_store(self, tier, dp_rank, block_hash, parent_hash, token_ids, block_size,
                       **scope: Any) -> None:
        self.stores.append((tier, block_hash, time.monotonic()))

    def register_remove(self, tier, dp_rank, block_hashes) -> None:
        return None

    def register_clear(self, tier, dp_rank) -> None:
        return None


def test_offloads_completed_while_the_engine_idles_are_published_within_a_second(
        make_engine, monkeypatch) -> None:
    original = DiskTier.write
    release = threading.Event()
    written = threading.Event()

    def held_write(self, slot, key, block):
        release.wait(30)
        try:
            return original(self, slot, key, block)
        finally:
            written.set()

    monkeypatch.setattr(DiskTier, "write", held_write)
    rec = TierRecorder()
    engine = make_engine(num_gpu_blocks=32, env=tiers(disk=64), tier_events=rec)
    engine.submit(prompt(3, 17), 1)
    while engine.active():
        engine.step()
    # TRT-LLM now blocks in its request queue: not a single connector call from here on
    builds = engine.kv_cache_connector_manager.metadata_builds
    calls = engine.kv_cache_connector_manager.get_finished_calls
    assert rec.stores == []
    release.set()
    assert written.wait(10)
    done = time.monotonic()
    wait_until(lambda: len(rec.stores) == 4, 10, "the offloads' DISK STOREs")
    assert rec.stores[-1][2] - done <= BOUND_S
    assert {tier for tier, _, _ in rec.stores} == {"DISK"}
    assert engine.kv_cache_connector_manager.metadata_builds == builds
    assert engine.kv_cache_connector_manager.get_finished_calls == calls
    stats = engine.leader.stats()
    assert stats["keeper_applies"] + stats["idle_ticks"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_events_of_the_last_pass_are_published_while_the_engine_idles(
        make_engine, overlap) -> None:
    engine = make_engine(env=tiers(host=16), overlap_scheduler=overlap)
    sink = engine.leader.event_sink
    engine.submit(prompt(4, 17), 1)
    while engine.active():
        engine.step()
    # The release STORE was made readable in the last pass, after its build: no hook runs
    # again, so the leader's event pump (while it still steps) or the keeper publishes it.
    idle_since = time.monotonic()
    wait_until(lambda: engine.kv_cache_manager.readable() == 0
               and sink.stats()["pending_events"] == 0, 10, "the last pass's events published")
    assert time.monotonic() - idle_since <= BOUND_S
    stats = sink.stats()
    assert stats["events_in"] == engine.kv_cache_manager.produced > 0
    assert stats["batches_published"] > 0 and stats["batches_lost"] == 0


def _idle_engine_with_held_writes(make_engine: Any, monkeypatch: pytest.MonkeyPatch,
                                  seed: int, **config: Any) -> tuple[Any, TierRecorder,
                                                                     threading.Event]:
    """(engine, its tier-event recorder, the release of its held disk writes): one request's
    offloads waiting in the disk writes after the engine's loop went idle (no hook runs from
    here on), the idle tick a minute away."""
    monkeypatch.setattr(KvbmConnectorLeader, "IDLE_PERIOD_S", 60.0)
    release = held_disk(monkeypatch, "write")
    rec = TierRecorder()
    engine = make_engine(num_gpu_blocks=32, env=tiers(disk=64), tier_events=rec, **config)
    engine.submit(prompt(seed, 17), 1)
    while engine.active():
        engine.step()
    return engine, rec, release


def test_reports_are_applied_by_the_keeper_as_they_come_in_not_at_the_idle_period(
        make_engine, monkeypatch) -> None:
    """With the idle tick a minute away, the offloads that complete after the last hook are
    still committed and registered within the bound: the report's hand-off nudges the
    keeper, which applies it off the executor thread (no connector call made meanwhile)."""
    engine, rec, release = _idle_engine_with_held_writes(make_engine, monkeypatch, 5)
    builds = engine.kv_cache_connector_manager.metadata_builds
    assert rec.stores == [] and engine.leader.stats()["saves_committed"] == 0
    release.set()
    wait_until(lambda: len(rec.stores) == 4, BOUND_S * 5, "the offloads' STOREs")
    stats = engine.leader.stats()
    assert stats["saves_committed"] == 4 and stats["keeper_applies"] > 0
    assert stats["idle_ticks"] == 0
    assert engine.kv_cache_connector_manager.metadata_builds == builds


def test_a_nudge_that_finds_a_hook_running_leaves_the_reports_to_the_hooks(
        make_engine, monkeypatch) -> None:
    """Reports handed in while a hook holds the leader's lock: the keeper does not wait for
    the lock (it counts the nudge as busy and applies nothing); the next hook applies them."""
    engine, rec, release = _idle_engine_with_held_writes(make_engine, monkeypatch, 6)
    leader = engine.leader
    with leader._lock:  # noqa: SLF001 - as a hook holds it
        release.set()
        wait_until(lambda: leader.stats()["keeper_busy"] > 0, 10, "the keeper's busy nudge")
        assert rec.stores == [] and leader.stats()["keeper_applies"] == 0
    # A hook's apply (the writes' later reports may still be on their way: it is repeated)
    wait_until(lambda: leader.publish_now() or len(rec.stores) == 4, 10, "the STOREs")
    assert leader.stats()["saves_committed"] == 4


def test_while_names_are_learned_the_keeper_leaves_the_reports_to_the_build(
        make_engine, monkeypatch) -> None:
    """Where TensorRT-LLM's names are learned from its events, reports wait for the build that
    reads those events first: the keeper's nudge applies nothing."""
    engine, _rec, release = _idle_engine_with_held_writes(make_engine, monkeypatch, 7,
                                                          provide_block_hashes=False)
    leader = engine.leader
    keeper = leader._keeper  # noqa: SLF001 - its counters
    assert leader._naming.learning  # noqa: SLF001 - the mode under test
    nudged = keeper.nudged
    release.set()
    # ``nudged`` counts finished wakes, and no write could finish before ``release``: a wake
    # counted after it ran with reports in the hub.
    wait_until(lambda: leader.stats()["ops_inflight"] > 0 and keeper.nudged > nudged
               and not leader._hub.empty(), 10, "the reports handed in")  # noqa: SLF001
    assert keeper.applies == 0 and leader.stats()["saves_committed"] == 0
    # The idle tick (as the build) reads the events, then applies: repeated, as the later
    # writes' reports may still be on their way (the run commits once all four are in).
    wait_until(lambda: leader.publish_now() or leader.stats()["saves_committed"] == 4, 10,
               "the run committed by the tick")
    assert keeper.applies == 0


def test_a_request_object_that_dies_queues_its_handle_once() -> None:
    """The leader's handle of a request: a weak reference naming the request, queued in the
    deaths the keeper reaps (O(deaths), never reading the object) when the object dies."""
    deaths: deque[Any] = deque()

    class Request:
        pass

    request = Request()
    handle = request_handle(request, 7, deaths)
    assert handle() is request and handle.key == 7 and not deaths
    assert not request_gone(handle)
    del request
    gc.collect()
    assert list(deaths) == [handle] and request_gone(handle)
    assert request_handle(5, 1, deaths) == 5  # no weak reference possible: kept itself


def test_the_keeper_survives_a_failing_apply_counted_and_logged(expect_errors) -> None:
    """An apply that raises is counted and logged (rate-limited); the next nudge applies."""
    calls: list[int] = []

    def apply() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return True

    keeper = LeaderKeeper(lambda: None, apply, threading.RLock(), time.monotonic, 60.0,
                          "test-keeper")
    try:
        keeper.nudge()
        wait_until(lambda: keeper.nudged == 1, 10, "the first wake")
        assert keeper.errors == 1 and keeper.applies == 0
        keeper.nudge()
        wait_until(lambda: keeper.nudged == 2, 10, "the second wake")
        assert keeper.errors == 1 and keeper.applies == 1
        assert expect_errors.wait_for("keeper failed to apply reports")
    finally:
        keeper.stop()
