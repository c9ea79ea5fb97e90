"""The compiled ingest loop against the Python one: same bytes out, same counters, on any input.

The Python loop in ``KvEventSink._ingest_locked`` is the reference. Hypothesis draws streams of
TRT-LLM event dicts (common and odd shapes, edge-value and invalid hashes, partial blocks,
window changes, other ranks, malformed events) split over several ingest calls and flushes;
both sinks must publish byte-identical payloads and report identical counters.
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Sequence
from types import MappingProxyType, SimpleNamespace
from typing import Any

import msgpack
import pytest
from _depth import depths, run_examples
from hypothesis import strategies as st

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import NATIVE, ConfigError, PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.naming.names import radix_key_hash
from kvbm_plugin.wire.events import (
    MAX_DP_RANKS,
    EncodedEvents,
    WireFormatError,
    encode_payload,
    events_as_maps,
)
from kvbm_plugin.wire.publisher import EventPublisher

BS = 2  # block size: small, so partial and oversized blocks are easy to draw
HASHES = [0, 1, 2, 3, 5, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -(1 << 63),
          1 << 64, -(1 << 63) - 1, "7", True, None, 2.0, "00ff" * 16]
VALID = [0, 1, 2, 3, 5, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, "80" * 32]


class Recorder(EventPublisher):
    """Keeps each batch as the bytes the real encoder makes of it (fixed timestamp).

    It takes encoded batches (``EncodedEvents`` runs, written by the compiled batch) as the ZMQ
    publisher does, so the payloads compared hold the compiled writer's own bytes, and keeps
    each batch as maps (the runs decoded) for the tests that read it.
    """

    accepts_encoded_events = True

    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.payloads: list[bytes] = []
        self.batches: list[list[dict[str, Any]]] = []
        self.items: list[list[Any]] = []  # as handed over: maps and EncodedEvents runs

    def publish(self, events: Sequence[dict[str, Any]], data_parallel_rank: int | None = None
                ) -> bool:
        self.items.append(list(events))
        self.batches.append(events_as_maps(events))
        self.payloads.append(encode_payload(1.0, events, data_parallel_rank or 0))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


class Collides:
    """A dict key with the hash of ``name``: a lookup of ``name`` in a dict holding it runs
    this key's ``__eq__`` (``on_eq``, which may change anything the caller holds)."""

    def __init__(self, name: str, on_eq: Any = None) -> None:
        self.name = name
        self.on_eq = on_eq

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        if self.on_eq is not None:
            self.on_eq()
        return other is self

    def __repr__(self) -> str:
        return f"Collides({self.name!r})"


# Token ids: small ones (runs coalesce on equal content) and each msgpack int form's edges.
TOKEN_IDS = st.one_of(st.integers(0, 9), st.sampled_from(
    [127, 128, 255, 256, 65535, 65536, (1 << 32) - 1]))


def hashes(valid_only: bool = False) -> st.SearchStrategy[Any]:
    return st.sampled_from(VALID if valid_only else HASHES)


@st.composite
def tokens(draw: st.DrawFn) -> list[Any]:
    n = draw(st.sampled_from([BS, BS, BS, BS - 1, BS + 1, 0]))
    out: list[Any] = [{"type": "unique_token", "token_id": draw(st.integers(0, 300)),
                       "token_extra_id": 0} for _ in range(n)]
    if out and draw(st.integers(0, 15)) == 0:  # the odd malformed token
        out[draw(st.integers(0, n - 1))] = draw(st.sampled_from(
            [{"token_id": "x"}, {"type": "unique_token"}, 7, {"token_id": 1.5},
             {"token_id": 1 << 32}, {"token_id": -1}, {"token_id": True},
             {"token_id": msgpack.Timestamp(1, 0)}, {"token_id": (1 << 32) - 1},
             {Collides("token_id"): 0, "token_id": 1}]))
    return out


