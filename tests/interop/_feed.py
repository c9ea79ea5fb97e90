"""Replays recorded or hand-made event streams into NVIDIA Dynamo's real indexer and into a
:class:`~kvbm_plugin.routers.router_view.RouterView`, and reads back what each holds.

A scenario is a list of steps ``(stream, events)``: one batch of a (worker id, dp rank) stream.
Each stream gets its own XPUB (an ``ipc://`` path the indexer connects to from its namespace)
and its own seq from 0; the feeder waits for the indexer's subscription before sending (no
slow-joiner loss, so no replay endpoint is needed). The indexer applies each stream in order,
but streams independently of each other; so where the next step belongs to another stream,
the feeder first stores a sentinel block (its own content, at the root) on the stream it
leaves, and waits until ``/dump`` shows it: every step before it has been applied. A last
sentinel per stream ends the run. The view gets the same steps, sentinels included, in the same
order, so both sides are compared whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from kvbm_plugin.routers.dynamo_indexer import PARENT_MISSING, Indexer
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.wire.events import (
    BlockStored,
    decode_message,
    encode_batch,
    to_signed_int64,
)

Stream = tuple[int, int]  # (worker id, dp rank)
Step = tuple[Stream, Sequence[Any]]
SENTINEL_BASE = 7 << 56


def _sentinel(n: int, block_size: int) -> BlockStored:
    return BlockStored([SENTINEL_BASE + n], None,
                       [3_000_000_000 + n * block_size + i for i in range(block_size)],
                       block_size)


def with_sentinels(steps: Sequence[Step], block_size: int) -> list[tuple[Step, bool]]:
    """The steps, with a sentinel step wherever the stream changes and at the end of every
    stream; each paired with whether the feeder waits for it."""
    out: list[tuple[Step, bool]] = []
    last: dict[Stream, int] = {}
    for i, (stream, _) in enumerate(steps):
        last[stream] = i
    n = 0
    for i, (stream, events) in enumerate(steps):
        out.append(((stream, list(events)), False))
        nxt = steps[i + 1][0] if i + 1 < len(steps) else None
        if nxt != stream or last[stream] == i:
            out.append(((stream, [_sentinel(n, block_size)]), True))
            n += 1
    return out


def feed_indexer(indexer: Indexer, tmp: Path, steps: Sequence[Step], block_size: int,
                 timeout: float = 30.0) -> None:
    """Send the steps (and sentinels) to ``indexer``; returns once it applied them all."""
    ctx = zmq.Context.instance()
    pubs: dict[Stream, zmq.Socket] = {}
    seqs: dict[Stream, int] = {}
    try:
        for stream, _ in steps:
            if stream in pubs:
                continue
            pub = pubs[stream] = ctx.socket(zmq.XPUB)
            endpoint = f"ipc://{tmp}/feed-{stream[0]}-{stream[1]}"
            pub.bind(endpoint)
            indexer.register(stream[0], endpoint, None, block_size, dp_rank=stream[1])
            if not pub.poll(10_000):
                raise TimeoutError(f"the indexer never subscribed to stream {stream}")
            pub.recv()
            seqs[stream] = 0
        for (stream, events), wait in with_sentinels(steps, block_size):
            pubs[stream].send_multipart(encode_batch(b"", seqs[stream], time.time(), events,
                                                     stream[1]))
            seqs[stream] += 1
            if wait:
                key = (stream[0], stream[1], "GPU")
                h = to_signed_int64(events[0].block_hashes[0])
                indexer.wait_for(lambda h=h, key=key: h in indexer.held().get(key, ()),
                                 f"sentinel {h} on stream {stream}", timeout)
    finally:
        for pub in pubs.values():
            pub.close(0)


def feed_view(view: RouterView, steps: Sequence[Step]) -> None:
    """The same steps (and sentinels) into ``view``, the worker named by its id."""
    seqs: dict[Stream, int] = {}
    for (stream, events), _ in with_sentinels(steps, view.block_size):
        seq = seqs.get(stream, 0)
        seqs[stream] = seq + 1
        # What a router reads: the batch as the wire carries it, decoded.
        view.apply_batch(decode_message(encode_batch(b"", seq, 0.0, events, stream[1])),
                         str(stream[0]), stream=f"{stream[0]}:{stream[1]}")


def compare(indexer: Indexer, view: RouterView) -> tuple[dict, dict, int, int]:
    """``(indexer edges, view edges, indexer parent-miss lines, view parent misses)``; edges
    are ``(parent hash, hash)`` per (worker, dp rank, medium)."""
    real = {k: v for k, v in indexer.dump_edges().items() if v}
    ours = {(int(w), r, m): {(None if p is None else to_signed_int64(p), to_signed_int64(h))
                             for p, h in v}
            for (w, r, m), v in view.edges().items() if v}
    return real, ours, indexer.count(PARENT_MISSING), view.counts.skipped_stores
