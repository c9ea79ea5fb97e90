"""GPU-tier event path: KvEventSink + ZmqEventPublisher against a naive per-event publisher.

Stream (the same for both): per engine iteration, 64 requests each fill one block of
``block_size`` 32 (decode steady state: one single-block ``stored`` event per request, its parent
the request's previous block), and each store is preceded by the eviction of one old block (a
single-hash ``removed`` event), i.e. 64 blocks stored + 64 removed per iteration, interleaved, in
TRT-LLM's buffered dict form with unsigned hashes.

(a) ours: ``sink.ingest(events); sink.flush()`` on the producer thread, which with the
    publisher's default ``sends="caller"`` also builds the payload (the compiled batch has
    already written the events as bytes) and hands it to ZMQ; one message per iteration. As
    information, the same with ``sends="thread"`` (encode + send on a publisher thread).
(b) naive: the per-event work of Dynamo's TRT-LLM publisher on its consolidator path
    (``Publisher`` normalization + ``ZmqKvEventPublisher``; see :class:`_NaivePublisher`): per
    engine event, filter and convert, ``msgspec.msgpack.encode`` one ``[ts, [event], rank]``
    batch and a blocking 3-frame ``send_multipart`` on the producer thread.

Both go into a SUB over tcp loopback in a separate process that decodes every payload and counts
blocks (it must get every one).

Input as the engine hands it over: in TRT-LLM, ``KVCacheEventSerializer`` builds an iteration's
event dicts (a few hundred KB) right before the connector, or any publisher, reads them, so
they are still in the CPU cache. The measured runs do the same: :func:`iter_stream` (dicts) and
:func:`_iter_v2_stream` (V2 hook calls) build each iteration on the engine thread right before
it is fed, untimed, and only the feeding is timed. The naive publisher gets the same fresh input
in the same run. With the building between iterations, a publisher thread (``sends="thread"``)
finds each batch after a pause and wakes for it, as it does in the engine, where iterations are
further apart.
A stream built up front instead (hundreds of MB for the full run) is read long after it was
written, mostly cache misses, which both publishers then pay per token; copying each iteration
with ``copy.deepcopy`` does not make it fresh, as the copies share the original ints (token ids,
hashes), whose reads still miss.

The target (P1) is the publish side's whole CPU cost per block: the CPU time of the engine
thread (ingest + flush, and with ``sends="caller"`` the send, summed over the iterations) plus
that of our publisher thread when there is one (encode + send, over the whole run), each read
from its own thread CPU clock
(``time.pthread_getcpuclockid``), for dict input and for the V2 hooks, against the naive
publisher's engine-thread CPU per block (all its work is on that thread) in the same run: ours
must be <= 1/15 of it. ZMQ's own I/O thread is outside both figures. Executor-thread cost is the
engine thread's time per block (stored + removed blocks) of one iteration, median, for dict
input and for the V2 hooks, on the same fresh input.

As information, the same end-to-end runs for both publishers on the whole stream built up front
(cold input: the whole stream built up front), fed back to back; they also give the received
rates (fed from a generator, the gaps between messages would be the generator's). The received
rate measures the subscriber as much as the publisher: the receiver's decoding bounds it, and
its own decode rate on our payloads (in this process, one core) is reported beside it as the
ceiling any publisher can reach here.

Ours runs with the compiled ingest loop when it was built (``kvbm_plugin.events._sink_c``); the
Python loop is measured too, as information, and is the baseline of the executor-cost row.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import msgpack
import msgspec
import zmq

from benchmarks._table import Row, print_table
from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import Endpoint, PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.wire.events import encode_payload
from kvbm_plugin.wire.publisher import NullEventPublisher, ZmqEventPublisher

BLOCK_SIZE = 32
PER_ITER = 64
_log = logging.getLogger("bench.naive")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def iter_stream(iterations: int, seed: int = 1) -> Iterator[list[dict[str, Any]]]:
    """Per iteration, the TRT-LLM event dicts (see module docstring), each iteration's list
    built when it is asked for, as TRT-LLM's ``KVCacheEventSerializer`` builds them right
    before the connector reads them."""
    import random

    rnd = random.Random(seed)
    chains = [rnd.getrandbits(64) for _ in range(PER_ITER)]  # last hash per request
    event_id = 0
    for it in range(iterations):
        evs: list[dict[str, Any]] = []
        for r in range(PER_ITER):
            evs.append({"event_id": event_id, "window_size": 4096,
                        "data": {"type": "removed", "block_hashes": [rnd.getrandbits(64)]}})
            event_id += 1
            h = rnd.getrandbits(64)
            base = (it * PER_ITER + r) * BLOCK_SIZE
            tokens = [{"type": "unique_token", "token_id": base + k, "token_extra_id": 0}
                      for k in range(BLOCK_SIZE)]
            evs.append({"event_id": event_id, "window_size": 4096, "data": {
                "type": "stored", "parent_hash": chains[r], "blocks": [{
                    "type": "stored_block", "block_hash": h, "tokens": tokens,
                    "cache_level": 0, "priority": 35}]}})
            event_id += 1
            chains[r] = h
        yield evs


def make_stream(iterations: int, seed: int = 1) -> list[list[dict[str, Any]]]:
    """The whole :func:`iter_stream`, built up front (the cold-input rows)."""
    return list(iter_stream(iterations, seed))


def _receiver(port: int, expect_blocks: int, conn: Any, timeout: float) -> None:
    """SUB process: decode every payload, count blocks, report (blocks, seconds, messages).

    Batches without events are probes: the first one tells the parent the SUB is subscribed.
    """
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    subscribed = False
    blocks = msgs = 0
    first = last = 0.0
    deadline = time.monotonic() + timeout
    while blocks < expect_blocks and time.monotonic() < deadline:
        if not sub.poll(100):
            continue
        frames = sub.recv_multipart()
        batch = msgpack.unpackb(frames[2])
        if not batch[1]:
            if not subscribed:
                subscribed = True
                conn.send("subscribed")
            continue
        n = 0
        for ev in batch[1]:
            n += len(ev.get("block_hashes", ()))
        if msgs == 0:
            first = time.perf_counter()
        msgs += 1
        blocks += n
        last = time.perf_counter()
    conn.send((blocks, last - first, msgs))
    sub.close(0)
    ctx.term()


def _start_receiver(port: int, expect: int, probe: Any) -> tuple[Any, Any]:
    """Start the SUB process; probe until it reports it is subscribed (slow joiner)."""
    parent, child = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=_receiver, args=(port, expect, child, 60.0),
                                           daemon=True)
    proc.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe()
        if parent.poll(0.02):
            parent.recv()
            return proc, parent
    raise RuntimeError("benchmark receiver never subscribed")


class _NaivePublisher:
    """The per-event work of Dynamo's TRT-LLM publisher on its consolidator (ZMQ) path.

    Modelled on ``components/src/dynamo/trtllm/publisher.py`` (latest main, research notes
    dynamo_kvbm_consolidator.md 2.1-2.3): for every engine event ``Publisher`` normalizes it
    (per-rank ``event_id`` continuity check, sliding-window drop check, ``_to_signed_i64`` of
    every hash, per-block length checks, partial-block tracking, ``int(token_id)`` per token,
    ``mm_keys`` lookup, cache-salt lookup, lazy debug logging) into an intermediate dict; then
    ``ZmqKvEventPublisher.publish_stored`` / ``publish_removed`` converts the hashes with
    ``_to_signed_i64`` again, builds the wire map (with ``block_mm_infos``, one entry per block)
    and ``_publish_event`` wraps it in its own ``[ts, [event], dp_rank]`` batch, formats its
    debug message, encodes with ``msgspec.msgpack.encode``, writes an 8-byte big-endian seq and
    does a blocking 3-frame ``send_multipart``. Two deliberate differences, both in the
    baseline's favour: the routing window (4096) is known up front, as Dynamo learns it from
    the engine's initial ``created`` events, which precede this steady-state stream (without
    them Dynamo would drop every event here); and ``SNDHWM`` is unlimited so the baseline
    loses nothing (Dynamo keeps the default of 1000 and drops beyond it).
    """

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(f"tcp://*:{port}")
        self.endpoint = f"tcp://*:{port}"
        self.topic = ""
        self.sequence = 0
        self.kv_block_size = BLOCK_SIZE
        self.max_window_size: int | None = 4096
        self.processing_initial_created_events = False
        self.partial_block_hashes: set[int] = set()
        self.last_event_id_by_rank: dict[int, int] = {}

    def handle(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            normalized = self._normalize(ev)
            if normalized is None:
                continue
            rank, norm = normalized
            if norm["type"] == "stored":
                self._publish_stored(norm["token_ids"], norm["num_block_tokens"],
                                     norm["block_hashes"], norm["parent_hash"],
                                     norm["block_mm_infos"], rank, norm["lora_name"],
                                     norm["cache_salt"])
            else:
                self._publish_removed(norm["block_hashes"], rank)

    def _should_drop(self, event: dict[str, Any]) -> bool:
        if "window_size" not in event or self.processing_initial_created_events:
            return False
        return bool(event["window_size"] != self.max_window_size)

    def _normalize(self, event: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        event_id = event["event_id"]
        rank = event.get("attention_dp_rank", 0)
        last_id = self.last_event_id_by_rank.get(rank)
        if last_id is not None and event_id != last_id + 1:
            _log.warning("Non-consecutive engine event_id on rank=%s: expected %s, got %s",
                         rank, last_id + 1, event_id)
        self.last_event_id_by_rank[rank] = event_id
        if self._should_drop(event):
            return None
        data = event["data"]
        if data["type"] == "stored":
            self.processing_initial_created_events = False
            parent_hash = _to_signed_i64(data["parent_hash"])
            token_ids: list[int] = []
            num_block_tokens: list[int] = []
            block_hashes: list[int] = []
            block_mm_infos: list[dict[str, Any] | None] = []
            kv_block_size = self.kv_block_size
            partial = self.partial_block_hashes
            for block in data["blocks"]:
                tokens = block["tokens"]
                n_tokens = len(tokens)
                if n_tokens > kv_block_size:
                    _log.error("Block contains %d tokens > kv_block_size %d", n_tokens,
                               kv_block_size)
                    return None
                block_hash = _to_signed_i64(block["block_hash"])
                if block_hash is None:
                    _log.warning("Skipping block with None hash")
                    continue
                if n_tokens < kv_block_size:
                    partial.add(block_hash)
                    break
                num_block_tokens.append(n_tokens)
                block_hashes.append(block_hash)
                token_ids.extend(int(t["token_id"]) for t in tokens)
                mm_keys = block.get("mm_keys")
                if mm_keys:
                    mm_hashes = [int(k["hash"][:16], 16) for k in mm_keys
                                 if k.get("type") == "mm_key" and k.get("hash")]
                    block_mm_infos.append({"mm_objects": [{"mm_hash": h, "offsets": []}
                                                          for h in mm_hashes]}
                                          if mm_hashes else None)
                else:
                    block_mm_infos.append(None)
            lora_name = data.get("lora_name")
            cache_salt = _stored_event_cache_salt(data)
            _log.debug("Publishing stored KV event: engine_event_id=%s attention_dp_rank=%s "
                       "blocks=%s tokens=%s lora_name=%s has_cache_salt=%s has_parent=%s",
                       event_id, rank, len(block_hashes), len(token_ids), lora_name,
                       cache_salt is not None, parent_hash is not None)
            return rank, {"type": "stored", "token_ids": token_ids,
                          "num_block_tokens": num_block_tokens, "block_hashes": block_hashes,
                          "parent_hash": parent_hash, "block_mm_infos": block_mm_infos,
                          "lora_name": lora_name, "cache_salt": cache_salt}
        if data["type"] == "removed":
            self.processing_initial_created_events = False
            removed: list[int] = []
            skipped = 0
            for h in data["block_hashes"]:
                signed = _to_signed_i64(h)
                if signed is None:
                    continue
                if signed in self.partial_block_hashes:
                    self.partial_block_hashes.remove(signed)
                    skipped += 1
                    continue
                removed.append(signed)
            _log.debug("Publishing removed KV event: engine_event_id=%s attention_dp_rank=%s "
                       "blocks=%s skipped_partial_blocks=%s", event_id, rank, len(removed),
                       skipped)
            if not removed:
                return None
            return rank, {"type": "removed", "block_hashes": removed}
        return None

    def _publish_stored(self, token_ids: list[int], num_block_tokens: list[int],
                        block_hashes: list[int], parent_hash: int | None,
                        block_mm_infos: list[Any] | None, rank: int, lora_name: str | None,
                        cache_salt: str | None) -> None:
        event: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [_to_signed_i64(h) for h in block_hashes],
            "parent_block_hash": None if parent_hash is None else _to_signed_i64(parent_hash),
            "token_ids": token_ids,
            "block_size": self.kv_block_size,
        }
        if lora_name is not None:
            event["lora_name"] = lora_name
        if cache_salt is not None:
            event["cache_salt"] = cache_salt
        if block_mm_infos is not None:
            event["block_mm_infos"] = block_mm_infos
        self._publish_event(event, rank)

    def _publish_removed(self, block_hashes: list[int], rank: int) -> None:
        self._publish_event({"type": "BlockRemoved",
                             "block_hashes": [_to_signed_i64(h) for h in block_hashes]}, rank)

    def _publish_event(self, event: dict[str, Any], rank: int) -> None:
        try:
            batch = [time.time(), [event], rank]
            event_type = event.get("type", "Unknown")
            logging.debug(f"ZMQ publisher sending {event_type} event (dp_rank={rank}) "
                          f"to {self.endpoint}")
            payload = msgspec.msgpack.encode(batch)
            seq = self.sequence.to_bytes(8, byteorder="big")
            self.sequence += 1
            self.sock.send_multipart([self.topic.encode(), seq, payload], flags=0)
        except Exception as exc:
            logging.error(f"Failed to publish ZMQ event: {exc}", exc_info=True)

    def probe(self) -> None:
        self.sock.send_multipart([b"", b"\0" * 8, msgpack.packb([time.time(), [], 0])])

    def close(self) -> None:
        self.sock.close(linger=2000)
        self.ctx.term()


def _to_signed_i64(value: int | None) -> int | None:
    """Dynamo's conversion: None passes, u64 -> two's complement, below int64 wraps."""
    if value is None:
        return None
    if value >= 2**63:
        return value - 2**64
    if value < -(2**63):
        return ((value + 2**63) % 2**64) - 2**63
    return value


def _stored_event_cache_salt(data: Mapping[str, Any]) -> str | None:
    """Dynamo's cache-salt lookup: event level, then each block; conflicting salts fail."""
    salts: set[str] = set()
    top = data.get("cache_salt")
    if top is not None:
        salts.add(top)
    for block in data.get("blocks") or []:
        if isinstance(block, Mapping):
            salt = block.get("cache_salt")
            if salt is not None:
                salts.add(salt)
    if len(salts) > 1:
        raise ValueError("stored KV event contains conflicting cache_salt values")
    return next(iter(salts)) if salts else None


