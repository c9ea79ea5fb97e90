"""The leader's consolidator takes its own rank's GPU-tier batches by direct call: from the
event sink's flush, in order with the tier registrations, with no encode, socket or decode in
between; the rank's stream still goes out once, encoded, for readers outside the process."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvbm_plugin.consolidator import streams as streams_module
from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    ConsolidatorConfig,
    load_consolidator_config,
)
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.leader.event_path import EventPath, assemble_event_path
from kvbm_plugin.wire import events as wire_events
from kvbm_plugin.wire.publisher import NullEventPublisher

BS = 4


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def trtllm_stored(h: int, parent: int | None, first_token: int) -> dict[str, Any]:
    """One full block as TensorRT-LLM's serializer hands it to the sink (u64 hash)."""
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent, "blocks": [{
            "type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
            "tokens": [{"type": "unique_token", "token_id": first_token + i,
                        "token_extra_id": 0} for i in range(BS)]}]}}


def wire_stored(h: int, parent: int | None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
            "token_ids": list(range(h, h + BS)), "block_size": BS, "lora_id": None,
            "medium": "GPU", "lora_name": None}


@pytest.fixture
def config() -> Iterator[ConsolidatorConfig]:
    path = tempfile.mkdtemp(prefix="kvd", dir="/tmp")  # ipc paths must stay short
    try:
        yield load_consolidator_config({
            EVENTS_ENDPOINT: f"ipc://{path}/ev", OUTPUT_ENDPOINT: f"ipc://{path}/out",
            OUTPUT_REPLAY_ENDPOINT: f"ipc://{path}/outr"}, num_ranks=1)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def path_parts(config) -> Iterator[EventPath]:
    parts = assemble_event_path(config, consolidate=True, dp_rank=0, block_size=BS)
    try:
        yield parts
    finally:
        if parts.consolidator is not None:
            parts.consolidator.shutdown(5.0)
        if parts.event_sink is not None:
            parts.event_sink.shutdown(5.0)


def test_the_sinks_batches_reach_the_consolidator_by_direct_call_and_still_go_out(
        config, path_parts, monkeypatch) -> None:
    sink, consolidator = path_parts.event_sink, path_parts.consolidator
    assert sink is not None and consolidator is not None
    # A reader outside the process: the rank's GPU-tier stream, as before.
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(config.publish_endpoint(0).connect)
    decodes: list[int] = []
    unpackb = msgpack.unpackb

    def counting_unpackb(*args: Any, **kwargs: Any) -> Any:
        decodes.append(1)
        return unpackb(*args, **kwargs)

    encodes: list[int] = []
    batch_payload = wire_events.batch_payload

    def counting_payload(*args: Any) -> bytes:
        encodes.append(1)
        return batch_payload(*args)

    # What the consolidator's socket path decodes with, and what the publisher encodes with.
    monkeypatch.setattr(streams_module.msgpack, "unpackb", counting_unpackb)
    monkeypatch.setattr("kvbm_plugin.wire.batch_encoding.batch_payload", counting_payload)
    try:
        frames: list[bytes] = []
        deadline = time.monotonic() + 10
        h = 0
        while not frames:  # the SUB joins late (slow joiner): publish until it gets one
            assert time.monotonic() < deadline, "the GPU-tier stream never reached the SUB"
            h += 1
            sink.ingest([trtllm_stored(h, h - 1 if h > 1 else None, 10 * h)])
            sink.flush()
            if sub.poll(20):
                frames = sub.recv_multipart()
        assert len(frames) == 3 and unpackb(frames[2])[1]  # topic, seq, payload
        wait_for(lambda: consolidator.wait_idle(0) and
                 len(consolidator._core.visible_hashes(0)) == h, what="every block applied")
        stats = consolidator.stats()
        assert stats["direct_batches"] == h
        assert stats["messages_received"] >= h  # handed-over batches count as received
        assert decodes == []  # nothing of the GPU tier went through the socket path
        # One encode per GPU-tier batch (the outside stream's), and the output's own.
        assert len(encodes) == h + stats["batches_out"]
    finally:
        sub.close(0)