@st.composite
def event(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["stored"] * 6 + ["removed"] * 4
                                + ["created", "updated", "bogus", "broken"]))
    ev: dict[str, Any] = {"event_id": 0}
    window = draw(st.sampled_from([64] * 8 + [None, 32, 128, "64"]))
    if window is not None or draw(st.booleans()):
        ev["window_size"] = window
    rank = draw(st.sampled_from([None] * 8 + [0, 1, -1, MAX_DP_RANKS, 1 << 40]))
    if rank is not None or draw(st.integers(0, 7)) == 0:
        ev["attention_dp_rank"] = rank
    if kind == "stored":
        n_blocks = draw(st.sampled_from([1, 1, 1, 1, 2, 3, 5, 0]))  # (a prompt: several)
        data: dict[str, Any] = {"type": "stored", "parent_hash": draw(hashes()),
                                "blocks": [{"type": "stored_block",
                                            "block_hash": draw(hashes(valid_only=True))
                                            if draw(st.integers(0, 9)) else draw(hashes()),
                                            "tokens": draw(tokens()), "cache_level": 0,
                                            "priority": 35} for _ in range(n_blocks)]}
        lora = draw(st.sampled_from(["absent", None, 0, 3, "a", -1, 1 << 64, (1 << 64) - 1,
                                     True, msgpack.ExtType(1, b"")]))
        if lora != "absent":
            data["lora_id"] = lora
        for block in data["blocks"]:  # newer serializers: LoRA, multimodal keys, salt per block
            extra = draw(st.sampled_from(["none"] * 6 + ["lora", "mm", "salt", "salt-id",
                                                         "empty-mm"]))
            if extra == "lora":
                block["lora_id"] = draw(st.sampled_from([None, 0, 4]))
            elif extra == "mm":
                block["mm_keys"] = [{"type": "mm_key", "hash": "0123456789abcdef",
                                     "start_offset": 1}]
            elif extra == "salt":
                block["cache_salt"] = draw(st.sampled_from([None, "tenant-a"]))
            elif extra == "salt-id":  # the C++ request's spelling of the salt
                block["cache_salt_id"] = draw(st.sampled_from([None, 0, 7, (1 << 64) - 1]))
            elif extra == "empty-mm":
                block["mm_keys"] = []
        if draw(st.integers(0, 19)) == 0:
            data["blocks"] = tuple(data["blocks"])
        if n_blocks and draw(st.integers(0, 19)) == 0:
            del data["blocks"][0]["block_hash"]
        if draw(st.integers(0, 29)) == 0:  # a key object that is not a str
            data = {Collides("parent_hash"): None, **data}
    elif kind == "removed":
        raw: Any = [draw(hashes(valid_only=True)) if draw(st.integers(0, 9)) else draw(hashes())
                    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3, 0])))]
        if draw(st.integers(0, 19)) == 0:
            raw = tuple(raw)
        data = {"type": "removed", "block_hashes": raw}
    elif kind == "created":
        data = {"type": "created", "num_blocks_per_cache_level": [8, 0]}
    elif kind == "updated":
        data = {"type": "updated", "block_hash": 1, "cache_level": {"old_value": 0,
                                                                    "new_value": 1}}
    elif kind == "bogus":
        data = {"type": "bogus"}
    else:
        return draw(st.sampled_from([{"event_id": 1}, {"data": None}, {"data": {}}, 42,
                                     MappingProxyType({"data": {"type": "removed",
                                                                "block_hashes": [9]}})]))
    ev["data"] = data
    return ev


@st.composite
def chained(draw: st.DrawFn) -> list[Any]:
    """Mostly well-formed decode traffic: one-block stores whose parent is often the last
    stored hash (so runs coalesce), removals in between, now and then anything at all."""
    out: list[Any] = []
    last = None
    for _ in range(draw(st.integers(1, 30))):
        pick = draw(st.integers(0, 9))
        if pick < 5:
            h = draw(st.sampled_from(VALID))
            parent = last if draw(st.integers(0, 3)) else draw(hashes())
            data = {"type": "stored", "parent_hash": parent, "blocks": [{
                "type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                "tokens": [{"type": "unique_token", "token_id": draw(TOKEN_IDS),
                            "token_extra_id": 0} for _ in range(BS)]}]}
            out.append({"event_id": 0, "window_size": 64, "data": data})
            last = h if isinstance(h, str) or h < (1 << 63) else h - (1 << 64)
        elif pick < 8:
            out.append({"event_id": 0, "window_size": 64,
                        "data": {"type": "removed", "block_hashes": [draw(hashes())]}})
        else:
            out.append(draw(event()))
    return out


def run(native: bool, calls: list[tuple[list[Any], bool]], window: int | None,
        prefix_closed: bool = False) -> tuple[list[bytes], dict[str, int]]:
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=window, native=native,
                       prefix_closed=prefix_closed)
    for events, flush in calls:
        sink.ingest(events)
        if flush:
            sink.flush()
    sink.flush()
    return rec.payloads, sink.stats()


needs_native = pytest.mark.skipif(_compiled.loops("event_sink", {}) is None,
                                  reason="kvbm_plugin.events._sink_c was not built")


# Streams of up to 5 ingest calls (each a list of events, flushed or not) and the window.
CALLS = (st.lists(st.tuples(st.one_of(st.lists(event(), max_size=12), chained()),
                            st.booleans()), min_size=1, max_size=5),
         st.sampled_from([None, 64]))


