"""KvEventSink: TRT-LLM dicts and V2 hooks in, vLLM wire batches out (checked independently)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from _kvwire import AllBlocksCleared, BlockRemoved, BlockStored, decode, free_port, join_sub, recv
from _loops import both_implementations

from kvbm_plugin.consolidator_config import Endpoint, PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.events.source import attach_event_source
from kvbm_plugin.naming.names import radix_key_hash
from kvbm_plugin.wire.events import WireFormatError
from kvbm_plugin.wire.publisher import EventPublisher, ZmqEventPublisher

U64 = 1 << 64


ingest_loop = both_implementations("event_sink")  # every test: compiled and Python loops


class Capture(EventPublisher):
    """Records batches; encodes them with the real encoder so the decoder checks the bytes."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[tuple[int, list[Any]]] = []
        self.fail = fail
        self.closed = 0

    def publish(self, events: Sequence[dict[str, Any]], data_parallel_rank: int | None = None
                ) -> bool:
        from kvbm_plugin.wire.events import encode_payload

        batch = decode(encode_payload(1.0, events, data_parallel_rank or 0))
        self.batches.append((batch.data_parallel_rank, batch.events))
        return not self.fail

    def shutdown(self, timeout: float = 5.0) -> None:
        self.closed += 1


def toks(*ids: int) -> list[dict[str, Any]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]


def stored(parent: int | None, *blocks: tuple[int, list[int]], window: int = 64,
           rank: int | None = None, eid: int = 0) -> dict[str, Any]:
    ev: dict[str, Any] = {"event_id": eid, "window_size": window, "data": {
        "type": "stored", "parent_hash": parent,
        "blocks": [{"type": "stored_block", "block_hash": h, "tokens": toks(*t),
                    "cache_level": 0, "priority": 35} for h, t in blocks]}}
    if rank is not None:
        ev["attention_dp_rank"] = rank
    return ev


def removed(*hashes: int, window: int = 64, rank: int | None = None) -> dict[str, Any]:
    ev: dict[str, Any] = {"event_id": 0, "window_size": window,
                          "data": {"type": "removed", "block_hashes": list(hashes)}}
    if rank is not None:
        ev["attention_dp_rank"] = rank
    return ev


def sink_with(block_size: int = 2, **kw: Any) -> tuple[KvEventSink, Capture]:
    cap = Capture()
    return KvEventSink(cap, block_size=block_size, strict=True, **kw), cap


@pytest.mark.parametrize(("u64", "wire"), [
    (0, 0), ((1 << 63) - 1, (1 << 63) - 1), (1 << 63, -(1 << 63)), (U64 - 1, -1)])
def test_signed_conversion_of_hashes_and_parent(u64: int, wire: int) -> None:
    sink, cap = sink_with()
    sink.ingest([stored(u64, (u64, [1, 2])), removed(u64)])
    assert sink.flush()
    assert cap.batches == [(0, [
        BlockStored(block_hashes=[wire], parent_block_hash=wire, token_ids=[1, 2], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[wire], medium="GPU")])]


def test_hash_out_of_range_is_a_clear_error(expect_errors) -> None:
    sink, _ = sink_with()
    with pytest.raises(WireFormatError, match=r"block_hash=18446744073709551616 exceeds"):
        sink.ingest([stored(None, (U64, [1, 2]))])
    lenient = KvEventSink(Capture(), block_size=2)
    lenient.ingest([stored(None, (U64, [1, 2])), stored(None, (3, [1, 2]))])
    assert lenient.stats()["malformed_events"] == 1
    assert lenient.stats()["blocks_stored"] == 1  # the good event still goes through
    assert expect_errors.wait_for("exceeds 64 bits")


def test_every_field_end_to_end_over_zmq() -> None:
    port = free_port()
    pub = ZmqEventPublisher(PublisherSettings(topic="t"), Endpoint("tcp", port=port),
                            data_parallel_rank=2)
    sink = KvEventSink(pub, block_size=2, data_parallel_rank=2, strict=True)
    ctx = zmq.Context()
    try:
        sub, _ = join_sub(ctx, f"tcp://127.0.0.1:{port}", lambda: pub.publish([]))
        sink.ingest([stored(None, (10, [1, 2]), (U64 - 5, [3, 4])), removed(10)])
        sink.clear_all()
        assert sink.flush()
        frames = recv(sub)
        assert frames[0] == b"t"
        batch = decode(frames[2])
        assert batch.data_parallel_rank == 2 and isinstance(batch.ts, float)
        assert batch.events == [
            BlockStored(block_hashes=[10, -5], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                        block_size=2, lora_id=None, medium="GPU", lora_name=None),
            BlockRemoved(block_hashes=[10], medium="GPU"),
            AllBlocksCleared()]
    finally:
        sink.shutdown()
        ctx.destroy(linger=0)