def test_tier_registrations_and_gpu_batches_apply_in_the_order_they_were_made(
        path_parts) -> None:
    sink, consolidator = path_parts.event_sink, path_parts.consolidator
    assert sink is not None and consolidator is not None
    # The GPU tier stores block 1, the host tier copies it, the GPU pool evicts it: the block
    # stays visible (the host holds it). Applied out of order, the removal would come first.
    sink.ingest([trtllm_stored(1, None, 10)])
    sink.flush()
    consolidator.register_store("CPU", 0, 1, None, [10, 11, 12, 13], BS)
    sink.ingest([{"event_id": 1, "window_size": 64,
                  "data": {"type": "removed", "block_hashes": [1]}}])
    sink.flush()
    wait_for(lambda: consolidator.wait_idle(0) and consolidator.stats()["direct_batches"] == 2)
    assert consolidator._core.visible_hashes(0) == {1}
    assert consolidator._core.resident_in(1, "CPU", 0) == {1}  # SOURCE_TIERS


def test_a_backlog_past_the_bound_is_counted_and_resyncs_the_rank(config) -> None:
    consolidator = KvEventConsolidator(config, direct_ranks=(0,), max_pending=2)
    try:
        # Not started yet: nothing is applied, so the third batch meets the bound.
        for h in (1, 2, 3):
            consolidator.take_gpu_batch(0, [wire_stored(h, h - 1 if h > 1 else None)])
        assert consolidator.stats()["direct_batches_dropped"] == 1
        consolidator.start()
        wait_for(lambda: consolidator.wait_idle(0)
                 and consolidator.stats()["direct_batches"] == 2, what="the queued batches")
        stats = consolidator.stats()
        # Block 3's store was lost: the rank's GPU residency is treated as cleared.
        assert stats["unfillable_gaps"] == 1 and stats["resyncs"] == 1
        assert consolidator._core.visible_hashes(0) == set()
        consolidator.take_gpu_batch(0, [wire_stored(7, None)])  # accepted again
        wait_for(lambda: consolidator._core.visible_hashes(0) == {7}, what="the next batch")
    finally:
        consolidator.shutdown(5.0)


def test_only_the_direct_ranks_are_taken(config) -> None:
    with pytest.raises(ValueError, match="direct_ranks names dp rank 3"):
        KvEventConsolidator(config, direct_ranks=(3,))
    consolidator = KvEventConsolidator(config)
    with pytest.raises(ValueError, match="dp rank 0 is not one of direct_ranks"):
        consolidator.take_gpu_batch(0, [])


def test_a_failing_consumer_costs_neither_the_flush_nor_the_publish(expect_errors) -> None:
    sink = KvEventSink(NullEventPublisher(load_consolidator_config(
        {EVENTS_ENDPOINT: "ipc:///tmp/unused"}, num_ranks=1).publisher), block_size=BS)
    got: list[Any] = []

    def broken(rank: int, events: Any) -> None:
        got.append((rank, wire_events.events_as_maps(events)))
        raise RuntimeError("consumer bug")

    sink.hand_over(0, broken)
    sink.ingest([trtllm_stored(5, None, 50)])
    assert sink.flush()
    stats = sink.stats()
    assert stats["hand_over_errors"] == 1 and stats["batches_published"] == 1
    assert [(rank, [e["block_hashes"] for e in maps]) for rank, maps in got] == [(0, [[5]])]
    assert expect_errors.wait_for("consumer bug")


def test_without_a_gpu_tier_port_the_leaders_consolidator_still_gets_the_gpu_tier() -> None:
    """The GPU-tier endpoint existed for the socket hop: a single leader no longer needs it
    (no GPU-tier stream leaves the process then), and its output still carries the block."""
    path = tempfile.mkdtemp(prefix="kvn", dir="/tmp")
    try:
        config = load_consolidator_config({
            OUTPUT_ENDPOINT: f"ipc://{path}/out", OUTPUT_REPLAY_ENDPOINT: f"ipc://{path}/outr"},
            num_ranks=1)
        assert config.enabled and config.gpu_events is None
        parts = assemble_event_path(config, consolidate=True, dp_rank=0, block_size=BS)
        try:
            assert parts.event_sink is not None and parts.consolidator is not None
            parts.event_sink.ingest([trtllm_stored(9, None, 90)])
            parts.event_sink.flush()
            wait_for(lambda: parts.consolidator._core.visible_hashes(0) == {9},
                     what="the block in the consolidator")
            wait_for(lambda: parts.consolidator.stats()["batches_out"] == 1,
                     what="the consolidated output")
        finally:
            parts.consolidator.shutdown(5.0)
            parts.event_sink.shutdown(5.0)
    finally:
        shutil.rmtree(path, ignore_errors=True)