def _loops_agree(calls: list[tuple[list[Any], bool]], window: int | None,
                 prefix_closed: bool) -> None:
    want = run(False, calls, window, prefix_closed)
    got = run(True, calls, window, prefix_closed)
    assert got[0] == want[0]
    assert got[1] == want[1]


@needs_native
@pytest.mark.expect_errors  # malformed events on purpose: each is logged, and must match
@depths(quick=60, thorough=400)
def test_compiled_loop_matches_python_loop(examples: int) -> None:
    run_examples(examples, lambda calls, window: _loops_agree(calls, window, False), *CALLS)


@needs_native
@pytest.mark.expect_errors  # malformed events on purpose, as in the test above
@depths(quick=60, thorough=400)
def test_compiled_loop_matches_python_loop_keeping_the_stream_prefix_closed(
        examples: int) -> None:
    """The same streams into sinks that keep the output prefix-closed (orphan stores dropped,
    unknown removals dropped, cascades): byte-identical output and counters."""
    run_examples(examples, lambda calls, window: _loops_agree(calls, window, True), *CALLS)


@needs_native
def test_compiled_loop_takes_the_common_case_and_coalesces() -> None:
    """Decode steady state: chains coalesce, removals coalesce, hashes become signed."""
    def store(parent: int | None, h: int) -> dict[str, Any]:
        return {"event_id": 0, "window_size": 64, "data": {
            "type": "stored", "parent_hash": parent, "blocks": [{
                "block_hash": h, "tokens": [{"token_id": h % 7}, {"token_id": 1}]}]}}

    top = (1 << 64) - 1
    events = [store(None, 10), store(10, top), store(top, 12),
              {"event_id": 0, "window_size": 64, "data": {"type": "removed",
                                                          "block_hashes": [3, top]}},
              {"event_id": 0, "window_size": 64, "data": {"type": "removed",
                                                          "block_hashes": [4]}}]
    rec = Recorder()
    sink = KvEventSink(rec, block_size=2, window_size=64, native=True)
    sink.ingest(events)
    sink.flush()
    assert rec.batches == [[
        {"type": "BlockStored", "block_hashes": [10, -1, 12], "parent_block_hash": None,
         "token_ids": [3, 1, 1, 1, 5, 1], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [3, -1, 4], "medium": "GPU"}]]
    stats = sink.stats()
    assert (stats["stores"], stats["blocks_stored"], stats["removes"],
            stats["blocks_removed"], stats["events_in"]) == (1, 3, 1, 3, 5)


# Wire hashes on each side of every msgpack int form's edges (u64 as TRT-LLM sends them).
EDGE_HASHES = [v % (1 << 64) for v in (
    0, 1, 31, 32, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63))]


def _edge_events() -> list[Any]:
    """Hashes, parents, token ids and lora ids at every msgpack int form's edges, and their
    removals (one run of 23: a 16-bit array header)."""
    tokens = [0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1]
    events: list[Any] = []
    for i, h in enumerate(EDGE_HASHES):
        parent = EDGE_HASHES[i - 1] if i else None
        events.append(_store(parent, h, [{"token_id": tokens[(i + k) % len(tokens)]}
                                         for k in range(BS)],
                             lora_id=[None, 0, 1, 128, (1 << 64) - 1][i % 5]))
        events.append(_store(None, h, [{"token_id": 1}, {"token_id": 2}]))
    events += [{"event_id": 0, "window_size": 64,
                "data": {"type": "removed", "block_hashes": [h]}} for h in EDGE_HASHES]
    return events


def _removal_runs(sizes: Sequence[int]) -> list[Any]:
    """Removal runs of ``sizes`` blocks, each closed by a store (its array header's edges)."""
    runs: list[Any] = [_store(None, 7)]
    for n in sizes:
        runs += [{"event_id": 0, "window_size": 64,
                  "data": {"type": "removed", "block_hashes": [5000 + i]}} for i in range(n)]
        runs.append(_store(None, 7))
    return runs


@needs_native
def test_the_compiled_writer_writes_every_int_form_as_msgspec_does() -> None:
    """Hashes, parents, token ids and lora ids at every msgpack int form's edges, in stores
    and removals, and removal runs on each side of the fixarray/16-bit header edge: the
    compiled batch's bytes equal the Python loop's maps encoded by msgspec."""
    payloads, stats = _both(lambda: [_edge_events(), _removal_runs((15, 16))])
    assert stats["blocks_stored"] == 2 * len(EDGE_HASHES) + 3


