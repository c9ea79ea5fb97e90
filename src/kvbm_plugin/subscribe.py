"""A consumer of a KV-event stream: decodes, detects gaps, replays, and keeps the held-block view.

``StreamSubscriber`` is what a router does with our output, in miniature; ``kvbm-plugin
subscribe`` prints it live, and the demo uses it to check that a consumer's view of the
consolidated stream equals the tiers' true contents.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from kvbm_plugin.consolidator_config import ConfigError, parse_endpoint
from kvbm_plugin.events import (
    END_SEQ,
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireFormatError,
    decode_message,
    decode_seq,
    encode_seq,
    to_signed_int64,
)


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    stores: int = 0
    removes: int = 0
    clears: int = 0
    gaps: int = 0  # gap occurrences
    missing_batches: int = 0  # batches not received and not recovered by replay
    replayed_batches: int = 0
    malformed: int = 0
    duplicate_stores: int = 0  # STORE for a block already held (a producer bug)
    unknown_removes: int = 0  # REMOVE for a block not held (a producer bug)
    orphan_stores: int = 0  # STORE whose parent is not held (a strict router ignores it)


@dataclass
class StreamSubscriber:
    """Connects a SUB to ``endpoint`` (and a DEALER to ``replay_endpoint`` if given).

    ``held`` maps ``(dp_rank, signed hash)`` for every block the stream says is stored, as a
    router would index it. ``start_seq`` (e.g. 0) makes a first message with a later seq a gap
    to replay, so batches published before the subscription took effect are not missed.
    Not thread-safe: one thread polls.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: bytes = b""
    context: zmq.Context | None = None
    start_seq: int | None = None
    held: set[tuple[int, int]] = field(default_factory=set)
    # (dp_rank, signed hash, medium): the per-tier view a passthrough stream describes.
    held_with_medium: set[tuple[int, int, str]] = field(default_factory=set)
    stats: SubscriberStats = field(default_factory=SubscriberStats)

    def __post_init__(self) -> None:
        self._own_context = self.context is None
        self._ctx = self.context or zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)
        self._dealer: zmq.Socket | None = None
        if self.replay_endpoint:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        self.next_seq: int | None = self.start_seq

    def close(self) -> None:
        self._sub.close(0)
        if self._dealer is not None:
            self._dealer.close(0)
        if self._own_context:
            self._ctx.term()

    def poll(self, timeout_ms: int = 100) -> list[EventBatch]:
        """Every batch available within ``timeout_ms``, in order, gaps replayed when possible."""
        out: list[EventBatch] = []
        if not self._sub.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                batch = decode_message(frames)
            except WireFormatError:
                self.stats.malformed += 1
                continue
            out.extend(self._accept(batch))

    def _accept(self, batch: EventBatch) -> list[EventBatch]:
        out: list[EventBatch] = []
        if batch.seq is not None and self.next_seq is not None:
            if batch.seq < self.next_seq:
                return out  # already applied (e.g. delivered by a replay)
            if batch.seq > self.next_seq:
                self.stats.gaps += 1
                recovered = self._replay(self.next_seq, batch.seq)
                self.stats.missing_batches += (batch.seq - self.next_seq) - len(recovered)
                out.extend(recovered)
        self.apply(batch)
        out.append(batch)
        if batch.seq is not None:
            self.next_seq = batch.seq + 1
        return out

    def _replay(self, start: int, stop: int, timeout_s: float = 2.0) -> list[EventBatch]:
        """Ask the replay socket for [start, stop); apply and return what comes back in order."""
        if self._dealer is None:
            return []
        self._dealer.send_multipart([b"", encode_seq(start)])
        got: list[EventBatch] = []
        expected = start
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._dealer.poll(50):
                continue
            frames = self._dealer.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) >= 2 and body[1] == END_SEQ:
                break
            try:
                replayed = decode_message(body)
            except WireFormatError:
                self.stats.malformed += 1
                continue
            if replayed.seq is None or replayed.seq < expected or replayed.seq >= stop:
                continue
            if replayed.seq != expected:
                break  # a hole inside the replayed range stays a hole
            self.apply(replayed)
            got.append(replayed)
            expected += 1
        self.stats.replayed_batches += len(got)
        return got

    def apply(self, batch: EventBatch) -> None:
        """Update ``held`` the way a router's index would."""
        rank = batch.data_parallel_rank or 0
        self.stats.batches += 1
        for event in batch.events:
            self.stats.events += 1
            if isinstance(event, BlockStored):
                self.stats.stores += 1
                parent = event.parent_block_hash
                if parent is not None and (rank, to_signed_int64(parent)) not in self.held:
                    self.stats.orphan_stores += 1
                medium = event.medium or "GPU"
                for h in event.block_hashes:
                    key = (rank, to_signed_int64(h))
                    if key in self.held and (*key, medium) in self.held_with_medium:
                        self.stats.duplicate_stores += 1
                    self.held.add(key)
                    self.held_with_medium.add((*key, medium))
            elif isinstance(event, BlockRemoved):
                self.stats.removes += 1
                medium = event.medium or "GPU"
                for h in event.block_hashes:
                    key = (rank, to_signed_int64(h))
                    if (*key, medium) not in self.held_with_medium:
                        self.stats.unknown_removes += 1
                    self.held_with_medium.discard((*key, medium))
                    if not any((*key, m) in self.held_with_medium for m in MEDIA):
                        self.held.discard(key)
            elif isinstance(event, AllBlocksCleared):
                self.stats.clears += 1
                self.held = {k for k in self.held if k[0] != rank}
                self.held_with_medium = {k for k in self.held_with_medium if k[0] != rank}


