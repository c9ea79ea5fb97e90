"""The leader's event pump (leader/event_pump.py): TensorRT-LLM's buffered KV events are
drained, ingested and published on the pump's thread, not on the executor thread; the
executor thread only raises a flag, and drains there only when a tier block waits for a name
that only this iteration's events give."""

from __future__ import annotations

import threading
from typing import Any

from _engines import prompt, tiers
from _kvwire import wait_until

from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.events.trtllm_publisher import TrtllmNameFeed
from kvbm_plugin.leader.event_pump import EventPump
from kvbm_plugin.testing.kv_events import SimKVCacheManager


def test_the_executor_thread_neither_drains_nor_publishes_gpu_tier_events(
        make_engine, monkeypatch) -> None:
    drained_on: set[int] = set()
    flushed_on: set[int] = set()
    get_latest, flush = SimKVCacheManager.get_latest_events, KvEventSink.flush

    def recorded_get_latest(self: Any, *args: Any, **kwargs: Any) -> Any:
        drained_on.add(threading.get_ident())
        return get_latest(self, *args, **kwargs)

    def recorded_flush(self: Any) -> bool:
        flushed_on.add(threading.get_ident())
        return flush(self)

    monkeypatch.setattr(SimKVCacheManager, "get_latest_events", recorded_get_latest)
    monkeypatch.setattr(KvEventSink, "flush", recorded_flush)
    engine = make_engine(num_gpu_blocks=32, env=tiers(host=64))
    for k in range(4):
        engine.submit(prompt(40 + k, 33), 2)
    engine.run_until_idle()  # on this thread: it is the executor thread
    leader = engine.leader
    produced = engine.kv_cache_manager.produced
    sink = leader.event_sink
    wait_until(lambda: leader.event_source.events_seen == produced
               and sink.stats()["pending_events"] == 0, what="the pump's drain and publish")
    stats = leader.stats()
    assert produced > 0 and sink.stats()["events_in"] == produced
    assert stats["event_pump_steps"] > 0 and stats["event_pump_errors"] == 0
    assert threading.get_ident() not in drained_on | flushed_on
    assert drained_on and flushed_on


def test_while_names_are_awaited_the_executor_thread_reads_the_events_itself(
        make_engine, monkeypatch) -> None:
    """Without RequestData.block_hashes the leader confirms the rule it computes names by
    from TensorRT-LLM's events, before it may forget the request that shows it: until then
    the executor thread drains and reads them itself, as before the pump; once the rule is
    confirmed, the pump's thread does."""
    drained_on: set[int] = set()
    get_latest = SimKVCacheManager.get_latest_events

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        drained_on.add(threading.get_ident())
        return get_latest(self, *args, **kwargs)

    monkeypatch.setattr(SimKVCacheManager, "get_latest_events", recorded)
    engine = make_engine(num_gpu_blocks=32, env=tiers(host=64), provide_block_hashes=False)
    naming = engine.leader._naming  # noqa: SLF001
    engine.submit(prompt(60, 33), 2)
    assert naming.awaiting_events is False  # nothing read yet: no rule in use
    engine.run_until_idle()
    assert naming.confirmed == {("none", False, False)} and not naming.awaiting_events
    assert threading.get_ident() in drained_on
    drained_on.clear()
    for k in range(3):
        engine.submit(prompt(70 + k, 33), 2)
    engine.run_until_idle()
    assert threading.get_ident() not in drained_on
    assert engine.leader.stats()["block_name_mismatches"] == 0


def test_a_salt_adopted_at_the_first_report_is_a_rule_whose_names_are_awaited(
        request) -> None:
    """A request object without the salt field, whose first RequestData names one: its
    blocks are named under the salted rule from then on, so that rule is awaited too."""
    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.testing.fake_trtllm import (
        KvCacheConfig,
        LlmArgs,
        LlmRequest,
        ParallelConfig,
        RequestData,
        SchedulerOutput,
    )

    leader = KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),
                                         kvbm_plugin_env=tiers(host=16),
                                         kvbm_plugin_group=f"adopt-{request.node.name}"))
    try:
        tokens = list(range(100, 109))
        leader.get_num_new_matched_tokens(LlmRequest(1, tokens), 0)
        leader.build_connector_meta(SchedulerOutput(new_requests=[RequestData(
            1, tokens, [0, 1, 2], 0, 9, cache_salt="tenant-a")]))
        naming = leader._naming  # noqa: SLF001
        assert naming.rules_in_use == {("none", False, False), ("string", False, False)}
        naming.learning = True
        naming.confirmed.add(("none", False, False))
        assert naming.awaiting_events
    finally:
        leader.shutdown()


def test_a_dozing_pump_steps_at_the_next_wake() -> None:
    steps: list[int] = []
    pump = EventPump(lambda: steps.append(1), lambda: None, "test-pump", period_s=60.0)
    try:
        wait_until(lambda: pump._dozing, what="the pump dozing")  # noqa: SLF001
        before = len(steps)
        pump.wake()  # within BUSY_S, not the 60 s doze
        wait_until(lambda: len(steps) > before, timeout=10, what="a step after the wake")
    finally:
        pump.stop()
    assert not pump._thread.is_alive()  # noqa: SLF001


def test_failing_steps_are_counted_logged_once_and_the_pump_goes_on(expect_errors) -> None:
    calls: list[int] = []

    def poll() -> None:
        calls.append(1)
        if len(calls) <= 5:
            raise RuntimeError("boom")

    pump = EventPump(poll, lambda: None, "test-pump")
    try:
        pump.wake()
        wait_until(lambda: pump.steps >= 2, what="steps after the failures")
    finally:
        pump.stop()
    assert pump.errors == 5
    assert expect_errors.wait_for("event pump step failed")
    # one line for the five (rate-limited: a step failing every 5 ms is no log storm)
    assert len([m for m in expect_errors.messages() if "event pump step failed" in m]) == 1


def test_an_inline_step_runs_after_the_pumps_step_in_progress() -> None:
    """One step at a time: a caller's step waits for the pump thread's (two flushes at once
    could reorder a rank's batches), then runs its own."""
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def poll() -> None:
        order.append(threading.current_thread().name)
        if len(order) == 1:  # the pump thread's first step blocks mid-step
            entered.set()
            release.wait(30)
            order.append("pump done")

    pump = EventPump(poll, lambda: None, "test-pump")
    caller = threading.Thread(target=pump.step, name="caller")
    try:
        pump.wake()
        assert entered.wait(10)
        caller.start()
        wait_until(lambda: caller.is_alive(), what="the caller started")
        assert order == ["test-pump"]  # the caller waits for the step in progress
        release.set()
        caller.join(10)
        assert order[:3] == ["test-pump", "pump done", "caller"] and pump.inline_steps == 1
    finally:
        release.set()
        pump.stop()


def test_observed_batches_keep_flush_order_and_count_what_overflows() -> None:
    feed = TrtllmNameFeed(max_batches=2)
    for rank in range(3):
        feed.observe(rank, [{"type": "BlockStored", "block_hashes": [rank], "block_size": 1,
                             "token_ids": [rank], "parent_block_hash": None}])
    assert [rank for rank, _ in feed.drain()] == [0, 1]
    assert feed.dropped == 1 and feed.drain() == []