@needs_native
@pytest.mark.slow  # 40,000-block chains and 65,536-block runs: seconds in each loop
def test_the_compiled_writer_writes_32_bit_array_headers_as_msgspec_does() -> None:
    """Stores and removals long enough for 16- and 32-bit array headers (a chain of 80,000
    token ids, 70,000 removals, runs of 65,535 and 65,536): the compiled batch's bytes equal
    the Python loop's maps encoded by msgspec."""
    def make() -> list[list[Any]]:
        chain = [_store(None if i == 0 else 1000 + i - 1, 1000 + i,
                        [{"token_id": i}, {"token_id": 70000}]) for i in range(40000)]
        gone = [{"event_id": 0, "window_size": 64,
                 "data": {"type": "removed", "block_hashes": [1000 + i]}} for i in range(70000)]
        return [_edge_events(), chain, gone, _removal_runs((15, 16, 65535, 65536))]

    payloads, stats = _both(make)
    assert stats["blocks_stored"] == 2 * len(EDGE_HASHES) + 40000 + 5
    assert any(len(p) > 65536 for p in payloads)


@st.composite
def json_traffic(draw: st.DrawFn) -> list[Any]:
    """Well-formed decode traffic (chains, removals, some LoRA ids) that JSON can carry."""
    out: list[Any] = []
    last = None
    for _ in range(draw(st.integers(1, 20))):
        if draw(st.integers(0, 2)):
            h = draw(st.sampled_from([v for v in VALID if isinstance(v, int)]))
            parent = last if draw(st.integers(0, 3)) else None
            data: dict[str, Any] = {"type": "stored", "parent_hash": parent, "blocks": [{
                "type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                "tokens": [{"type": "unique_token", "token_id": draw(TOKEN_IDS),
                            "token_extra_id": 0} for _ in range(BS)]}]}
            if draw(st.integers(0, 4)) == 0:
                data["lora_id"] = draw(st.sampled_from([0, 3]))
            out.append({"event_id": 0, "window_size": 64, "data": data})
            last = h
        else:
            out.append({"event_id": 0, "window_size": 64, "data": {
                "type": "removed", "block_hashes": [draw(st.sampled_from(VALID[:6]))]}})
    return out


@needs_native
@depths(quick=30, thorough=150)
def test_dicts_whose_keys_are_not_interned_run_the_same_in_both_loops(examples: int) -> None:
    run_examples(examples, _keys_not_interned_run_the_same,
                 st.lists(st.tuples(json_traffic(),
                                    st.sampled_from(["built", "json", "mixed", "mixed"])),
                          min_size=1, max_size=4), st.integers(0, 1 << 32))


def _keys_not_interned_run_the_same(calls: list[tuple[list[Any], str]], seed: int) -> None:
    """The compiled loop matches a token's key by identity before it compares characters (the
    serializer's literal keys are interned); JSON-decoded events (trtllm-serve, the sidecar's
    input) have keys that are equal but not interned, and a dict may mix both: the same output
    as the Python loop either way, and the same as for the dicts as built."""
    import json
    import random

    rnd = random.Random(seed)

    def mix_keys(obj: Any) -> Any:
        """Some keys of some dicts replaced by an equal str that is not interned."""
        if isinstance(obj, dict):
            return {("".join(list(k)) if rnd.random() < 0.3 else k): mix_keys(v)
                    for k, v in obj.items()}
        if isinstance(obj, list):
            return [mix_keys(v) for v in obj]
        return obj

    def make(decode: bool) -> list[list[Any]]:
        out = []
        for events, how in calls:
            if not decode or how == "built":
                out.append(copy.deepcopy(events))
            elif how == "json":
                out.append(json.loads(json.dumps(events)))
            else:
                out.append([mix_keys(e) for e in events])
        return out

    assert _both(lambda: make(True)) == _both(lambda: make(False))


@needs_native
def test_compiled_batches_hold_wire_bytes_out_of_the_cyclic_collector() -> None:
    """The compiled batch writes the events it takes as their wire bytes, one run of them
    (``EncodedEvents``: no Python object per event or token, nothing for the cyclic collector
    to traverse while the batch waits to be sent), the same bytes as the Python loop's maps;
    a publisher that does not take encoded batches gets the maps."""
    events = [{"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": None,
        "blocks": [{"block_hash": 1, "tokens": [{"token_id": 1}, {"token_id": 2}]}]}},
        {"event_id": 0, "window_size": 64, "data": {"type": "removed", "block_hashes": [1]}}]
    out = {}
    for native in (True, False):
        rec = Recorder()
        sink = KvEventSink(rec, block_size=2, native=native)
        sink.ingest([dict(e) for e in events])  # the first teaches the window (Python loop)
        sink.ingest(events)
        sink.flush()
        items = rec.items[0]
        if native:  # the first store went to the Python loop (it taught the window)
            assert [type(ev) for ev in items] == [dict, EncodedEvents]
            assert items[1].count == 3 and not gc.is_tracked(items[1])
        else:
            assert [type(ev) for ev in items] == [dict] * 4
        out[native] = rec.payloads
    assert out[True] == out[False]
    plain = SimpleNamespace(batches=[])

    class Maps(EventPublisher):
        def publish(self, events: Sequence[Any], data_parallel_rank: int | None = None) -> bool:
            plain.batches.append(list(events))
            return True

        def shutdown(self, timeout: float = 5.0) -> None:
            pass

    sink = KvEventSink(Maps(PublisherSettings()), block_size=2, window_size=64, native=True)
    sink.ingest(events)
    sink.flush()
    assert plain.batches == [[
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}]]