def _thread_cpu_clock(thread: threading.Thread) -> Callable[[], float]:
    """A reader of ``thread``'s CPU time in seconds (Linux: its pthread CPU clock)."""
    assert thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime(clock)


def _publisher_thread_clock(pub: ZmqEventPublisher) -> Callable[[], float]:
    """The CPU clock of ``pub``'s publisher thread; a clock that stays at 0 when it sends on
    the caller's thread (its work is then in the caller's own CPU time)."""
    thread = getattr(pub, "_thread", None)
    if thread is None or thread.name.startswith("kvbm-zmq-replay"):
        return lambda: 0.0
    return _thread_cpu_clock(thread)


def _wait_sent(pub: ZmqEventPublisher, timeout: float = 60.0) -> None:
    """Until the publisher thread has sent (or dropped) every batch it accepted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = pub.stats()
        if st["batches_published"] + st["lost_batches"] >= st["batches_accepted"]:
            return
        time.sleep(0.001)  # poll interval; the condition decides
    raise RuntimeError(f"publisher did not drain: {pub.stats()}")


def _end_to_end(stream: Iterable[list[dict[str, Any]]], iterations: int, which: str,
                native: bool | None = None, sends: str = "caller"
                ) -> tuple[float, int, float, float]:
    """(received blocks/s, blocks lost, publish-side CPU us per block, of which the publisher
    thread's) for one publisher over tcp loopback, fed the ``iterations`` iterations of
    ``stream`` on this (the engine) thread.

    The CPU figure is this thread's CPU time around each iteration's feeding, summed (so a
    generator building the next iteration in between is not counted), plus, for ours, the
    publisher thread's CPU time over the whole run (module docstring). The received rate means
    something only for a pre-built ``stream``: fed from a generator, the gaps between messages
    are the generator's.
    """
    port = _free_port()
    expect = iterations * PER_ITER * 2
    cpu = publisher = 0.0
    # Settle the collector's debt before timing, the same call for both publishers. With a
    # pre-built stream, that is the debt of building its millions of objects: otherwise the
    # first run that keeps any objects alive across a collection (ours: each batch until the
    # publisher thread has sent it) pays a full collection of the whole stream (~0.3 s on the
    # full run), which the naive run, freeing everything at once, never triggers. With a
    # generator, only what earlier runs left. Collections during the run fall where the
    # allocations put them, as in the engine: mostly in the generator (untimed), some in the
    # feeding, which then traverses the iteration's young dicts.
    if which == "naive":
        naive = _NaivePublisher(port)
        proc, conn = _start_receiver(port, expect, naive.probe)
        gc.collect()
        for evs in stream:
            t0 = time.thread_time()
            naive.handle(evs)
            cpu += time.thread_time() - t0
    else:
        pub = ZmqEventPublisher(PublisherSettings(), Endpoint("tcp", port=port), sends=sends)
        sink = KvEventSink(pub, block_size=BLOCK_SIZE, native=native)
        proc, conn = _start_receiver(port, expect, lambda: pub.publish([]))
        _wait_sent(pub)
        publisher_cpu = _publisher_thread_clock(pub)
        gc.collect()
        pub0 = publisher_cpu()
        for evs in stream:
            t0 = time.thread_time()
            sink.ingest(evs)
            sink.flush()
            cpu += time.thread_time() - t0
        _wait_sent(pub)
        publisher = publisher_cpu() - pub0
        cpu += publisher
    result = conn.recv() if conn.poll(60) else (0, 1.0, 0)
    proc.join(5)
    if which == "naive":
        naive.close()
    else:
        sink.shutdown()
    blocks, seconds, _ = result
    return (blocks / max(seconds, 1e-9), expect - blocks, cpu / expect * 1e6,
            publisher / expect * 1e6)


def _v2_expected_blocks(iterations: int) -> int:
    """Blocks the sink publishes (stored + removed) from :func:`_iter_v2_stream`'s
    ``iterations`` (a removal of a key it never published is not one)."""
    counter = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BLOCK_SIZE)
    for calls in _iter_v2_stream(iterations):
        _v2_feed(counter, calls)
    st = counter.stats()
    return int(st["blocks_stored"] + st["blocks_removed"])


def _v2_publish_cpu(iterations: int, expect: int) -> float:
    """Publish-side CPU us per published block for the V2 hooks (engine thread + publisher
    thread), into a decoding SUB over tcp loopback as in :func:`_end_to_end`: each iteration's
    calls built (untimed) right before they are fed; ``expect``: the blocks the SUB must get."""
    port = _free_port()
    pub = ZmqEventPublisher(PublisherSettings(), Endpoint("tcp", port=port))
    sink = KvEventSink(pub, block_size=BLOCK_SIZE)
    proc, conn = _start_receiver(port, expect, lambda: pub.publish([]))
    _wait_sent(pub)
    publisher_cpu = _publisher_thread_clock(pub)
    gc.collect()  # as in _end_to_end
    cpu = 0.0
    pub0 = publisher_cpu()
    for calls in _iter_v2_stream(iterations):
        t0 = time.thread_time()
        _v2_feed(sink, calls)
        cpu += time.thread_time() - t0
    _wait_sent(pub)
    cpu += publisher_cpu() - pub0
    blocks = conn.recv()[0] if conn.poll(60) else 0
    proc.join(5)
    sink.shutdown()
    if blocks != expect:
        raise RuntimeError(f"V2 publish run: {blocks} of {expect} blocks received")
    return cpu / max(1, expect) * 1e6


def _v2_feed(sink: KvEventSink, calls: list[tuple[str, Any]]) -> None:
    """One engine iteration through the V2 hooks: its calls, then the iteration's flush."""
    store = sink.add_stored_block_event_from_block
    remove = sink.add_removed_event
    for kind, arg in calls:
        if kind == "store":
            store(arg)
        else:
            remove(arg)
    sink.flush_iteration_events()


def _dict_cost(stream: Iterable[list[dict[str, Any]]], native: bool) -> float:
    """Median us per block of one iteration's ingest + flush (NullEventPublisher: no I/O),
    each iteration of ``stream`` timed on its own (a generator's building is not timed)."""
    sink = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BLOCK_SIZE,
                       native=native)
    samples = []
    for evs in stream:
        t = time.perf_counter()
        sink.ingest(evs)
        sink.flush()
        samples.append((time.perf_counter() - t) / (PER_ITER * 2) * 1e6)
    return statistics.median(samples)