def test_partial_block_store_and_remove_suppressed() -> None:
    sink, cap = sink_with()
    # run stops at the first partial block: 3 is partial, 4 after it is never published
    sink.ingest([stored(None, (1, [1, 2]), (2, [3, 4]), (3, [5]), (4, [6, 7]))])
    sink.ingest([removed(3, 2, 4)])
    sink.flush()
    assert cap.batches == [(0, [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=2, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[2], medium="GPU")])]
    stats = sink.stats()
    assert stats["partial_blocks_suppressed"] == 2
    assert stats["partial_removes_suppressed"] == 2


def test_window_filter_largest_or_configured() -> None:
    sink, cap = sink_with()
    sink.ingest([
        {"event_id": 0, "window_size": 32, "data": {"type": "created",
                                                    "num_blocks_per_cache_level": [8, 0]}},
        {"event_id": 1, "window_size": 128, "data": {"type": "created",
                                                     "num_blocks_per_cache_level": [8, 0]}},
        stored(None, (1, [1, 2]), window=32), stored(None, (2, [1, 2]), window=128),
        removed(1, window=32), removed(2, window=128)])
    sink.flush()
    assert [type(e).__name__ for e in cap.batches[0][1]] == ["BlockStored", "BlockRemoved"]
    assert cap.batches[0][1][0].block_hashes == [2]
    assert sink.stats()["window_filtered"] == 1
    assert sink.stats()["window_removes_filtered"] == 1
    assert sink.stats()["created_events"] == 2
    pinned, cap2 = sink_with(window_size=32)
    pinned.ingest([stored(None, (1, [1, 2]), window=32), stored(None, (2, [1, 2]), window=128)])
    pinned.flush()
    assert cap2.batches[0][1][0].block_hashes == [1] and len(cap2.batches[0][1]) == 1