ROOT = SimpleNamespace(ordinal=-1, key=b"\0" * 32)


class Raises:
    """A V2 block whose ``tokens`` attribute raises (the hook counts it as malformed)."""

    key = b"\7" * 32
    prev = ROOT
    ordinal = 0

    @property
    def tokens(self) -> list[int]:
        raise AttributeError("tokens")


@st.composite
def v2_calls(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """V2 hook traffic: chains of full blocks (so stores and removals coalesce), the same
    block again (another layer group), partial blocks, removals of published, unknown and
    odd keys, odd tokens and keys, layer-group routing switched on and off, flushes and
    discards."""
    blocks: list[Any] = [ROOT]
    calls: list[tuple[str, Any]] = []
    for i in range(draw(st.integers(1, 40))):
        pick = draw(st.integers(0, 19))
        if pick < 9:
            prev = blocks[-1] if draw(st.integers(0, 3)) else draw(st.sampled_from(blocks))
            tokens: Any = [draw(st.integers(0, 300)) for _ in range(BS)]
            odd = draw(st.integers(0, 12))
            if odd == 0:
                tokens = tokens[:-1]  # partial
            elif odd == 1:
                tokens = tuple(tokens)
            elif odd == 2:
                tokens[0] = draw(st.sampled_from([1.5, -1, 1 << 32, True, "7"]))
            key: Any = bytes([i % 256]) * 8 + draw(st.binary(min_size=0, max_size=4))
            if odd == 3:
                key = draw(st.sampled_from([b"short", bytearray(b"\1" * 8), "k" * 8, 5]))
            block = SimpleNamespace(key=key, tokens=tokens, prev=prev,
                                    ordinal=getattr(prev, "ordinal", -1) + 1)
            if odd == 4:
                del block.ordinal  # a block whose children have a prev without one
            blocks.append(block)
            calls.append(("store", block))
        elif pick < 11:
            calls.append(("store", draw(st.sampled_from(blocks[1:] or [Raises()]))))
        elif pick < 16:
            victim = draw(st.sampled_from(blocks))
            calls.append(("remove", getattr(victim, "key", None)))
        elif pick < 17:
            calls.append(("remove", draw(st.sampled_from([b"\x09" * 32, 3, "00ff" * 8, [b"\1" * 8],
                                                           None, 1.5]))))
        elif pick < 18:
            calls.append(("route", draw(st.sampled_from([None, 0, 1]))))
        elif pick < 19:
            calls.append(("flush", None))
        else:
            calls.append(("discard", None))
    return calls


def run_v2(native: bool, calls: list[tuple[str, Any]]) -> tuple[list[bytes], dict[str, int]]:
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, native=native)
    for kind, arg in calls:
        if kind == "store":
            sink.add_stored_block_event_from_block(arg)
        elif kind == "remove":
            sink.add_removed_event(arg)
        elif kind == "route":
            if arg is None:
                sink.set_layer_group_window_sizes({})
            else:
                sink.set_routing_layer_group(arg)
        elif kind == "discard":
            sink.discard_events()
        else:
            sink.flush_iteration_events()
    sink.flush()
    return rec.payloads, sink.stats()


def _v2_hooks_agree(calls: list[tuple[str, Any]]) -> None:
    want = run_v2(False, calls)
    got = run_v2(True, calls)
    assert got[0] == want[0]
    assert got[1] == want[1]


@needs_native
@pytest.mark.expect_errors  # malformed calls on purpose: each is logged, and must match
@depths(quick=60, thorough=400)
def test_compiled_v2_hooks_match_the_python_hooks(examples: int) -> None:
    """The V2 hooks' compiled fast path against the Python hooks on the same calls:
    byte-identical batches and identical counters."""
    run_examples(examples, _v2_hooks_agree, v2_calls())