def _receiver_capacity(stream: Iterable[list[dict[str, Any]]]) -> float:
    """Blocks/s the benchmark's receiver can decode and count, on our payloads, in-process:
    the ceiling of the end-to-end rate on this machine (the receiver has one core)."""
    batches: list[Any] = []

    class Keep(NullEventPublisher):
        def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
            batches.append(events)
            return True

    sink = KvEventSink(Keep(PublisherSettings()), block_size=BLOCK_SIZE)
    for evs in stream:
        sink.ingest(evs)
        sink.flush()
    payloads = [encode_payload(time.time(), events, 0) for events in batches]
    blocks = 0
    t = time.perf_counter()
    for payload in payloads:
        batch = msgpack.unpackb(payload)
        for ev in batch[1]:
            blocks += len(ev.get("block_hashes", ()))
    return blocks / (time.perf_counter() - t)


def _iter_v2_stream(iterations: int) -> Iterator[list[tuple[str, Any]]]:
    """Per iteration, the V2 hook calls (``("remove", key)`` / ``("store", block)``), each
    iteration's calls built when they are asked for: 64 single-block stores, each after the
    eviction of an old published block (an unknown key in the first iterations). Each block's
    ``.prev`` carries its parent's key and ordinal."""
    root = SimpleNamespace(ordinal=-1, key=b"\0" * 32)
    import random

    rnd = random.Random(2)
    heads = [root] * PER_ITER
    stored: list[bytes] = []  # eviction order: oldest stored block first
    for it in range(iterations):
        calls: list[tuple[str, Any]] = []
        for r in range(PER_ITER):
            # evict an old block that was published (or an unknown one in the first iteration)
            calls.append(("remove", stored.pop(0) if len(stored) > 2 * PER_ITER
                          else rnd.randbytes(32)))
            # The parent as the hook reads it (``.key``, ``.ordinal``), not the parent object
            # itself: chained, every block ever built would stay alive through its child, a
            # heap growing every iteration whose full collections would fall, at random, in
            # the timed feeding. The sink reads nothing beyond ``block.prev``.
            parent = heads[r]
            prev = parent if parent is root else SimpleNamespace(key=parent.key,
                                                                 ordinal=parent.ordinal)
            block = SimpleNamespace(key=rnd.randbytes(32),
                                    tokens=list(range((it * PER_ITER + r) * BLOCK_SIZE,
                                                      (it * PER_ITER + r + 1) * BLOCK_SIZE)),
                                    prev=prev, ordinal=getattr(prev, "ordinal", -1) + 1)
            calls.append(("store", block))
            stored.append(block.key)
            heads[r] = block
        yield calls


