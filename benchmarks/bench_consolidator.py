"""Consolidator ingest rate over tcp loopback vs a bare SUB + decode loop of the same messages.

A sender process (its own GIL) binds an XPUB on 127.0.0.1, waits for the subscription, then
sends a fixed stream of GPU-tier batches shaped like one engine iteration each: 4 chains of 16
blocks stored (block_size 32) and, once warm, 64 blocks of older chains removed, leaf first.
Signed int64 hashes, event maps, 3 frames, as the event sink publishes them.

In this process, two consumers take the same messages in turn:

* **bare decode**: a SUB socket, ``recv_multipart`` and ``events.decode_message`` (the shared
  tolerant decoder) per message, nothing else: the baseline. A raw ``msgpack.unpackb`` loop is
  reported too, for information.
* **consolidator**: a started :class:`KvEventConsolidator` in dedup mode whose output goes to a
  real :class:`ZmqEventPublisher` with a subscriber draining it (in the sender process); timed
  until every batch was applied and its output sent (``wait_idle``).
* **consolidator, Python loops** (information): the same with ``DYN_KVBM_NATIVE=0``, the
  reference loops of ``consolidator/core.py``; where the compiled core is built, this row is
  what it is kept for (docs/performance.md, "What each compiled loop is for").

Rate = block events (stored + removed block hashes) / seconds from "go" to done.

Rounds are paired: each round measures bare decode and the consolidator back to back (which
goes first alternates), and the target is judged on the median over rounds of each round's
ratio; the spread (lowest and highest round) is printed with it. A shared machine's load moves
both consumers of one round together, not the ratio.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from benchmarks._table import Row, print_table
from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    NATIVE,
    OUTPUT_ENDPOINT,
    load_consolidator_config,
)
from kvbm_plugin.wire.events import decode_message

CHAINS = 4  # stored chains per iteration
CHAIN_LEN = 16  # blocks per chain
BLOCK_SIZE = 32  # tokens per block
KEEP = 2  # iterations a chain stays resident before it is removed
TARGET_RATIO = 0.5
TARGET_RATE = 300_000.0


def build_messages(count: int) -> tuple[list[list[bytes]], int]:
    """``count`` pre-encoded 3-frame batches and the block events they carry."""
    messages: list[list[bytes]] = []
    live: deque[list[int]] = deque()
    block_events = 0
    token = 0
    hash_state = 0x9E3779B97F4A7C15
    for seq in range(count):
        events: list[dict[str, Any]] = []
        for _ in range(CHAINS):
            hashes = []
            for _ in range(CHAIN_LEN):
                # A cheap deterministic 64-bit mix, as signed int64 (the wire form).
                hash_state = (hash_state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
                hashes.append(hash_state - (1 << 64) if hash_state >= 1 << 63 else hash_state)
            tokens = list(range(token, token + CHAIN_LEN * BLOCK_SIZE))
            token += CHAIN_LEN * BLOCK_SIZE
            events.append({"type": "BlockStored", "block_hashes": hashes,
                           "parent_block_hash": None, "token_ids": tokens,
                           "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU",
                           "lora_name": None})
            live.append(hashes)
            block_events += CHAIN_LEN
        if len(live) > KEEP * CHAINS:
            gone = [h for _ in range(CHAINS) for h in reversed(live.popleft())]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
            block_events += len(gone)
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        messages.append([b"", seq.to_bytes(8, "big"), payload])
    return messages, block_events


def _sender(conn: Any, count: int) -> None:
    """Sender process: serves runs on request until told to stop."""
    messages, block_events = build_messages(count)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the consumer's pace is what we measure
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # see every run's subscription, not just the first
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    conn.send((port, block_events))
    while True:
        command = conn.recv()
        if command is None:
            break
        output_endpoint = command
        drained = [0]
        stop = threading.Event()
        drain_thread = None
        if output_endpoint:
            drain_thread = threading.Thread(target=_drain, args=(ctx, output_endpoint, drained,
                                                                 stop), daemon=True)
            drain_thread.start()
        while True:  # wait for this run's subscription (skip earlier unsubscriptions)
            if not pub.poll(30000):
                raise RuntimeError("no subscriber")
            if pub.recv()[:1] == b"\x01":
                break
        conn.send("subscribed")
        conn.recv()  # go
        for frames in messages:
            pub.send_multipart(frames, copy=False)
        conn.send("sent")
        conn.recv()  # run over
        stop.set()
        if drain_thread is not None:
            drain_thread.join()
        conn.send(drained[0])
    pub.close()
    ctx.term()


def _drain(ctx: zmq.Context, endpoint: str, drained: list[int], stop: threading.Event) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(50):
            while True:
                try:
                    sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                drained[0] += 1
    sub.close(0)


def _recv(conn: Any, timeout: float = 120.0) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError("sender process stopped answering")
    return conn.recv()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_bare(conn: Any, port: int, count: int, raw_only: bool) -> float:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        conn.send("")
        assert _recv(conn) == "subscribed"
        recv = sub.recv_multipart
        start = time.perf_counter()
        conn.send("go")
        if raw_only:
            for _ in range(count):
                msgpack.unpackb(recv()[2], raw=False, strict_map_key=False)
        else:
            for _ in range(count):
                decode_message(recv())
        elapsed = time.perf_counter() - start
        assert _recv(conn) == "sent"
        conn.send("over")
        _recv(conn)
        return elapsed
    finally:
        sub.close(0)


def _run_consolidator(conn: Any, port: int, count: int, python_loops: bool = False
                      ) -> tuple[float, dict[str, int]]:
    out_port = _free_port()
    config = load_consolidator_config({
        EVENTS_ENDPOINT: f"tcp://127.0.0.1:{port}",
        OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{out_port}",
    })
    # The core picks its loops when it is made, from DYN_KVBM_NATIVE (this process's own).
    saved = os.environ.get(NATIVE)
    os.environ[NATIVE] = "0" if python_loops else "1"
    try:
        consolidator = KvEventConsolidator(config)
    finally:
        if saved is None:
            del os.environ[NATIVE]
        else:
            os.environ[NATIVE] = saved
    consolidator.start()
    try:
        conn.send(f"tcp://127.0.0.1:{out_port}")
        assert _recv(conn) == "subscribed"
        start = time.perf_counter()
        conn.send("go")
        deadline = time.monotonic() + 600
        while consolidator.stats()["batches_applied"] < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"consolidator stalled: {consolidator.stats()}")
            time.sleep(0.005)
        if not consolidator.wait_idle(60.0):
            raise RuntimeError("consolidator output never drained")
        elapsed = time.perf_counter() - start
        assert _recv(conn) == "sent"
        conn.send("over")
        _recv(conn)
        stats = consolidator.stats()
    finally:
        consolidator.shutdown(5.0)
    return elapsed, stats


def run(quick: bool = False) -> list[Row]:
    """Measure both consumers on the same messages; rows for the README table."""
    count = 300 if quick else 3000
    rounds = 3 if quick else 9
    # Both loop implementations where the compiled one is built; the Python one alone otherwise.
    both = _compiled.loops("consolidator") is not None
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=_sender, args=(child, count), daemon=True)
    proc.start()
    try:
        port, block_events = _recv(parent)
        bare, raw, cons, python = [], [], [], []
        stats: dict[str, int] = {}
        for i in range(rounds):
            if i % 2:
                elapsed, stats = _run_consolidator(parent, port, count)
                cons.append(block_events / elapsed)
            bare.append(block_events / _run_bare(parent, port, count, raw_only=False))
            if not i % 2:
                elapsed, stats = _run_consolidator(parent, port, count)
                cons.append(block_events / elapsed)
            raw.append(block_events / _run_bare(parent, port, count, raw_only=True))
            if both:
                elapsed, _ = _run_consolidator(parent, port, count, python_loops=True)
                python.append(block_events / elapsed)
        parent.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    if stats.get("malformed") or stats.get("gaps") or stats.get("resyncs"):
        raise RuntimeError(f"benchmark stream was not clean: {stats}")
    rate, bare_rate, raw_rate = (statistics.median(x) for x in (cons, bare, raw))
    ratios = [c / b for c, b in zip(cons, bare, strict=True)]
    ratio = statistics.median(ratios)
    loops = "compiled core" if both else "Python loops: the compiled core is not in use"
    rows = [
        Row("consolidator", f"ingest, dedup, tcp loopback, vs bare decode ({loops}; paired "
            f"median of {rounds} rounds, spread {min(ratios):.2f}-{max(ratios):.2f}x; "
            f"{rate / 1e3:,.0f}k vs {bare_rate / 1e3:,.0f}k block-events/s, medians)", ratio,
            "x", target=f">= {TARGET_RATIO}x", passed=ratio >= TARGET_RATIO),
        Row("consolidator", f"ingest, dedup, tcp loopback (absolute; rounds {min(cons) / 1e3:,.0f}k"
            f"-{max(cons) / 1e3:,.0f}k)", rate, "block-events/s",
            target=f">= {TARGET_RATE / 1000:.0f}k", passed=rate >= TARGET_RATE),
        Row("consolidator", "bare SUB + msgpack.unpackb only (info)", raw_rate,
            "block-events/s"),
        Row("consolidator", "output batches per input batch (info)",
            stats["batches_out"] / max(1, stats["batches_applied"]), "ratio"),
    ]
    if python:
        py_ratios = [p / b for p, b in zip(python, bare, strict=True)]
        rows.append(Row("consolidator", "ingest, dedup, tcp loopback, Python loops "
                        f"(DYN_KVBM_NATIVE=0; info; rounds {min(python) / 1e3:,.0f}k-"
                        f"{max(python) / 1e3:,.0f}k; vs bare decode "
                        f"{statistics.median(py_ratios):.2f}x, spread {min(py_ratios):.2f}-"
                        f"{max(py_ratios):.2f}x)", statistics.median(python), "block-events/s"))
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv[1:]))