@needs_native
def test_compiled_v2_hooks_write_wire_bytes_and_coalesce() -> None:
    """A chain of V2 stores and its removals: one BlockStored and one BlockRemoved, written
    as wire bytes by the fast path, with the counters the Python hooks keep."""
    a = SimpleNamespace(key=b"\1" * 32, tokens=[1, 2], prev=ROOT, ordinal=0)
    b = SimpleNamespace(key=b"\2" * 32, tokens=[3, 4], prev=a, ordinal=1)
    rec = Recorder()
    sink = KvEventSink(rec, block_size=2, native=True)
    for block in (a, b, a):  # a again: another layer group of a published block
        sink.add_stored_block_event_from_block(block)
    sink.add_removed_event(b.key)
    sink.add_removed_event(a.key)
    sink.flush_iteration_events()
    assert [(type(e), e.count) for e in rec.items[0]] == [(EncodedEvents, 2)]
    h1, h2 = radix_key_hash(a.key), radix_key_hash(b.key)
    assert rec.batches == [[
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [h2, h1], "medium": "GPU"}]]
    stats = sink.stats()
    assert (stats["stores"], stats["blocks_stored"], stats["removes"],
            stats["blocks_removed"]) == (1, 2, 1, 2)


class InterruptedOnce:
    """A V2 block whose first ``tokens`` read raises KeyboardInterrupt, as a Ctrl-C handled
    while a property's Python code runs does; later reads answer."""

    key = b"\5" * 32
    prev = ROOT
    ordinal = 0

    def __init__(self) -> None:
        self.reads = 0

    @property
    def tokens(self) -> list[int]:
        self.reads += 1
        if self.reads == 1:
            raise KeyboardInterrupt
        return [1, 2]


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_an_interrupt_raised_while_a_v2_block_is_read_propagates(native: bool) -> None:
    """A KeyboardInterrupt (or SystemExit) raised by a read is not an error of the block: it
    reaches TensorRT-LLM's caller, and is never cleared for the fallback's second read."""
    sink = KvEventSink(Recorder(), block_size=2, native=native)
    block = InterruptedOnce()
    with pytest.raises(KeyboardInterrupt):
        sink.add_stored_block_event_from_block(block)
    assert block.reads == 1
    assert sink.stats()["malformed_events"] == 0


def test_native_switch_turns_the_compiled_loops_off_and_refuses_a_non_boolean() -> None:
    """Built or not: off means the Python loops, and a bad value is an error naming it."""
    for module in _compiled._MODULES:
        assert _compiled.loops(module, {NATIVE: "0"}) is None
    with pytest.raises(ConfigError, match=rf"{NATIVE}='maybe'"):
        _compiled.loops("event_sink", {NATIVE: "maybe"})
    with pytest.raises(ConfigError, match=rf"{NATIVE}='maybe'"):
        _compiled.describe({NATIVE: "maybe"})


def test_native_switch_and_build() -> None:
    """The supported install builds the extensions; installed without a C compiler they are
    optional and this test skips, unless KVBM_REQUIRE_NATIVE=1 (CI's main run) demands them."""
    missing = [module for module in _compiled._MODULES if _compiled.loops(module, {}) is None]
    if missing and os.environ.get("KVBM_REQUIRE_NATIVE") != "1":
        pytest.skip(f"compiled loops not built for {missing} (installed without a C compiler); "
                    "KVBM_REQUIRE_NATIVE=1 makes this a failure")
    assert missing == [], _compiled.describe({})[1]
    assert _compiled.describe({})[0] is True
    assert "switched off" in _compiled.describe({NATIVE: "off"})[1]


def test_native_true_without_the_extension_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_compiled._built, "event_sink", None)
    with pytest.raises(ValueError, match="native=True"):
        KvEventSink(Recorder(), block_size=2, native=True)
    sink = KvEventSink(Recorder(), block_size=2)  # default: the Python loop, quietly
    assert sink._native is None


@needs_native
def test_strict_mode_counts_what_was_taken_before_the_error_in_both_loops() -> None:
    good = {"event_id": 0, "window_size": 64, "data": {"type": "removed", "block_hashes": [1]}}
    bad = {"event_id": 1, "window_size": 64, "data": {"type": "removed", "block_hashes": [1.5]}}
    seen = []
    for native in (False, True):
        sink = KvEventSink(Recorder(), block_size=2, window_size=64, strict=True, native=native)
        with pytest.raises(WireFormatError, match="1.5"):
            sink.ingest([good, dict(good), bad, dict(good)])
        stats = sink.stats()
        seen.append((stats["events_in"], stats["blocks_removed"], stats["malformed_events"]))
    assert seen == [(3, 2, 1), (3, 2, 1)]


def _store(parent: int | None, h: int, tokens: Any = None, **data: Any) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent, **data, "blocks": [{
            "block_hash": h, "tokens": tokens or [{"token_id": h % 7}, {"token_id": 1}]}]}}