def describe(batch: EventBatch) -> list[str]:
    """Human-readable lines for one batch."""
    head = f"seq={batch.seq} dp={batch.data_parallel_rank} ts={batch.ts:.6f}"
    lines = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            hashes = [to_signed_int64(h) for h in event.block_hashes]
            parent = (None if event.parent_block_hash is None
                      else to_signed_int64(event.parent_block_hash))
            lines.append(f"{head} STORE  {event.medium} blocks={len(hashes)} hashes={hashes} "
                         f"parent={parent} tokens={len(event.token_ids)} "
                         f"block_size={event.block_size}")
        elif isinstance(event, BlockRemoved):
            hashes = [to_signed_int64(h) for h in event.block_hashes]
            lines.append(f"{head} REMOVE {event.medium} blocks={len(hashes)} hashes={hashes}")
        else:
            lines.append(f"{head} CLEAR")
    return lines


def as_json(batch: EventBatch) -> str:
    events = []
    for event in batch.events:
        wire = event.to_wire()
        events.append(wire)
    return json.dumps({"seq": batch.seq, "ts": batch.ts,
                       "data_parallel_rank": batch.data_parallel_rank, "events": events})


def main_subscribe(argv: Sequence[str] | None = None) -> int:
    from kvbm_plugin.cli import ArgumentParser  # one-line usage errors, like every command

    parser = ArgumentParser(
        prog="kvbm-plugin subscribe",
        description="Print a live KV-event stream, with gap detection and optional replay.")
    parser.add_argument("endpoint", help="tcp://host:port, ipc://path or a port on localhost")
    parser.add_argument("--replay", metavar="ENDPOINT", help="replay ROUTER to fill gaps")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to")
    parser.add_argument("--json", action="store_true", help="one JSON object per batch")
    parser.add_argument("--from-seq", type=int, default=None,
                        help="expect the stream from this seq (replays what came before)")
    parser.add_argument("--count", type=int, default=0, help="exit after N batches (0 = never)")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="exit after this many seconds (0 = never)")
    _add_tree_arguments(parser)
    args = parser.parse_args(argv)
    if args.tree:
        return _run_tree(parser, args)
    try:
        endpoint = parse_endpoint("endpoint", args.endpoint, default_host="127.0.0.1").connect
        replay = (None if args.replay is None else
                  parse_endpoint("--replay", args.replay, default_host="127.0.0.1").connect)
    except ConfigError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    subscriber = StreamSubscriber(endpoint, replay, topic=args.topic.encode(),
                                  start_seq=args.from_seq)
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    reported_gaps = 0
    try:
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            for batch in subscriber.poll(100):
                if args.json:
                    print(as_json(batch), flush=True)
                else:
                    for line in describe(batch):
                        print(line, flush=True)
                if args.count and subscriber.stats.batches >= args.count:
                    stop.set()
            if subscriber.stats.gaps != reported_gaps:
                reported_gaps = subscriber.stats.gaps
                print(f"# gap detected: {subscriber.stats.missing_batches} batches missing so "
                      f"far ({subscriber.stats.replayed_batches} replayed)", file=sys.stderr,
                      flush=True)
    finally:
        subscriber.close()
    print(f"# {subscriber.stats}", file=sys.stderr)
    return 0


def _add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", action="store_true",
                        help="keep a strict router's radix trees of the stream and print their "
                             "summary and rule counts (periodically and at exit) instead of "
                             "the events")
    parser.add_argument("--block-size", type=int, default=None,
                        help="--tree: the router's block size (default: the first store's)")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="--tree: seconds between summaries (default 5)")


def _run_tree(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``subscribe --tree``: a :class:`~kvbm_plugin.router_view.TreeSubscriber` on the stream,
    its summary printed every ``--interval`` seconds and at exit."""
    from kvbm_plugin.router_view import LazyTreeSubscriber

    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    try:
        endpoint = parse_endpoint("endpoint", args.endpoint, default_host="127.0.0.1").connect
        replay = (None if args.replay is None else
                  parse_endpoint("--replay", args.replay, default_host="127.0.0.1").connect)
    except ConfigError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    subscriber = LazyTreeSubscriber(endpoint, replay, topic=args.topic.encode(),
                                    start_seq=args.from_seq, block_size=args.block_size)
    now = time.monotonic()
    deadline = now + args.duration if args.duration > 0 else None
    next_summary = now + args.interval

    def summary(final: bool) -> None:
        head = "final" if final else time.strftime("%H:%M:%S")
        print(f"# {head}: {subscriber.stats.batches} batches, {subscriber.stats.gaps} gaps",
              flush=True)
        for line in subscriber.summary_lines():
            print(f"  {line}", flush=True)

    try:
        while not stop.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if now >= next_summary:
                summary(False)
                next_summary = now + args.interval
            subscriber.poll(100)
            if args.count and subscriber.stats.batches >= args.count:
                break
    finally:
        subscriber.close()
    summary(True)
    return 0


__all__ = ["StreamSubscriber", "SubscriberStats", "decode_seq", "describe", "main_subscribe"]
