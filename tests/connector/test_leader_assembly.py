"""The leader's event path, built from a validated config: which parts, which tier-event
target, and nothing left running when a step fails."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest

from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    ConsolidatorConfig,
    load_consolidator_config,
)
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.leader.event_path import EventPath, TierEventPublisher, assemble_event_path

BS = 4


@pytest.fixture
def config() -> Iterator[ConsolidatorConfig]:
    path = tempfile.mkdtemp(prefix="kva", dir="/tmp")  # ipc paths must stay short
    try:
        yield load_consolidator_config({
            EVENTS_ENDPOINT: f"ipc://{path}/ev", OUTPUT_ENDPOINT: f"ipc://{path}/out",
            OUTPUT_REPLAY_ENDPOINT: f"ipc://{path}/outr"}, num_ranks=1)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _close(parts: EventPath) -> None:
    if parts.consolidator is not None:
        parts.consolidator.shutdown(5.0)
    parts.event_sink.shutdown(5.0)


def _publisher_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvbm-zmq-publisher")}


def _wait_until_gone(threads: set[threading.Thread], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, f"still running: {threads}"
        time.sleep(0.01)


def test_without_a_consolidator_tier_events_go_to_the_ranks_publisher(config) -> None:
    parts = assemble_event_path(config, consolidate=False, dp_rank=0, block_size=BS)
    try:
        assert parts.consolidator is None
        assert isinstance(parts.event_sink, KvEventSink)
        assert isinstance(parts.tier_events, TierEventPublisher)
        parts.tier_events.register_store("CPU", 0, 7, None, [1, 2, 3, 4], BS)
        assert parts.tier_events.flush()
        assert parts.event_sink.stats()["publisher_batches_accepted"] == 1  # the sink's publisher
    finally:
        _close(parts)


def test_with_a_consolidator_it_is_started_and_receives_the_tier_events(config) -> None:
    parts = assemble_event_path(config, consolidate=True, dp_rank=0, block_size=BS)
    try:
        assert isinstance(parts.consolidator, KvEventConsolidator)
        assert parts.tier_events is parts.consolidator
        with pytest.raises(RuntimeError, match="already started"):
            parts.consolidator.start()
    finally:
        _close(parts)


@pytest.mark.parametrize("consolidate", [False, True])
def test_a_given_tier_events_target_is_kept(config, consolidate: bool) -> None:
    recorder = object()
    parts = assemble_event_path(config, consolidate=consolidate, dp_rank=0, block_size=BS,
                                tier_events=recorder)
    try:
        assert parts.tier_events is recorder
        assert (parts.consolidator is not None) is consolidate
    finally:
        _close(parts)


@pytest.mark.parametrize(("failing_step", "consolidate"), [
    ((KvEventConsolidator, "start"), True),  # e.g. its output endpoint is taken
    ((KvEventSink, "__init__"), False),  # the rank's publisher exists already
])
def test_a_failing_step_leaves_no_publisher_running(config, monkeypatch, failing_step,
                                                    consolidate: bool) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("step refused")

    monkeypatch.setattr(*failing_step, refuse)
    before = _publisher_threads()
    with pytest.raises(RuntimeError, match="step refused"):
        assemble_event_path(config, consolidate=consolidate, dp_rank=0, block_size=BS)
    _wait_until_gone(_publisher_threads() - before)


def test_with_attention_dp_each_ranks_gpu_tier_stream_names_its_own_pod() -> None:
    # Rank 0 publishes every rank's GPU-tier stream; a {dp_rank} in the topic must name the
    # rank of each stream, not rank 0 (the leader's config is rank 0's, its topic filled in).
    from kvbm_plugin.consolidator_config import TOPIC

    path = tempfile.mkdtemp(prefix="kva", dir="/tmp")
    try:
        config = load_consolidator_config({
            EVENTS_ENDPOINT: f"ipc://{path}/ev", OUTPUT_ENDPOINT: f"ipc://{path}/out",
            TOPIC: "kv@pod-dp{dp_rank}@m"}, num_ranks=2, attention_dp=True)
        parts = assemble_event_path(config, consolidate=False, dp_rank=0, block_size=BS,
                                    dp_size=2)
        try:
            sink = parts.event_sink
            topics = [sink._publisher._topic, sink._rank_publishers[1]._topic]  # type: ignore[attr-defined]
            assert topics == [b"kv@pod-dp0@m", b"kv@pod-dp1@m"]
        finally:
            _close(parts)
    finally:
        shutil.rmtree(path, ignore_errors=True)