def _both(make: Any, **kw: Any) -> tuple[list[bytes], dict[str, int]]:
    """The Python loop's and the compiled loop's output for ``make()`` (fresh input each)."""
    out = []
    for native in (False, True):
        rec = Recorder()
        sink = KvEventSink(rec, block_size=BS, window_size=64, native=native, **kw)
        for events in make():
            sink.ingest(events)
        sink.flush()
        out.append((rec.payloads, sink.stats()))
    assert out[1] == out[0]
    return out[0]


@needs_native
def test_a_key_whose_eq_changes_the_event_runs_the_same_in_both_loops() -> None:
    """A caller's key object in an event dict, whose ``__eq__`` changes the event when a
    lookup probes it: the compiled loop must not read such a dict at all (its borrowed
    references could be freed under it; here it would read lora_id before parent_hash, the
    Python loop after) but leave the event to the Python loop."""
    def make() -> list[list[Any]]:
        key = Collides("parent_hash")
        data: dict[Any, Any] = {key: None}
        event = _store(10, 11)
        data.update(event["data"])
        event["data"] = data
        key.on_eq = lambda: data.__setitem__("lora_id", 5)  # armed once built
        return [[_store(None, 10)], [event, _store(11, 12)]]

    payloads, _ = _both(make)
    assert b"\x05" in payloads[-1]  # the lora_id set by the key's __eq__ was published


@needs_native
@pytest.mark.parametrize("where", ["event", "data", "block", "token"])
def test_a_key_whose_eq_frees_what_the_loop_holds_runs_the_same_in_both_loops(
        where: str, expect_errors) -> None:
    """The same with an ``__eq__`` that empties the batch list and the dicts the compiled loop
    would hold borrowed (a use-after-free if it looked up in them): both loops agree."""
    _both(lambda: _wrecking_stream(where, Collides))
    assert expect_errors.wait_for("malformed KV event not published")


class StrKey(str):
    """A str subclass equal to the key it spells, with its own ``__eq__`` (``on_eq``): a dict
    holding one has a general key table, and a lookup there runs this ``__eq__``."""

    on_eq: Any = None

    def __eq__(self, other: object) -> bool:
        if self.on_eq is not None:
            self.on_eq()
        return str.__eq__(self, other)

    __hash__ = str.__hash__


@needs_native
@pytest.mark.parametrize("where", ["event", "data", "block", "token"])
def test_a_str_subclass_key_whose_eq_frees_what_the_loop_holds_runs_the_same_in_both_loops(
        where: str, expect_errors) -> None:
    """A str-subclass key (the dict's keys are then not all exact str, so the compiled loop's
    key test must say no) whose ``__eq__`` wrecks the batch and the dicts
    the compiled loop would hold borrowed: it leaves the event to the Python loop; both loops
    agree."""
    _both(lambda: _wrecking_stream(where, StrKey))
    assert expect_errors.wait_for("malformed KV event not published")


@needs_native
@pytest.mark.parametrize("block_size", [1 << 62, 1 << 63, 1 << 70])
def test_a_huge_block_size_runs_the_same_in_both_loops(block_size: int) -> None:
    for native in (False, True):
        rec = Recorder()
        sink = KvEventSink(rec, block_size=block_size, native=native)
        sink.ingest([_store(None, 10), _store(10, 11)])
        sink.ingest([_store(None, 10), _store(10, 11)])
        sink.flush()
        assert rec.payloads == []
        assert sink.stats()["partial_blocks_suppressed"] == 4


@needs_native
def test_refused_values_and_ranks_run_the_same_in_both_loops(expect_errors) -> None:
    def make() -> list[list[Any]]:
        ts = msgpack.Timestamp(1, 0)
        return [[_store(None, 10), _store(10, 11, [{"token_id": 1}, {"token_id": ts}]),
                 _store(10, 12, lora_id=ts), _store(10, 13, lora_id=-1),
                 _store(10, 14, [{"token_id": 1 << 32}, {"token_id": 1}]),
                 {**_store(10, 15), "attention_dp_rank": 3}, _store(10, 16)]]

    _, stats = _both(make, max_dp_ranks=2)
    assert stats["malformed_events"] == 4 and stats["unknown_dp_rank_events"] == 1
    assert stats["blocks_stored"] == 2
    assert expect_errors.wait_for("malformed KV event not published")