def _v2_cost(iterations: int) -> float:
    """Median us per block of one iteration through the V2 hooks (NullEventPublisher), each
    iteration's calls built (untimed) right before they are timed."""
    sink = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BLOCK_SIZE)
    samples = []
    for calls in _iter_v2_stream(iterations):
        t = time.perf_counter()
        _v2_feed(sink, calls)
        samples.append((time.perf_counter() - t) / (PER_ITER * 2) * 1e6)
    return statistics.median(samples)


def run(quick: bool = False) -> list[Row]:
    """Measure and return the rows (``quick``: a few hundred iterations, a few seconds)."""
    iterations = 150 if quick else 1500
    native = _compiled.loops("event_sink") is not None  # the default path: compiled loop when built
    # The end-to-end runs move a lot between runs (two processes and four busy threads on two
    # cores): interleave the publishers over several rounds and take each one's median. The
    # CPU-per-block figures are thread CPU clocks, not wall time.
    rounds = 1 if quick else 3
    v2_expect = _v2_expected_blocks(iterations)
    ours_cpu, ours_pub, naive_cpu, python_cpu, v2_cpu, threaded_cpu = [], [], [], [], [], []
    ours_lost = naive_lost = 0
    # Fresh input (the targets): every iteration built right before it is fed, for ours and
    # the naive publisher alike. These run before the pre-built stream exists: alive, its
    # millions of objects would be traversed by every full collection during them.
    for _ in range(rounds):
        _, lost, cpu, _ = _end_to_end(iter_stream(iterations), iterations, "ours")
        ours_cpu.append(cpu)
        ours_lost += lost
        _, lost, cpu, _ = _end_to_end(iter_stream(iterations), iterations, "naive")
        naive_cpu.append(cpu)
        naive_lost += lost
        if native:
            _, lost, cpu, _ = _end_to_end(iter_stream(iterations), iterations, "ours",
                                          native=False)
            python_cpu.append(cpu)
            ours_lost += lost
        v2_cpu.append(_v2_publish_cpu(iterations, v2_expect))
        _, lost, cpu, pub_cpu = _end_to_end(iter_stream(iterations), iterations, "ours",
                                            sends="thread")
        threaded_cpu.append(cpu)
        ours_pub.append(pub_cpu)
        ours_lost += lost
    cost_iterations = min(iterations, 400)
    dict_us = _dict_cost(iter_stream(cost_iterations, seed=3), native)
    dict_py_us = _dict_cost(iter_stream(cost_iterations, seed=3), False) if native else dict_us
    v2_us = _v2_cost(cost_iterations)
    ceiling = _receiver_capacity(iter_stream(min(iterations, 300)))
    # Cold input (information): the whole stream built up front, then fed back to back, so
    # its dicts are read long after they were written (mostly cache misses). Fed without gaps,
    # these runs also give the received rates.
    stream = make_stream(iterations)
    cold_runs, cold_naive_runs, cold_python_runs = [], [], []
    cold_cpu, cold_naive_cpu = [], []
    for _ in range(rounds):
        rate, lost, cpu, _ = _end_to_end(stream, iterations, "ours")
        cold_runs.append(rate)
        cold_cpu.append(cpu)
        ours_lost += lost
        rate, lost, cpu, _ = _end_to_end(stream, iterations, "naive")
        cold_naive_runs.append(rate)
        cold_naive_cpu.append(cpu)
        naive_lost += lost
        if native:
            rate, lost, _, _ = _end_to_end(stream, iterations, "ours", native=False)
            cold_python_runs.append(rate)
            ours_lost += lost
    del stream
    ours_cpu_us = statistics.median(ours_cpu)
    naive_cpu_us = statistics.median(naive_cpu)
    python_cpu_us = statistics.median(python_cpu) if native else ours_cpu_us
    v2_cpu_us = statistics.median(v2_cpu)
    ours_rate = statistics.median(cold_runs)
    naive_rate = statistics.median(cold_naive_runs)
    python_rate = statistics.median(cold_python_runs) if native else ours_rate
    loop = "compiled" if native else "Python (extension not built)"
    name = "event_sink"
    limit = naive_cpu_us / 15
    return [
        Row(name, f"publish-side CPU per block, dict input (all threads), {loop} loop",
            ours_cpu_us, "us/blk", naive_cpu_us, "<= 1/15 of naive",
            ours_cpu_us <= limit and ours_lost == 0),
        Row(name, "publish-side CPU per block, V2 hooks (all threads)",
            v2_cpu_us, "us/blk", naive_cpu_us, "<= 1/15 of naive", v2_cpu_us <= limit),
        Row(name, "publish-side CPU per block, dict input, sends on a publisher thread (info)",
            statistics.median(threaded_cpu), "us/blk", naive_cpu_us),
        Row(name, "of which the publisher thread (info)", statistics.median(ours_pub),
            "us/blk", naive_cpu_us),
        Row(name, "publish-side CPU per block, dict input, Python loop (info)", python_cpu_us,
            "us/blk", naive_cpu_us),
        Row(name, f"publish-side CPU per block, dict input, pre-built stream (cold), {loop} "
                  "loop (info)", statistics.median(cold_cpu), "us/blk",
            statistics.median(cold_naive_cpu)),
        Row(name, "blocks lost (ours, all rounds)", float(ours_lost), "blk", float(naive_lost),
            "0", ours_lost == 0),
        Row(name, f"received blocks/s (tcp, decoded), pre-built stream, {loop} loop (info)",
            ours_rate, "blk/s", naive_rate),
        Row(name, "receiver's decode capacity = ceiling of the row above (info)", ceiling,
            "blk/s", naive_rate),
        Row(name, "received blocks/s, pre-built stream, Python loop (info)", python_rate,
            "blk/s", naive_rate),
        Row(name, f"executor cost, dict input, {loop} loop", dict_us, "us/blk", dict_py_us,
            "<= 2 us", dict_us <= 2.0),
        Row(name, "executor cost, V2 hooks", v2_us, "us/blk", None, "<= 1 us", v2_us <= 1.0),
    ]


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv))
