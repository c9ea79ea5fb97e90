"""KvEventSink keeps its GPU-tier stream prefix-closed whatever the engine sends (buffered path).

The project's router model (:class:`~kvbm_plugin.routers.router_view.RouterView`, Dynamo's
indexer's rules) reads the output: it must never see a store under a parent it does not hold, a
removal of a block it does not hold or that still has descendants, nor a store of a block it
holds already. Runs with the compiled and the Python ingest loops.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from _depth import depths, run_examples
from _loops import both_implementations
from hypothesis import strategies as st

from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.wire.events import decode_event, events_as_maps, to_unsigned_u64
from kvbm_plugin.wire.publisher import EventPublisher

BS = 2
U64 = 1 << 64
ingest_loop = both_implementations("event_sink")


class Recorder(EventPublisher):
    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[tuple[int, list[dict[str, Any]]]] = []

    def publish(self, events: Sequence[dict[str, Any]], data_parallel_rank: int | None = None
                ) -> bool:
        self.batches.append((data_parallel_rank or 0, events_as_maps(events)))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def stored(parent: int | None, *blocks: tuple[int, int] | tuple[int, int, int]
           ) -> dict[str, Any]:
    """A TensorRT-LLM store of ``(hash, tokens)`` or ``(hash, tokens, content)`` blocks (see
    :func:`tokens_of`; content 0 by default)."""
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent,
        "blocks": [{"type": "stored_block", "block_hash": b[0], "cache_level": 0,
                    "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                               for t in tokens_of(b[2] if len(b) > 2 else 0, b[1])]}
                   for b in blocks]}}


def removed(*hashes: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {"type": "removed",
                                                        "block_hashes": list(hashes)}}


def chain_hash(parent: int | None, content: int, n: int) -> int:
    """A block's u64 hash from its parent's and its tokens, as TensorRT-LLM chains them: one
    hash names one block at one place in the tree (half of them have the top bit set)."""
    digest = hashlib.blake2b(repr((parent, content, n)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def tokens_of(content: int, n: int) -> list[int]:
    """The first ``n`` tokens of a block of content ``content``: distinct contents, distinct
    tokens (so a content-keyed router sees distinct blocks)."""
    return [10 * content + t for t in range(n)]


# Events as choices, turned into hashes by Stream: a store names its parent (none, a hash seen
# before, or one never seen) and its blocks (content, tokens: a full block or a partial one).
PICK = st.integers(0, 63)
STORE = st.tuples(st.just("store"), st.one_of(st.none(), st.just(-1), PICK),
                  st.lists(st.tuples(st.integers(0, 3), st.sampled_from([BS, BS, BS, BS - 1])),
                           min_size=1, max_size=3))
REMOVE = st.tuples(st.just("remove"), st.lists(st.one_of(st.just(-1), PICK), min_size=1,
                                               max_size=3))
EVENT = st.one_of(STORE, REMOVE)


class Stream:
    """Turns chosen events into TensorRT-LLM events: parents and removals name hashes seen
    before (stored, published or not), or one never stored (-1)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def pick(self, choice: int) -> int:
        if choice < 0 or not self.seen:
            return chain_hash(None, 99, BS)  # never stored
        return self.seen[choice % len(self.seen)]

    def event(self, op: tuple[Any, ...]) -> dict[str, Any]:
        if op[0] == "remove":
            return removed(*(self.pick(c) for c in op[1]))
        parent = None if op[1] is None else self.pick(op[1])
        blocks, prev = [], parent
        for content, n in op[2]:
            prev = chain_hash(prev, content, n)
            blocks.append((prev, content, n))
            self.seen.append(prev)
        return stored(parent, *((h, n, content) for h, content, n in blocks))


@depths(quick=50, thorough=300)
def test_sink_output_is_prefix_closed_whatever_the_engine_sends(examples: int) -> None:
    """Random streams (50, or 300 in the slow set) of up to 8 iterations x 8 events (stores
    under any parent, partial blocks, removals of parents before children and of blocks never
    stored, repeats): every published batch is clean for the router model (no rule warning:
    no skipped store, no unknown or cutting removal, no re-store, alias or short block), and
    the tree it holds equals the sink's published state."""
    run_examples(examples, _prefix_closed_stream,
                 st.lists(st.lists(EVENT, max_size=8), min_size=1, max_size=8))


def _prefix_closed_stream(batches: list[list[tuple[Any, ...]]]) -> None:
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64, prefix_closed=True)
    router = RouterView(BS)
    stream = Stream()
    for batch in batches:
        sink.ingest([stream.event(op) for op in batch])
        sink.flush()
        for dp_rank, events in rec.batches:
            for event in events:
                router.apply_event(decode_event(event), "engine", dp_rank)
        rec.batches.clear()
        assert router.counts.broken() == {}
        published = {(None if p is None else to_unsigned_u64(p), to_unsigned_u64(h))
                     for h, p in sink._ranks[0].published.items()}
        assert router.edges().get(("engine", 0, "GPU"), set()) == published
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
    events = rec.batches[0][1]
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
    assert [e["type"] for e in rec.batches[0][1]] == ["BlockStored", "BlockRemoved"]