def _wrecking_stream(where: str, key_type: type) -> list[list[Any]]:
    """Three chained stores whose ``where`` dict holds its key as a ``key_type`` object whose
    ``__eq__`` (armed once built) empties the batch list and every dict the compiled loop would
    hold borrowed; then a second batch."""
    events = [_store(None, 10), _store(10, 11), _store(11, 12)]
    target = events[1]
    dicts = {"event": target, "data": target["data"],
             "block": target["data"]["blocks"][0],
             "token": target["data"]["blocks"][0]["tokens"][1]}
    holder = dicts[where]
    name = {"event": "window_size", "data": "blocks", "block": "tokens",
            "token": "token_id"}[where]

    def wreck() -> None:
        events.clear()
        for d in dicts.values():
            d.clear()

    items = list(holder.items())
    holder.clear()
    key = key_type(name)
    holder[key] = 0
    holder.update(items)  # the value lands under ``key``, which stays the dict's key
    assert any(type(k) is key_type for k in holder)
    key.on_eq = wreck  # armed once built
    return [events, [_store(None, 20)]]


def _removed(*hashes: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64,
            "data": {"type": "removed", "block_hashes": list(hashes)}}


def _chain(parent: int | None, hashes: list[int], tail: int | None = None,
           **data: Any) -> dict[str, Any]:
    """A prompt's store: a chain of full blocks (``hashes``), and where ``tail`` is given a
    partial last block under it (partial reuse), as TensorRT-LLM stores a context."""
    blocks: list[dict[str, Any]] = [{"block_hash": h, "tokens": [{"token_id": h % 7},
                                                                 {"token_id": k}]}
                                    for k, h in enumerate(hashes)]
    if tail is not None:
        blocks.append({"block_hash": tail, "tokens": [{"token_id": 3}]})
    return {"event_id": 0, "window_size": 64,
            "data": {"type": "stored", "parent_hash": parent, **data, "blocks": blocks}}


@needs_native
@pytest.mark.parametrize("closed", [True, False])
def test_a_prompts_chain_runs_the_same_in_both_loops_and_the_compiled_loop_takes_it(
        closed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains of several blocks (the prefill's stores), with a partial last block or not,
    under a published parent, an unpublished one and none, continuing an earlier chain, with
    an adapter, a published hash or a hash twice in them, then removals of their blocks and
    of the suppressed tails: both loops publish the same bytes and counters, and the compiled
    loop leaves only the chains that need a decision to the Python loop."""
    def make() -> list[list[Any]]:
        return [[_chain(None, [10, 11, 12], tail=13), _chain(12, [14, 15]),
                 _chain(15, [16, 17, 18, 19, 20], tail=21, lora_id=3)],
                [_removed(13), _chain(None, [30, 31], tail=32), _removed(21, 20)],
                [_chain(99, [40, 41], tail=42),  # an unpublished parent: dropped
                 _chain(31, [43, 11, 44]),  # 11 is published: the chain goes on under it
                 _chain(31, [45, 46, 45], tail=47),  # a hash twice
                 _chain(None, [50], tail=51), _chain(50, [52, 53]), _removed(51, 53)]]

    payloads, stats = _both(make, prefix_closed=closed)
    assert stats["partial_blocks_suppressed"] == 6  # every tail, the dropped chains' too
    taken: list[Any] = []
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64, native=True, prefix_closed=closed)
    python_loop = sink._ingest_locked  # noqa: SLF001
    monkeypatch.setattr(sink, "_ingest_locked",
                        lambda evs: (taken.extend(evs), python_loop(evs)))
    for events in make():
        sink.ingest(events)
    left = [ev["data"]["blocks"][0]["block_hash"] for ev in taken
            if ev["data"]["type"] == "stored"]
    assert left == ([40, 43, 45] if closed else [])
    sink.flush()
    assert rec.payloads == payloads


@needs_native
@pytest.mark.parametrize("closed", [True, False])
def test_a_blocks_own_lora_id_none_overrides_the_events_adapter_in_both_loops(
        closed: bool) -> None:
    """A block's own ``lora_id`` (None: the base model) under an event-level adapter (what the
    leader's LoRA names write): the block is a base-model store in both loops, alone or in a
    chain, not the event's adapter's."""
    def make() -> list[list[Any]]:
        alone = _store(None, 10, lora_id=3)
        alone["data"]["blocks"][0]["lora_id"] = None
        chain = _chain(10, [11, 12], lora_id=0)
        chain["data"]["blocks"][1]["lora_id"] = None
        return [[alone, chain]]

    payloads, _ = _both(make, prefix_closed=closed)
    rec = Recorder()
    sink = KvEventSink(rec, block_size=BS, window_size=64, native=True, prefix_closed=closed)
    for events in make():
        sink.ingest(events)
    sink.flush()
    assert rec.payloads == payloads
    stores = [(e["block_hashes"], e["lora_id"], e["lora_name"]) for e in rec.batches[0]]
    assert stores == [([10], None, None), ([11], 0, "lora-0"), ([12], None, None)]
