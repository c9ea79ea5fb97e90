"""The buffered event source with two drainers: the leader's poll and TensorRT-LLM's own reader.

Each drain takes the events buffered so far (TRT-LLM's C++ buffer is swapped out), so the two
drainers hold consecutive slices of one stream; the sink must ingest them in that order, or a
removal overtakes its store and the freed block stays published for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.events.source import attach_event_source
from kvbm_plugin.wire.events import events_as_maps
from kvbm_plugin.wire.publisher import EventPublisher

BS = 2
X = 7


class Recorder(EventPublisher):
    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.events: list[dict[str, Any]] = []

    def publish(self, events: Sequence[Any], data_parallel_rank: int | None = None) -> bool:
        self.events.extend(events_as_maps(events))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def stored(h: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": None,
        "blocks": [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                               for t in range(BS)]}]}}


def removed(h: int) -> dict[str, Any]:
    return {"event_id": 1, "window_size": 64, "data": {"type": "removed", "block_hashes": [h]}}


class Buffer:
    """TRT-LLM's event buffer: ``get_latest_events`` swaps out what is queued. ``on_drain`` runs
    right after a drain took its events, before the tee feeds them (the window in which the
    other drainer may run)."""

    def __init__(self) -> None:
        self.queued: list[dict[str, Any]] = []
        self.on_drain: Any = None
        self.readers: list[str] = []

    def get_latest_events(self, timeout_ms: float | None = None) -> list[dict[str, Any]]:
        taken, self.queued = self.queued, []
        self.readers.append(threading.current_thread().name)
        hook, self.on_drain = self.on_drain, None
        if hook is not None:
            hook()
        return taken


def sink_and_recorder() -> tuple[KvEventSink, Recorder]:
    rec = Recorder()
    return KvEventSink(rec, block_size=BS, window_size=64, prefix_closed=True), rec


def test_drain_a_poll_never_overtakes_what_a_reader_drained_and_never_waits_for_it() -> None:
    """``drain`` mode: TRT-LLM's reader has taken "store X" and not fed it yet when the engine
    queues "remove X" and the leader polls. The poll must not ingest the removal first, and
    must not wait for the reader either (a reader's getter may block for its timeout); from
    then on the plugin leaves the draining to that reader."""
    sink, rec = sink_and_recorder()
    buffer = Buffer()
    source = attach_event_source(buffer, sink, mode="drain")
    took = threading.Event()
    polled = threading.Event()

    def reader_holds_its_slice() -> None:
        took.set()
        assert polled.wait(10), "the poll waited for the reader"

    buffer.queued.append(stored(X))
    buffer.on_drain = reader_holds_its_slice
    # The reader calls the wrapped getter (the tee), as TRT-LLM's worker thread does.
    reader = threading.Thread(target=lambda: buffer.get_latest_events(0), name="trtllm-reader")
    reader.start()
    assert took.wait(10)
    buffer.queued.append(removed(X))
    source.poll()  # the reader holds the step: this poll skips, it does not wait
    polled.set()
    reader.join(10)
    assert not reader.is_alive()
    # From the reader's first drain on the plugin only taps (two drainers would split the
    # stream): the removal waits for the reader's next drain, which feeds it.
    assert not source.drains and source.poll() == 0
    assert buffer.queued == [removed(X)]
    again = threading.Thread(target=lambda: buffer.get_latest_events(0), name="trtllm-reader")
    again.start()
    again.join(10)
    sink.flush()
    assert [(e["type"], e["block_hashes"]) for e in rec.events] == [
        ("BlockStored", [X]), ("BlockRemoved", [X])]
    assert sink._ranks[0].published == {}
    assert sink.stats()["unknown_removes_suppressed"] == 0


def test_auto_a_reader_appearing_during_a_poll_feeds_after_it() -> None:
    """``auto`` mode, at the switch-over: the poll has taken "store X" when TRT-LLM's reader
    first calls the getter (which stops the polls from draining) and takes "remove X". The
    reader's slice must be fed after the poll's."""
    sink, rec = sink_and_recorder()
    buffer = Buffer()
    source = attach_event_source(buffer, sink, mode="auto")
    assert source.drains
    reader = threading.Thread(target=lambda: buffer.get_latest_events(0), name="trtllm-reader")

    def reader_arrives_mid_poll() -> None:
        buffer.queued.append(removed(X))
        reader.start()
        deadline = time.monotonic() + 10
        while source.drains:  # the reader has entered the tee: the switch-over
            assert time.monotonic() < deadline, "the reader never switched auto over"
            time.sleep(0.001)  # poll interval; the condition decides
        # Give the reader the chance to overtake: it must not get it (it waits for this poll
        # to feed). Bounded: in the correct order nothing happens here for the whole spell.
        deadline = time.monotonic() + 0.5
        while sink.stats()["events_in"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)

    buffer.queued.append(stored(X))
    buffer.on_drain = reader_arrives_mid_poll
    assert source.poll() == 1
    reader.join(10)
    assert not reader.is_alive()
    assert buffer.readers == ["MainThread", "trtllm-reader"]
    assert not source.drains and source.poll() == 0
    sink.flush()
    assert [(e["type"], e["block_hashes"]) for e in rec.events] == [
        ("BlockStored", [X]), ("BlockRemoved", [X])]
    assert sink._ranks[0].published == {}


def _reader_view(events: list[dict[str, Any]]) -> set[int]:
    """The blocks a consumer of TRT-LLM's own stream holds after ``events`` (stores minus
    removals, in order), as Dynamo's TRT-LLM publisher would advertise them."""
    held: set[int] = set()
    for event in events:
        data = event["data"]
        if data["type"] == "stored":
            held.update(int(b["block_hash"]) for b in data["blocks"])
        elif data["type"] == "removed":
            held.difference_update(int(h) for h in data["block_hashes"])
    return held


