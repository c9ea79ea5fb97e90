"""KvEventSink keeps its GPU-tier stream prefix-closed whatever the engine sends (buffered path).

A strict router model reads the output: it must never see a store under a parent it does not
hold, a removal of a block it does not hold or that still has descendants, nor a store of a
block it holds already. Runs with the compiled and the Python ingest loops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from _loops import both_implementations
from _strict_router import StrictRouter
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.wire.publisher import EventPublisher

BS = 2
U64 = 1 << 64
ingest_loop = both_implementations("event_sink")


class Recorder(EventPublisher):
    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[list[dict[str, Any]]] = []

    def publish(self, events: Sequence[dict[str, Any]], data_parallel_rank: int | None = None
                ) -> bool:
        self.batches.append(list(events))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def stored(parent: int | None, *blocks: tuple[int, int]) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent,
        "blocks": [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                               for t in range(n)]} for h, n in blocks]}}


def removed(*hashes: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {"type": "removed",
                                                        "block_hashes": list(hashes)}}


HASH = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, U64 - 1, U64 - 2])
EVENT = st.one_of(
    st.builds(lambda parent, blocks: stored(parent, *blocks),
              st.one_of(st.none(), HASH),
              st.lists(st.tuples(HASH, st.sampled_from([BS, BS, BS, BS - 1])), min_size=1,
                       max_size=3)),
    st.builds(lambda hashes: removed(*hashes), st.lists(HASH, min_size=1, max_size=3)),
)


def wire(h: int) -> int:
    return h - U64 if h >= 1 << 63 else h


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(EVENT, max_size=8), min_size=1, max_size=8))
def test_sink_output_is_prefix_closed_whatever_the_engine_sends(
        batches: list[list[dict[str, Any]]]) -> None:
    """300 random streams of up to 8 iterations x 8 events (stores under any parent, partial
    blocks, removals of parents before children, repeats): every published batch is clean
    for a strict router, and what it holds equals the sink's published state."""
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64, prefix_closed=True)
    router = StrictRouter()
    for batch in batches:
        sink.ingest(batch)
        sink.flush()
        for events in rec.batches:
            router.apply(0, events)
        rec.batches.clear()
        assert router.violations == []
        assert router.held(0, "GPU") == set(sink._ranks[0].published)
    stats = sink.stats()
    assert stats["malformed_events"] == 0


def test_a_middle_eviction_removes_the_descendants_first_and_orphans_are_dropped() -> None:
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64, prefix_closed=True)
    sink.ingest([stored(None, (1, BS), (2, BS), (3, BS)), stored(2, (4, BS)),
                 removed(2),  # a middle block: 3 and 4 go first
                 stored(3, (5, BS)),  # under a block no longer published: dropped
                 removed(3), removed(4)])  # already gone: dropped, counted
    sink.flush()
    events = rec.batches[0]
    assert events[0]["block_hashes"] == [1, 2, 3]
    assert events[1]["block_hashes"] == [4] and events[1]["parent_block_hash"] == 2
    assert events[2]["type"] == "BlockRemoved"
    assert sorted(events[2]["block_hashes"][:2]) == [3, 4] and events[2]["block_hashes"][2] == 2
    assert len(events) == 3
    stats = sink.stats()
    assert stats["cascade_removes"] == 2 and stats["orphan_stores_dropped"] == 1
    assert stats["unknown_removes_suppressed"] == 2


def test_without_prefix_closure_the_sink_forwards_what_it_gets() -> None:
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64)
    sink.ingest([stored(9, (1, BS)), removed(7)])
    sink.flush()
    assert [e["type"] for e in rec.batches[0]] == ["BlockStored", "BlockRemoved"]
