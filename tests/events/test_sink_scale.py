"""The event sink's state at scale: work per event that does not grow with what is tracked.

Structure, not timing (the timings are in benchmarks/bench_sink_scale.py): a cascade touches
only the removed block's descendants (its state is never scanned, nothing of the size of the
published set is allocated), a bounded map evicts its oldest entry without walking the dict,
removals stay on the compiled path while partial blocks are suppressed, and a batch emptied
by ``discard_events`` goes on publishing events.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest
from _loops import both_implementations

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin._util.bounded import EvictionOrder
from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.naming.names import BlockNames
from kvbm_plugin.wire.events import EncodedBatch, events_as_maps
from kvbm_plugin.wire.publisher import EventPublisher

BS = 2
ingest_loop = both_implementations("event_sink")  # a test naming native= runs as it says
needs_native = pytest.mark.skipif(_compiled.loops("event_sink", {}) is None,
                                  reason="kvbm_plugin.events._sink_c was not built")


class Recorder(EventPublisher):
    def __init__(self, encoded: bool = True) -> None:
        super().__init__(PublisherSettings())
        self.accepts_encoded_events = encoded
        self.items: list[list[Any]] = []  # each batch as handed over

    def publish(self, events: Sequence[Any], data_parallel_rank: int | None = None) -> bool:
        self.items.append(events)  # type: ignore[arg-type]
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass

    def maps(self) -> list[dict[str, Any]]:
        return [e for batch in self.items for e in events_as_maps(batch)]


class NoScan(dict):  # type: ignore[type-arg]
    """A dict that refuses to be walked: lookups, stores and deletions only."""

    def _refuse(self, *args: Any) -> Any:
        raise AssertionError("the whole map was walked")

    __iter__ = items = keys = values = _refuse  # type: ignore[assignment]


def stored(parent: int | None, *hashes: int, n_tokens: int = BS) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent,
        "blocks": [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                               for t in range(n_tokens)]} for h in hashes]}}


def removed(*hashes: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {"type": "removed",
                                                        "block_hashes": list(hashes)}}


def closed_sink(**kw: Any) -> tuple[KvEventSink, Recorder]:
    rec = Recorder()
    return KvEventSink(rec, block_size=BS, window_size=64, prefix_closed=True, **kw), rec


# ---- cascades: O(descendants) -----------------------------------------------------------------


def test_a_cascade_never_walks_the_published_blocks() -> None:
    """Python loop (the compiled one needs exact dicts): with the published map refusing to be
    walked, removing a parent before its children still removes exactly its descendants,
    children first, on a branched tree among many other blocks."""
    sink, rec = closed_sink(native=False)
    rs = sink._ranks[0]
    rs.published = NoScan()
    sink.ingest([stored(None, *range(1000, 3000))])  # 2,000 other blocks
    sink.ingest([stored(None, 1, 2, 3), stored(2, 4), stored(4, 5), stored(2, 6)])
    sink.flush()
    rec.items.clear()
    sink.ingest([removed(2), removed(5), removed(1)])
    sink.flush()
    (ev,) = rec.maps()
    gone = ev["block_hashes"]
    assert gone[-2:] == [2, 1] and sorted(gone[:-2]) == [3, 4, 5, 6]
    assert gone.index(5) < gone.index(4)  # a child before its parent
    assert len(rs.published) == 2000 and 1000 in rs.published
    assert not set(rs.kids) & {1, 2, 3, 4, 5, 6}
    stats = sink.stats()
    assert stats["cascade_removes"] == 4 and stats["unknown_removes_suppressed"] == 1


def test_a_cascade_allocates_for_its_descendants_only() -> None:
    """Both loops: at 100,000 tracked blocks, a removal whose block has two descendants
    allocates next to nothing (a walk of the published map would build an index of them
    all: megabytes)."""
    sink, rec = closed_sink()
    n = 100_000
    sink.ingest([stored(None, *range(10, 10 + n))])
    sink.ingest([stored(None, 1, 2, 3)])
    sink.flush()
    tracemalloc.start()
    try:
        sink.ingest([removed(2)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    sink.flush()
    assert rec.maps()[-1]["block_hashes"] == [3, 2]
    assert len(sink._ranks[0].published) == n + 1


def test_parent_first_removals_of_a_long_chain_cost_one_pass() -> None:
    """8,000 removals of a chain, parent first: the first cascades the rest; every later one
    is a known-gone hash (the map is never walked)."""
    sink, rec = closed_sink(native=False)
    rs = sink._ranks[0]
    rs.published = NoScan()
    chain = list(range(1, 8001))
    sink.ingest([stored(None, *chain)])
    sink.ingest([removed(h) for h in chain])
    sink.flush()
    out = rec.maps()[-1]["block_hashes"]
    assert out == chain[::-1]
    assert rs.published == {} and rs.kids == {}
    stats = sink.stats()
    assert stats["cascade_removes"] == 7999 and stats["unknown_removes_suppressed"] == 7999


def test_branch_state_returns_to_the_one_child_form() -> None:
    """kids holds a parent's one child as a hash and only a branch as a set; removing a branch
    leaf puts the one-child form back (both loops keep the same state)."""
    sink, _ = closed_sink()
    rs = sink._ranks[0]
    sink.ingest([stored(None, 1, 2), stored(1, 3)])
    assert rs.kids == {1: {2, 3}}
    sink.ingest([removed(3)])
    assert rs.kids == {1: 2}
    sink.ingest([removed(2)])
    assert rs.kids == {} and rs.published == {1: None}


# ---- bounded maps: O(1) eviction ----------------------------------------------------------------


def test_eviction_order_is_oldest_first_skips_stale_keys_and_stays_bounded() -> None:
    d: dict[int, None] = {}
    order = EvictionOrder()
    for k in range(10):
        d[k] = None
        order.added(d, k)
    del d[0], d[1]  # deleted by the owner (or compiled code) directly: stale in the order
    assert order.evict_oldest(d) == 2 and 2 not in d
    for k in range(10, 10_000):  # keep 8 live keys, delete the rest behind the order's back
        d[k] = None
        order.added(d, k)
        d.pop(k - 8, None)
    assert len(order) < 100  # not ~10,000: the stale keys are dropped now and then
    assert order.evict_oldest(d) == 9992
    assert EvictionOrder().evict_oldest({}) is None


def test_the_suppressed_map_evicts_at_its_cap_without_walking_it() -> None:
    """Python loop: partial blocks past ``max_suppressed`` evict the oldest, counted, while
    the map refuses to be walked (``pop(next(iter(d)))`` would walk it)."""
    sink, _ = closed_sink(native=False, max_suppressed=100)
    rs = sink._ranks[0]
    rs.suppressed = NoScan()
    sink.ingest([stored(None, h, n_tokens=1) for h in range(1, 351)])
    assert len(rs.suppressed) == 100 and set(dict.keys(rs.suppressed)) == set(range(251, 351))
    assert sink.stats()["suppressed_evicted"] == 250


def test_block_names_evict_their_oldest_without_walking_the_tables() -> None:
    names = BlockNames(BS, max_entries=50)
    names._by_content = NoScan()
    names._by_key = NoScan()
    for h in range(1, 201):
        names.observe(0, [{"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
                           "token_ids": [h, 0], "block_size": BS}])
    assert len(names._by_content) == 50
    assert dict.get(names._by_content, (None, (200, 0), None)) == 200
    assert dict.get(names._by_content, (None, (150, 0), None)) is None
    for base in (1000, 2000):  # two keys per named block: 100 keys for a table of 50
        for h in range(151, 201):
            learned: list[int] = []
            names.extend([h, 0], [base + h], learned)
            assert learned == [h]
    assert len(names._by_key) == 50
    assert names.hash_of_key(2151) == 151 and names.hash_of_key(1200) is None


@needs_native
@pytest.mark.parametrize("closed", [True, False])
def test_removals_stay_compiled_while_partial_blocks_are_suppressed(
        closed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a partial block suppressed, single-hash removals of published leaves and of a hash
    never published (prefix-closed) and multi-hash removals mixing suppressed and published
    hashes (open stream) are taken by the compiled loop, which drops and counts the
    suppressed and unknown ones as the Python loop does."""
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64, native=True, prefix_closed=closed)
    python_events: list[Any] = []
    python_loop = sink._ingest_locked
    monkeypatch.setattr(sink, "_ingest_locked",
                        lambda evs: (python_events.extend(evs), python_loop(evs)))
    sink.ingest([stored(None, 1, 2, 3), stored(None, 9, n_tokens=1), stored(None, 8)])
    # The partial store alone (no full block before it): a chain, a chain with a partial
    # last block, the one-block stores are the compiled loop's.
    assert [ev["data"]["blocks"][0]["block_hash"] for ev in python_events] == [9]
    python_events.clear()
    removals = ([removed(3), removed(9), removed(2), removed(77)] if closed
                else [removed(3, 9), removed(2, 5)])
    sink.ingest(removals)
    assert python_events == []
    sink.flush()
    assert rec.maps()[-1] == {"type": "BlockRemoved",
                              "block_hashes": [3, 2] if closed else [3, 2, 5],
                              "medium": "GPU"}
    assert sink._ranks[0].suppressed == {}
    stats = sink.stats()
    assert stats["partial_removes_suppressed"] == 1
    assert stats["unknown_removes_suppressed"] == (1 if closed else 0)


# ---- discard_events --------------------------------------------------------------------------


@pytest.mark.parametrize("encoded", [True, False])
def test_after_discard_events_the_batch_publishes_events_only(encoded: bool) -> None:
    """Both loops: what follows a discard is published as events (maps, or encoded runs in an
    encoded batch for a publisher that takes them), and the discard counts every event."""
    rec = Recorder(encoded)
    sink = KvEventSink(rec, block_size=BS, window_size=64)
    sink.ingest([stored(None, 1), stored(None, 2), stored(None, 3)])  # three separate stores
    sink.discard_events()
    assert sink.stats()["discarded_events"] == 3
    sink.ingest([stored(None, 4), stored(None, 5), stored(5, 6)])
    sink.flush()
    (batch,) = rec.items
    # A plain list holds maps only; encoded runs come only inside an encoded batch.
    assert type(batch) is EncodedBatch or all(type(e) is dict for e in batch)
    if not encoded:
        assert all(type(e) is dict for e in batch)
    assert [(e["type"], e["block_hashes"]) for e in rec.maps()] == [
        ("BlockStored", [4]), ("BlockStored", [5, 6])]
    stats = sink.stats()
    assert stats["blocks_stored"] == 6 and stats["batches_published"] == 1