def test_drain_with_trtllm_reader_leaves_no_freed_block_published(make_engine) -> None:  # noqa: ANN001
    """``drain`` and TRT-LLM's own reader (issue 27, item 6): once the reader has read, the
    plugin leaves the draining to it, so the removals of blocks the engine frees reach the
    reader's stream too (before: the plugin took them, and those blocks stayed published
    there for good), while the plugin still publishes every event it drains."""
    from _engines import OFF, prompt
    from _kvwire import wait_until

    from kvbm_plugin.testing.fake_trtllm import KVCacheEventSerializer

    engine = make_engine(env={**OFF, "DYN_KVBM_KV_EVENTS_SOURCE": "drain"},
                         trtllm_event_reader=True, num_gpu_blocks=24)
    reader, manager, source = engine.event_reader, engine.kv_cache_manager, None
    produced: list[Any] = []  # the whole stream, as the engine made it readable
    append = manager._append

    def recording(objects: list[Any], bounded: bool = True) -> None:
        produced.extend(objects)
        append(objects, bounded)

    manager._append = recording
    reader.pause()
    engine.submit(prompt(1, 40), 3)
    engine.run_until_idle()  # the plugin attached and drained: the reader has not read yet
    source = engine.leader.event_source
    assert source.drains
    reader.resume()
    # Its first read (every 50 ms at most) is what tells the plugin another reader exists;
    # until then the event pump (every 5 ms) may drain what prompt 2 makes.
    wait_until(lambda: not source.drains, what="the reader's first read")
    engine.submit(prompt(2, 40), 3)  # read by TRT-LLM's reader: its stores are in its stream
    engine.run_until_idle()
    wait_until(lambda: bool(reader.events()) and manager.readable() == 0,
               what="the reader's read")
    reader.pause()  # a reader that polls rarely (an HTTP client of /kv_cache_events)
    for k in range(12):  # evicts the blocks of prompt 2 from the 24-block pool
        engine.submit(prompt(10 + k, 40), 3)
        engine.run_until_idle()
    reader.resume()
    wait_until(lambda: manager.readable() == 0, what="the reader to drain the queue")
    # The reader missed only what the plugin drained before its first read (prompt 1's
    # events): its view holds nothing the whole stream's does not.
    freed = _reader_view(reader.events()) - _reader_view(
        KVCacheEventSerializer.serialize(produced))
    assert not freed, f"{len(freed)} freed blocks still published in TRT-LLM's own stream"
    assert not source.drains
    engine.leader.flush_events()
    sink = engine.leader.event_sink.stats()
    truth = engine.pool.resident_full_hashes()
    assert sink["blocks_stored"] - sink["blocks_removed"] == len(truth)
    assert sink["events_in"] == manager.produced  # every event reached the plugin as well


def test_a_large_drain_is_serialized_and_ingested_a_slice_at_a_time() -> None:
    """TensorRT-LLM's C++ events are serialized in slices of SERIALIZE_CHUNK, each ingested
    before the next is built (its dicts still in the CPU cache): every event arrives, in
    order, and no call serializes more than a slice."""
    from kvbm_plugin.events.source import SERIALIZE_CHUNK

    class Cpp:  # a C++ event object: not a Mapping, turned into its dict by serialize
        def __init__(self, d: dict[str, Any]) -> None:
            self.d = d

    sizes: list[int] = []

    def serialize(objects: list[Any]) -> list[dict[str, Any]]:
        sizes.append(len(objects))
        return [o.d for o in objects]

    sink, rec = sink_and_recorder()
    buffer = Buffer()
    n = 2 * SERIALIZE_CHUNK + 5
    buffer.queued = [Cpp(stored(h)) for h in range(1, n + 1)]
    source = attach_event_source(buffer, sink, mode="drain", serialize=serialize)
    assert source.poll() == n
    sink.flush()
    assert sizes == [SERIALIZE_CHUNK, SERIALIZE_CHUNK, 5]
    assert [h for e in rec.events for h in e["block_hashes"]] == list(range(1, n + 1))