def test_chain_coalescing_order_and_counted_updates() -> None:
    sink, cap = sink_with()
    sink.ingest([
        stored(None, (1, [1, 2])), stored(1, (2, [3, 4])),  # one chain: coalesced
        removed(9), removed(8),                             # consecutive removes: one event
        stored(5, (6, [5, 6])),                             # another chain
        {"event_id": 7, "window_size": 64, "data": {"type": "updated", "block_hash": 6,
         "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0}}},
        stored(6, (7, [7, 8]))])
    sink.flush()
    events = cap.batches[0][1]
    assert events == [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                    block_size=2, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[9, 8], medium="GPU"),
        BlockStored(block_hashes=[6, 7], parent_block_hash=5, token_ids=[5, 6, 7, 8],
                    block_size=2, lora_id=None, medium="GPU", lora_name=None)]
    assert sink.stats()["updated_events"] == 1
    assert sink.stats()["blocks_stored"] == 4 and sink.stats()["stores"] == 2


def test_removals_survive_publisher_caps_and_losses_are_counted() -> None:
    # many removals in one iteration: nothing dropped by any cap
    sink, cap = sink_with()
    sink.ingest([removed(*range(i * 100, i * 100 + 100)) for i in range(100)])
    sink.flush()
    assert sum(len(e.block_hashes) for e in cap.batches[0][1]) == 10_000
    # a publisher that loses the batch: flush says so and the sink counts it
    lossy = Capture(fail=True)
    sink2 = KvEventSink(lossy, block_size=2)
    sink2.ingest([removed(1)])
    assert sink2.flush() is False
    assert sink2.stats()["batches_lost"] == 1


def test_one_batch_per_rank_and_nothing_when_empty() -> None:
    sink, cap = sink_with()
    assert sink.flush() is True and cap.batches == []
    sink.ingest([removed(1, rank=1), removed(2), removed(3, rank=1)])
    sink.flush()
    assert sorted((r, [e.block_hashes for e in evs]) for r, evs in cap.batches) == [
        (0, [[2]]), (1, [[1, 3]])]


def test_shutdown_flushes_and_is_idempotent() -> None:
    sink, cap = sink_with()
    sink.ingest([removed(1)])
    sink.shutdown()
    sink.close()
    assert cap.closed == 1 and len(cap.batches) == 1


# ---- V2 hooks ------------------------------------------------------------------------------

ROOT = SimpleNamespace(ordinal=-1)


def key(n: int, hi: int = 0) -> bytes:
    return hi.to_bytes(8, "big") + n.to_bytes(24, "big")


def block(k: bytes, tokens: list[int], prev: Any, storage: list[Any] | None = None) -> Any:
    b = SimpleNamespace(key=k, tokens=tokens, prev=prev,
                        ordinal=getattr(prev, "ordinal", -1) + 1)
    if storage is not None:
        b.storage = storage
    return b


def test_radix_key_is_first_eight_bytes_signed() -> None:
    assert radix_key_hash(b"\xff" * 8 + b"\0" * 24) == -1
    assert radix_key_hash(b"\x80" + b"\0" * 31) == -(1 << 63)
    assert radix_key_hash(b"\x7f" + b"\xff" * 7 + b"\x01" * 24) == (1 << 63) - 1


def test_v2_hooks_store_coalesce_partial_and_remove() -> None:
    sink, cap = sink_with()
    k1, k2, k3 = key(1, 5), key(2, U64 - 2), key(3, 7)
    b1 = block(k1, [1, 2], ROOT)
    b2 = block(k2, [3, 4], b1)
    b3 = block(k3, [5], b2)  # partial
    sink.add_created_event([10, 0])
    for b in (b1, b2, b3):
        sink.add_stored_block_event_from_block(b)
    sink.add_updated_event(k1, cache_level=None)
    sink.flush_iteration_events()
    sink.add_removed_event([k3, k2])
    sink.add_removed_event(k2)  # already removed: suppressed, never a second remove
    sink.flush_iteration_events()
    assert cap.batches == [
        (0, [BlockStored(block_hashes=[5, -2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                         block_size=2, lora_id=None, medium="GPU", lora_name=None)]),
        (0, [BlockRemoved(block_hashes=[-2], medium="GPU")])]
    stats = sink.stats()
    assert stats["partial_blocks_suppressed"] == 1
    assert stats["partial_removes_suppressed"] == 1
    assert stats["unknown_removes_suppressed"] == 1
    assert stats["updated_events"] == 1 and stats["created_events"] == 1
    assert sink.get_latest_events() == [] and sink.get_latest_events(0, 10) == []


def test_v2_window_filter_by_layer_group_storage() -> None:
    sink, cap = sink_with()
    sink.set_layer_group_window_sizes({0: 128, 1: 64})
    page = object()
    held = block(key(1, 1), [1, 2], ROOT, storage=[lambda: page, None])
    small_only = block(key(2, 2), [3, 4], ROOT, storage=[None, lambda: page])
    sink.add_stored_block_event_from_block(held)
    sink.add_stored_block_event_from_block(small_only)
    sink.add_removed_life_cycle_event(key(1, 1), 1)  # non-routing group: filtered
    sink.add_removed_event(key(2, 2))  # never published: suppressed
    sink.add_removed_life_cycle_event(key(1, 1), 0)  # routing group: published
    sink.flush()
    assert cap.batches == [(0, [
        BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[1], medium="GPU")])]
    assert sink.stats()["window_filtered"] == 1
    assert sink.stats()["window_removes_filtered"] == 1


def test_v2_add_stored_event_and_hex_or_int_removal() -> None:
    sink, cap = sink_with()
    blocks = [SimpleNamespace(block_hash=(1 << 63) + 1,
                              tokens=[SimpleNamespace(token_id=1), SimpleNamespace(token_id=2)]),
              SimpleNamespace(block_hash=key(9, 9).hex(), tokens=[3, 4])]
    sink.add_stored_event(None, blocks, layer_group_id=None)
    sink.add_removed_event(key(9, 9).hex())
    sink.add_removed_event((1 << 63) + 1)
    sink.flush()
    assert cap.batches == [(0, [
        BlockStored(block_hashes=[-(1 << 63) + 1, 9], parent_block_hash=None,
                    token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium="GPU",
                    lora_name=None),
        BlockRemoved(block_hashes=[9, -(1 << 63) + 1], medium="GPU")])]


class FakeV2EventManager:
    """TRT-LLM's V2 KVCacheEventManager surface (records calls)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._window_size_by_layer_group = {0: 64}

    def add_stored_block_event_from_block(self, block: Any) -> None:
        self.calls.append("stored")

    def add_removed_event(self, block_hashes: Any) -> None:
        self.calls.append("removed")


def test_attach_v2_tee_feeds_both_and_detaches() -> None:
    sink, cap = sink_with()
    em = FakeV2EventManager()
    manager = SimpleNamespace(event_manager=em)
    source = attach_event_source(manager, sink)
    assert source.kind == "v2-hooks"
    em.add_stored_block_event_from_block(block(key(1, 1), [1, 2], ROOT))
    em.add_removed_event(key(1, 1))
    assert em.calls == ["stored", "removed"]
    sink.flush()
    assert [type(e) for e in cap.batches[0][1]] == [BlockStored, BlockRemoved]
    source.detach()
    em.add_removed_event(key(1, 1))
    assert em.calls[-1] == "removed" and sink.stats()["events_in"] == 0


def test_attach_buffered_tee_serializes_and_drains() -> None:
    sink, cap = sink_with()
    pending = [["raw-stored"], []]

    class Manager:
        def get_latest_events(self, timeout_ms: int | None = None) -> list[Any]:
            return pending.pop(0) if pending else []

    def serialize(raw: list[Any]) -> list[dict[str, Any]]:
        assert raw == ["raw-stored"]
        return [stored(None, (1, [1, 2]))]

    manager = Manager()
    source = attach_event_source(manager, sink, serialize=serialize)
    assert source.kind == "buffered"
    assert manager.get_latest_events(0) == ["raw-stored"]  # TRT-LLM's own drain still gets it
    assert source.poll() == 0
    sink.flush()
    assert cap.batches[0][1][0].block_hashes == [1]
    source.detach()
    assert "get_latest_events" not in manager.__dict__
    with pytest.raises(ValueError, match="event_buffer_max_size"):
        attach_event_source(SimpleNamespace(), sink)


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_size=0"):
        KvEventSink(Capture(), block_size=0)
    with pytest.raises(ValueError, match="window_size=-1"):
        KvEventSink(Capture(), block_size=2, window_size=-1)


def test_attach_buffered_tee_counts_events_it_cannot_serialize(expect_errors) -> None:
    sink, cap = sink_with()

    class Manager:
        def get_latest_events(self, timeout_ms: int | None = None) -> list[Any]:
            return ["raw-1", "raw-2"]

    def serialize(raw: list[Any]) -> list[dict[str, Any]]:
        raise RuntimeError("unknown event class")

    manager = Manager()
    source = attach_event_source(manager, sink, serialize=serialize)
    assert manager.get_latest_events(0) == ["raw-1", "raw-2"]  # TRT-LLM's pull path unharmed
    assert sink.stats()["malformed_events"] == 2
    source.detach()
    no_serializer = attach_event_source(Manager(), sink)
    no_serializer.poll()
    assert sink.stats()["malformed_events"] == 4
    assert expect_errors.wait_for("not published")


def test_flush_survives_a_publisher_that_raises(expect_errors) -> None:
    class Raising(Capture):
        def publish(self, events: Sequence[dict[str, Any]],
                    data_parallel_rank: int | None = None) -> bool:
            raise RuntimeError("transport plugin bug")

    sink = KvEventSink(Raising(), block_size=2)
    sink.ingest([stored(None, (1, [1, 2]))])
    assert sink.flush() is False  # on the executor thread: lost and counted, never raised
    stats = sink.stats()
    assert stats["batches_lost"] == 1 and stats["pending_events"] == 0
    assert expect_errors.wait_for("transport plugin bug")


def test_attach_v2_tee_never_raises_into_the_kv_cache_manager(monkeypatch, expect_errors) -> None:
    sink, cap = sink_with()

    def broken(block_hashes: Any) -> None:
        raise RuntimeError("sink bug")

    em = FakeV2EventManager()
    attach_event_source(SimpleNamespace(event_manager=em), sink)
    monkeypatch.setattr(sink, "add_removed_event", broken)
    em.add_stored_block_event_from_block(SimpleNamespace(key=b"short", tokens=[1, 2], prev=ROOT))
    assert sink.stats()["malformed_events"] == 1  # strict sink: raised, counted once
    em2 = FakeV2EventManager()
    attach_event_source(SimpleNamespace(event_manager=em2), sink)  # tees the broken hook
    em2.add_removed_event(key(1, 1))
    assert em.calls == ["stored"] and em2.calls == ["removed"]
    assert sink.stats()["malformed_events"] == 2
    assert expect_errors.wait_for("event not published")


def test_stats_read_a_snapshot_of_the_ranks() -> None:
    sink, _ = sink_with()

    class AddsARankWhenRead:
        @property
        def pending(self) -> int:
            sink._ranks.setdefault(7, sink._ranks[0])  # an ingest on another thread, meanwhile
            return 0

    sink._ranks[1] = AddsARankWhenRead()  # type: ignore[assignment]
    assert sink.stats()["pending_events"] == 0


# ---- a store is checked whole before it touches the batch -------------------------------------

def _stored_raw(parent: int | None, *blocks: tuple[int, list[Any]], **data: Any) -> dict[str, Any]:
    """A stored event whose tokens are given as raw token dicts (to make them malformed)."""
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent, **data,
        "blocks": [{"type": "stored_block", "block_hash": h, "tokens": t, "cache_level": 0,
                    "priority": 35} for h, t in blocks]}}


GOOD_100 = BlockStored(block_hashes=[100], parent_block_hash=None, token_ids=[1, 2],
                       block_size=2, lora_id=None, medium="GPU", lora_name=None)


@pytest.mark.parametrize("bad_block", [
    (200, [{"token_id": 3}, {"type": "unique_token"}]),  # no token_id: one-block fast path
    (200, [{"token_id": 3}, {"token_id": 1 << 32}]),  # not a u32
    (200, [{"token_id": 3}, {"token_id": -1}]),
    (200, [{"token_id": 3}, {"token_id": 2.0}]),
    (200, [{"token_id": 3}, {"token_id": True}]),
], ids=["missing", "over-u32", "negative", "float", "bool"])
def test_a_bad_token_leaves_the_batched_store_intact(bad_block: tuple[int, list[Any]],
                                                     expect_errors) -> None:
    """A store extending the previous block whose tokens turn out malformed must not append its
    hash (or any token) to that block's BlockStored, nor count a store."""
    cap = Capture()
    sink = KvEventSink(cap, block_size=2)
    sink.ingest([stored(None, (100, [1, 2])), _stored_raw(100, bad_block)])
    sink.ingest([_stored_raw(100, (200, toks(3, 4)), bad_block)])  # the multi-block path
    assert sink.flush()
    assert cap.batches == [(0, [GOOD_100])]
    stats = sink.stats()
    assert (stats["stores"], stats["blocks_stored"], stats["malformed_events"]) == (1, 1, 2)
    assert expect_errors.wait_for("malformed KV event not published")


def test_a_bad_token_raises_in_strict_mode_and_changes_nothing() -> None:
    sink, cap = sink_with()
    sink.ingest([stored(None, (100, [1, 2]))])
    with pytest.raises(WireFormatError, match="token_id"):
        sink.ingest([_stored_raw(100, (200, [{"token_id": 3}, {"type": "unique_token"}]))])
    assert sink.flush()
    assert cap.batches == [(0, [GOOD_100])]
    assert sink.stats()["stores"] == 1


def test_a_malformed_store_suppresses_nothing(expect_errors) -> None:
    """A store with a partial block and a malformed later hash is rejected whole: its partial
    block is not remembered as suppressed, and its full blocks are not published."""
    cap = Capture()
    sink = KvEventSink(cap, block_size=2)
    sink.ingest([stored(None, (100, [1, 2]))])
    sink.ingest([_stored_raw(100, (1, toks(1, 2)), (2, toks(3)), ("x", toks(5)))])
    sink.ingest([removed(2)])
    assert sink.flush()
    assert cap.batches == [(0, [GOOD_100, BlockRemoved(block_hashes=[2], medium="GPU")])]
    stats = sink.stats()
    assert stats["partial_blocks_suppressed"] == 0 and stats["malformed_events"] == 1
    assert expect_errors.wait_for("malformed KV event not published")


class _Ext:
    """Stands in for a msgpack ``Timestamp`` / ``ExtType``: hashable, comparable, not an int."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ext)

    def __hash__(self) -> int:
        return 7


@pytest.mark.parametrize("lora_id", ["a", 1.5, True, -1, 1 << 64, _Ext()],
                         ids=["str", "float", "bool", "negative", "u64-overflow", "ext"])
def test_a_store_with_a_bad_lora_id_is_rejected(lora_id: Any, expect_errors) -> None:
    """lora_id is None or a u64 (TRT-LLM's task id): anything else would fail the encoder later
    and lose the whole batch; here it loses only its own event, counted."""
    cap = Capture()
    sink = KvEventSink(cap, block_size=2)
    sink.ingest([stored(None, (100, [1, 2])),
                 _stored_raw(100, (200, toks(3, 4)), lora_id=lora_id),
                 _stored_raw(100, (300, toks(3, 4)), (301, toks(5, 6)), lora_id=lora_id),
                 _stored_raw(None, (7, toks(1, 1)), lora_id=5),
                 _stored_raw(7, (8, toks(1, 1)), lora_id=0)])
    assert sink.flush()  # encodes: nothing odd reached the batch
    assert cap.batches == [(0, [
        GOOD_100,
        BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=[1, 1], block_size=2,
                    lora_id=5, medium="GPU", lora_name="lora-5"),
        # task id 0 is adapter 0, not the base model: its own event, under its name
        BlockStored(block_hashes=[8], parent_block_hash=7, token_ids=[1, 1], block_size=2,
                    lora_id=0, medium="GPU", lora_name="lora-0")])]
    assert sink.stats()["malformed_events"] == 2
    assert expect_errors.wait_for("malformed KV event not published")


def test_token_ids_of_any_other_type_are_rejected(expect_errors) -> None:
    cap = Capture()
    sink = KvEventSink(cap, block_size=2)
    sink.ingest([_stored_raw(None, (1, [{"token_id": _Ext()}, {"token_id": 1}])),
                 _stored_raw(None, (2, [{"token_id": "1"}, {"token_id": 1}])),
                 _stored_raw(None, (3, [{"token_id": 0}, {"token_id": (1 << 32) - 1}]))])
    assert sink.flush()
    assert cap.batches == [(0, [BlockStored(
        block_hashes=[3], parent_block_hash=None, token_ids=[0, (1 << 32) - 1], block_size=2,
        lora_id=None, medium="GPU", lora_name=None)])]
    assert sink.stats()["malformed_events"] == 2
    assert expect_errors.wait_for("malformed KV event not published")


# ---- dp ranks are bounded -----------------------------------------------------------------------

def test_dp_ranks_beyond_the_bound_are_refused_and_counted(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """Each dp rank costs state for the sink's lifetime: a stream of bogus ranks must not grow
    it. Ranks below max_dp_ranks, the sink's own and those with a publisher are accepted."""
    cap, extra = Capture(), Capture()
    sink = KvEventSink(cap, block_size=2, data_parallel_rank=9, max_dp_ranks=4,
                       rank_publishers={12: extra})
    events = [removed(1, rank=r) for r in (0, 3, 9, 12)]
    events += [removed(2, rank=r) for r in range(4, 2000) if r not in (9, 12)]
    with caplog.at_level("WARNING", logger="kvbm_plugin.event_sink"):
        sink.ingest(events)
    assert sorted(sink._ranks) == [0, 3, 9, 12]
    stats = sink.stats()
    assert stats["unknown_dp_rank_events"] == len(events) - 4
    assert stats["blocks_removed"] == 4 and stats["malformed_events"] == 0
    assert 0 < sum("attention_dp_rank" in r.getMessage() for r in caplog.records) < 5
    assert sink.flush()
    assert sorted(rank for rank, _ in cap.batches + extra.batches) == [0, 3, 9, 12]
    strict = KvEventSink(Capture(), block_size=2, max_dp_ranks=4, strict=True)
    with pytest.raises(WireFormatError, match="attention_dp_rank=4"):
        strict.ingest([removed(1, rank=4)])
    with pytest.raises(ValueError, match="max_dp_ranks"):
        KvEventSink(Capture(), block_size=2, max_dp_ranks=0)


def test_the_default_rank_bound() -> None:
    from kvbm_plugin.wire.events import MAX_DP_RANKS

    sink = KvEventSink(Capture(), block_size=2)
    sink.ingest([removed(1, rank=MAX_DP_RANKS - 1), removed(1, rank=MAX_DP_RANKS)])
    assert sink.stats()["unknown_dp_rank_events"] == 1
    assert sorted(sink._ranks) == [0, MAX_DP_RANKS - 1]
