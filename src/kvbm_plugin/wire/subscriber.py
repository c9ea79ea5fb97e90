"""A consumer of a KV-event stream: decodes, detects gaps, replays, and keeps the held-block view.

``StreamSubscriber`` is what a router does with our output, in miniature: ``kvbm-plugin
subscribe`` prints it live, the router model (:mod:`kvbm_plugin.routers.router_view`) feeds its
tree from it, and the demo uses it to check that a consumer's view of the consolidated stream
equals the tiers' true contents. Its own thread does the socket I/O.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import zmq

from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.events import (
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
from kvbm_plugin.wire.reconnect import BACK, JOINED, LOST, ConnectionWatch, keep_alive

__all__ = ["StreamSubscriber", "SubscriberStats", "as_json", "describe"]


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    stores: int = 0
    removes: int = 0
    clears: int = 0
    gaps: int = 0  # gap occurrences in the stream after the subscriber joined it
    missing_batches: int = 0  # batches of those gaps that replay did not recover
    replayed_batches: int = 0
    # The first seq received live, and how many batches before it (from ``start_seq``, or
    # from seq 0 without one) were neither received nor replayed: history the subscriber
    # missed by joining late, which is not a fault of the stream.
    joined_at_seq: int | None = None
    history_missing: int = 0
    malformed: int = 0
    duplicate_stores: int = 0  # STORE for a block already held (a producer bug)
    unknown_removes: int = 0  # REMOVE for a block not held (a producer bug)
    orphan_stores: int = 0  # STORE whose parent is not held (a strict router ignores it)
    restarts: int = 0  # the publisher restarted: the view was cleared and the new stream taken
    reconnects: int = 0  # the SUB reached the publisher again after losing it


@dataclass
class StreamSubscriber:
    """Connects a SUB to ``endpoint`` (and a DEALER to ``replay_endpoint`` if given).

    ``held`` maps ``(dp_rank, signed hash)`` for every block the stream says is stored, as a
    router would index it. ``start_seq`` (e.g. 0) asks the replay endpoint for the batches
    from that seq once the SUB has reached the publisher (and again when a first live message
    comes with a later seq), so batches published before the subscription took effect are not
    missed. That catch-up is the join, not a gap: ``stats.gaps`` counts only holes in the
    stream after it; what the join could not recover is ``stats.history_missing`` (without
    ``start_seq``: every batch before the first one received). Not thread-safe: one thread
    polls.

    A message that cannot be decoded is counted in ``stats.malformed`` (``last_malformed``
    says why) and skipped. A restarted publisher (its seq starts again at 0) is noticed when
    the seq goes back, and, with a replay endpoint, when a gap's replay or a reconnection's
    replay returns a different batch under the seq last applied: the view is then cleared
    (``stats.restarts``) and the new stream taken from its first buffered batch.
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
        keep_alive(self._sub)  # a publisher gone silent: lost, connected again, replayed
        self._watch = ConnectionWatch(self._sub)
        self._sub.connect(self.endpoint)
        self._dealer: zmq.Socket | None = None
        if self.replay_endpoint:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            keep_alive(self._dealer)
            self._dealer.connect(self.replay_endpoint)
        self.next_seq: int | None = self.start_seq
        self.last_malformed: str | None = None  # why the last malformed message was dropped
        self._last_payload: bytes | None = None  # payload of seq ``next_seq - 1``
        self._anchor: tuple[int, bytes] | None = None  # the last applied, when the link broke
        # Seqs [first, last] the latest replay applied: the same batches may still arrive live.
        self._replayed: tuple[int, int] | None = None
        self._started = False  # a batch has been applied (the join is over)

    @property
    def connected(self) -> bool:
        """True once the SUB has completed a handshake with a publisher at ``endpoint``
        (learnt in :meth:`poll`)."""
        return self._watch.joined

    def close(self) -> None:
        self._watch.close()
        self._sub.close(0)
        if self._dealer is not None:
            self._dealer.close(0)
        if self._own_context:
            self._ctx.term()

    def poll(self, timeout_ms: int = 100) -> list[EventBatch]:
        """Every batch available within ``timeout_ms``, in order, gaps replayed when possible.

        Each returned batch is already applied to :attr:`held` (and counted in :attr:`stats`):
        the caller reads them, it must not :meth:`apply` them again (a second apply counts
        every store as a duplicate, and every remove that comes in a later poll than its
        store as unknown)."""
        out: list[EventBatch] = []
        ready = self._sub.poll(timeout_ms)
        out.extend(self._check_connection())
        if not ready:
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            batch = self._decode(frames)
            if batch is not None:
                out.extend(self._accept(batch, frames[-1]))

    def _decode(self, frames: list[bytes]) -> EventBatch | None:
        """The decoded message, or None (counted malformed) for anything it cannot decode."""
        try:
            return decode_message(frames)
        except Exception as exc:  # WireFormatError, or anything odd input makes the codec raise
            self.stats.malformed += 1
            self.last_malformed = f"{type(exc).__name__}: {saferepr(str(exc))}"
            return None

    def _check_connection(self) -> list[EventBatch]:
        """Handle the SUB's connection events: after a reconnection, check by a replay of the
        last batch applied that the publisher is the same one, and recover what was missed."""
        out: list[EventBatch] = []
        for event in self._watch.events():
            if event == JOINED:
                # The subscription is on its way only now: ask for what came before it, so a
                # quiet stream's history arrives without waiting for a live batch.
                if not self._started and self.next_seq is not None \
                        and self._dealer is not None:
                    out.extend(self._replay(self.next_seq, None)[0])
                    if out:
                        self._started = True
            elif event == LOST:
                self._anchor = self._last_applied()
            elif event == BACK:
                self.stats.reconnects += 1
                anchor, self._anchor = self._anchor, None
                if anchor is not None and self._dealer is not None:
                    out.extend(self._replay_checked(anchor[0] + 1, None, anchor))
        return out

    def _last_applied(self) -> tuple[int, bytes] | None:
        if self.next_seq is None or self.next_seq == 0 or self._last_payload is None:
            return None
        return self.next_seq - 1, self._last_payload

    def _accept(self, batch: EventBatch, payload: bytes | None = None) -> list[EventBatch]:
        """Apply one live batch (replaying a gap before it); ``payload`` (its raw bytes) lets
        a later replay check that the publisher is still the same one."""
        out: list[EventBatch] = []
        if self.stats.joined_at_seq is None and batch.seq is not None:
            self.stats.joined_at_seq = batch.seq
            if self.next_seq is None and not self._started:
                self.stats.history_missing += batch.seq  # no start_seq: nothing asked back
        if batch.seq is not None and self.next_seq is not None:
            if batch.seq < self.next_seq:
                replayed = self._replayed
                if replayed is not None and replayed[0] <= batch.seq <= replayed[1]:
                    return out  # a replay delivered it already
                # Live seqs only go up: a lower one is a restarted publisher's new stream.
                self._restarted()
            if batch.seq > self.next_seq:
                joining = not self._started  # the catch-up of a join, not a hole
                if not joining:
                    self.stats.gaps += 1
                start, restarts = self.next_seq, self.stats.restarts
                recovered = self._replay_checked(start, batch.seq, self._last_applied())
                if self.stats.restarts != restarts:  # the new stream is counted from 0
                    start = 0
                lost = (batch.seq - start) - len(recovered)
                if joining:
                    self.stats.history_missing += lost
                else:
                    self.stats.missing_batches += lost
                out.extend(recovered)
        self._started = True
        self.apply(batch)
        out.append(batch)
        if batch.seq is not None:
            self.next_seq = batch.seq + 1
            self._last_payload = payload
            if self._replayed is not None and batch.seq > self._replayed[1]:
                self._replayed = None
        return out

    def _restarted(self) -> None:
        """The publisher restarted: its blocks are unknown now, its seq starts at 0."""
        self.stats.restarts += 1
        self.held.clear()
        self.held_with_medium.clear()
        self.next_seq = 0
        self._last_payload = None
        self._replayed = None

    def _replay_checked(self, start: int, stop: int | None,
                        verify: tuple[int, bytes] | None) -> list[EventBatch]:
        """:meth:`_replay` of [start, stop) that, given ``verify`` (the last batch applied),
        asks from its seq and first checks it comes back unchanged; if not, the publisher
        restarted: the view is cleared and [0, stop) replayed from the new stream."""
        if self._dealer is None:
            return []
        got, same = self._replay(start, stop, verify=verify)
        if same:
            return got
        self._restarted()
        return self._replay(0, stop)[0]

    def _replay(self, start: int, stop: int | None, timeout_s: float = 2.0,
                verify: tuple[int, bytes] | None = None) -> tuple[list[EventBatch], bool]:
        """Ask the replay socket for [start, stop) (stop None: all it has); apply what comes
        back in order (advancing ``next_seq``). Returns ``(batches, same)``: with ``verify``,
        the request starts at its seq, and ``same`` is False when the answer shows a
        different batch there, or ends before it (a restarted publisher). An answer that
        starts past it (no longer buffered) or no answer at all cannot tell: ``same``."""
        assert self._dealer is not None
        if verify is not None:
            start = verify[0]
        self._dealer.send_multipart([b"", encode_seq(start)])
        got: list[EventBatch] = []
        expected = start
        checking = verify
        same = True
        done = False  # the rest of the answer is read and dropped (up to its END_SEQ), so
        # that it is not taken for the answer to a later request
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._dealer.poll(50):
                continue
            frames = self._dealer.recv_multipart()
            body = frames[1:] if frames and frames[0] == b"" else frames
            # [topic, seq, payload], or [seq, payload] from publishers that send no topic
            # (vLLM); the end marker's seq frame is END_SEQ.
            if len(body) >= 2 and END_SEQ in (body[0], body[1]):
                same = same and checking is None
                break
            if len(body) == 2:
                body = [b"", body[0], body[1]]
            if done:
                continue
            if checking is not None:
                try:
                    first = decode_seq(body[-2]) if len(body) >= 2 else None
                except WireFormatError:
                    first = None
                if first == checking[0] and body[-1] == checking[1]:
                    checking = None
                    expected += 1
                    continue
                if first is None or first <= checking[0]:
                    same, done = False, True
                    continue
                checking = None  # no longer buffered: nothing to compare
                expected += 1
            replayed = self._decode(body)
            if replayed is None:
                continue
            if replayed.seq is None or replayed.seq < expected \
                    or (stop is not None and replayed.seq >= stop):
                continue
            if replayed.seq != expected:
                done = True  # a hole inside the replayed range stays a hole
                continue
            self.apply(replayed)
            got.append(replayed)
            expected += 1
            self.next_seq = expected
            self._last_payload = body[-1]
        self.stats.replayed_batches += len(got)
        if got:
            self._replayed = (got[0].seq or 0, got[-1].seq or 0)
        return got, same

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


_JSON_MAX_DEPTH = 32


def _json_safe(value: object, depth: int = 0) -> object:
    """``value`` with what JSON cannot hold replaced: non-finite floats (NaN, +-Infinity) by
    None (null), other non-JSON values (bytes, msgpack extension types, nesting deeper than
    32 levels) by their bounded repr string."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if depth < _JSON_MAX_DEPTH:
        if isinstance(value, (list, tuple)):
            return [_json_safe(item, depth + 1) for item in value]
        if isinstance(value, dict):
            return {k if isinstance(k, str) else saferepr(k): _json_safe(v, depth + 1)
                    for k, v in value.items()}
    return saferepr(value)


def as_json(batch: EventBatch) -> str:
    """One batch as a strict JSON object (RFC 8259: no NaN/Infinity; see :func:`_json_safe`:
    non-finite numbers become null)."""
    events = [event.to_wire() for event in batch.events]
    return json.dumps(_json_safe({"seq": batch.seq, "ts": batch.ts,
                                  "data_parallel_rank": batch.data_parallel_rank,
                                  "events": events}), allow_nan=False)
