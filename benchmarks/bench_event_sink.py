"""GPU-tier event path: KvEventSink + ZmqEventPublisher against a naive per-event publisher.

Stream (the same for both): per engine iteration, 64 requests each fill one block of
``block_size`` 32 (decode steady state: one single-block ``stored`` event per request, its parent
the request's previous block), and each store is preceded by the eviction of one old block (a
single-hash ``removed`` event), i.e. 64 blocks stored + 64 removed per iteration, interleaved, in
TRT-LLM's buffered dict form with unsigned hashes.

(a) ours: ``sink.ingest(events); sink.flush()`` on the producer thread; encode + send on the
    publisher thread; one message per iteration.
(b) naive: the shape of Dynamo's TRT-LLM ``ZmqKvEventPublisher``: per engine event, convert,
    ``msgpack.packb`` and a blocking ``send_multipart`` on the producer thread.

Both go into a SUB over tcp loopback in a separate process that decodes every payload and counts
blocks; received blocks/s = blocks counted / (first to last message). Executor-thread cost is
the producer-side time per block (stored + removed blocks) for dict input and for the V2 hooks.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import msgpack
import zmq

from benchmarks._table import Row, print_table
from kvbm_plugin.consolidator_config import Endpoint, PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.publisher import NullEventPublisher, ZmqEventPublisher

BLOCK_SIZE = 32
PER_ITER = 64
U64 = 1 << 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_stream(iterations: int, seed: int = 1) -> list[list[dict[str, Any]]]:
    """Per iteration, the TRT-LLM event dicts (see module docstring)."""
    import random

    rnd = random.Random(seed)
    chains = [rnd.getrandbits(64) for _ in range(PER_ITER)]  # last hash per request
    event_id = 0
    out = []
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
        out.append(evs)
    return out


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
    """Dynamo TRT-LLM publisher shape: one engine event per message, synchronous."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.bind(f"tcp://*:{port}")
        self.seq = 0

    def _send(self, event: dict[str, Any]) -> None:
        payload = msgpack.packb([time.time(), [event], 0], use_bin_type=True)
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def handle(self, events: list[dict[str, Any]]) -> None:
        for ev in events:
            data = ev["data"]
            if data["type"] == "stored":
                hashes, tokens = [], []
                for block in data["blocks"]:
                    if len(block["tokens"]) < BLOCK_SIZE:
                        break
                    hashes.append(_to_signed(block["block_hash"]))
                    tokens.extend(t["token_id"] for t in block["tokens"])
                parent = data["parent_hash"]
                self._send({"type": "BlockStored", "block_hashes": hashes,
                            "parent_block_hash": None if parent is None else _to_signed(parent),
                            "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None})
            elif data["type"] == "removed":
                self._send({"type": "BlockRemoved",
                            "block_hashes": [_to_signed(h) for h in data["block_hashes"]]})

    def probe(self) -> None:
        self.sock.send_multipart([b"", b"\0" * 8, msgpack.packb([time.time(), [], 0])])

    def close(self) -> None:
        self.sock.close(linger=2000)
        self.ctx.term()


def _to_signed(v: int) -> int:
    return v - U64 if v >= 1 << 63 else v


def _end_to_end(stream: list[list[dict[str, Any]]], which: str) -> tuple[float, int]:
    """(received blocks/s, blocks lost) for one publisher over tcp loopback."""
    port = _free_port()
    expect = len(stream) * PER_ITER * 2
    if which == "naive":
        naive = _NaivePublisher(port)
        proc, conn = _start_receiver(port, expect, naive.probe)
        for evs in stream:
            naive.handle(evs)
    else:
        pub = ZmqEventPublisher(PublisherSettings(), Endpoint("tcp", port=port))
        sink = KvEventSink(pub, block_size=BLOCK_SIZE)
        proc, conn = _start_receiver(port, expect, lambda: pub.publish([]))
        for evs in stream:
            sink.ingest(evs)
            sink.flush()
    result = conn.recv() if conn.poll(60) else (0, 1.0, 0)
    proc.join(5)
    if which == "naive":
        naive.close()
    else:
        sink.shutdown()
    blocks, seconds, _ = result
    return blocks / max(seconds, 1e-9), expect - blocks


def _dict_cost(stream: list[list[dict[str, Any]]]) -> float:
    """Median us per block of ingest + flush (NullEventPublisher: no I/O)."""
    sink = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BLOCK_SIZE)
    samples = []
    for evs in stream:
        t = time.perf_counter()
        sink.ingest(evs)
        sink.flush()
        samples.append((time.perf_counter() - t) / (PER_ITER * 2) * 1e6)
    return statistics.median(samples)


def _v2_stream(iterations: int) -> list[list[tuple[str, Any]]]:
    root = SimpleNamespace(ordinal=-1, key=b"\0" * 32)
    import random

    rnd = random.Random(2)
    heads = [root] * PER_ITER
    stored: list[bytes] = []  # eviction order: oldest stored block first
    out = []
    for it in range(iterations):
        calls: list[tuple[str, Any]] = []
        for r in range(PER_ITER):
            # evict an old block that was published (or an unknown one in the first iteration)
            calls.append(("remove", stored.pop(0) if len(stored) > 2 * PER_ITER
                          else rnd.randbytes(32)))
            prev = heads[r]
            block = SimpleNamespace(key=rnd.randbytes(32),
                                    tokens=list(range((it * PER_ITER + r) * BLOCK_SIZE,
                                                      (it * PER_ITER + r + 1) * BLOCK_SIZE)),
                                    prev=prev, ordinal=getattr(prev, "ordinal", -1) + 1)
            calls.append(("store", block))
            stored.append(block.key)
            heads[r] = block
        out.append(calls)
    return out


def _v2_cost(stream: list[list[tuple[str, Any]]]) -> float:
    sink = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BLOCK_SIZE)
    store = sink.add_stored_block_event_from_block
    remove = sink.add_removed_event
    samples = []
    for calls in stream:
        t = time.perf_counter()
        for kind, arg in calls:
            if kind == "store":
                store(arg)
            else:
                remove(arg)
        sink.flush_iteration_events()
        samples.append((time.perf_counter() - t) / (PER_ITER * 2) * 1e6)
    return statistics.median(samples)


def run(quick: bool = False) -> list[Row]:
    """Measure and return the rows (``quick``: a few hundred iterations, a few seconds)."""
    iterations = 150 if quick else 1500
    stream = make_stream(iterations)
    ours_rate, ours_lost = _end_to_end(stream, "ours")
    naive_rate, naive_lost = _end_to_end(stream, "naive")
    dict_us = _dict_cost(make_stream(min(iterations, 400), seed=3))
    v2_us = _v2_cost(_v2_stream(min(iterations, 400)))
    ratio = ours_rate / naive_rate if naive_rate else 0.0
    name = "event_sink"
    return [
        Row(name, "received blocks/s (tcp, decoded)", ours_rate, "blk/s", naive_rate,
            ">= 15x", ratio >= 15 and ours_lost == 0),
        Row(name, "blocks lost (ours)", float(ours_lost), "blk", float(naive_lost), "0",
            ours_lost == 0),
        Row(name, "executor cost, dict input", dict_us, "us/blk", None, "<= 2 us",
            dict_us <= 2.0),
        Row(name, "executor cost, V2 hooks", v2_us, "us/blk", None, "<= 1 us", v2_us <= 1.0),
    ]


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv))
