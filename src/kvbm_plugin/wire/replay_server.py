"""The replay side of a publisher: answers ``[start seq]`` requests on a ROUTER, with bounds.

A replay answer is every buffered batch from ``start`` on, then the END_SEQ marker (vLLM's
protocol); a ``start`` that has left the buffer is answered per ``rolled`` (below). An answer
sent in one go would queue the whole buffer in ZMQ for a peer that may never read it (100 such
requesters hold 100 copies of the buffer and slow the live stream), so answers are sent bit by
bit, never blocking:

* the ROUTER's per-peer send queue is :data:`PEER_HWM` messages (set by the publisher), and
  ROUTER_MANDATORY makes a full queue or a vanished peer an error instead of a silent drop;
* at most ``max_active`` answers are in progress at once; up to ``max_waiting`` more requests
  wait their turn, and requests beyond that are refused (answered with END_SEQ alone, which a
  requester reads as "nothing to replay": it resyncs);
* each call sends at most ``batches_per_call`` batches in all, so the live stream keeps going;
* an answer that makes no progress for ``stall_s`` seconds (its peer does not read) is dropped;
  its peer is remembered as stalled (its queue is full) until it disconnects or reads, when it
  gets the end marker; while ``max_stalled`` peers are stalled, new requests are refused.

So what the publisher queues for replays is at most ``PEER_HWM`` batches for each of at most
``max_active + max_stalled`` peers (plus one end marker per refused request). Everything is
counted (:meth:`ReplayServer.stats`) and logged rate-limited.

Used by ``ZmqEventPublisher`` on the thread that owns its sockets (the publisher thread, or the
inline owner's thread); not thread-safe.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import struct
import time
from collections.abc import Sequence

import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.wire.events import END_SEQ

logger = logging.getLogger(__name__)
_SEQ = struct.Struct(">Q")

PEER_HWM = 64  # ROUTER SNDHWM: batches queued per replay peer
# Requests read per service call: a refusal costs a few µs, so 64 keep a turn under a
# millisecond, and reading must outpace what an outsider queues (wire/listen_brake.py).
REQUESTS_PER_CALL = 64

# What a request answers whose start seq has left the buffer (DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_
# ROLLED): "oldest", every batch still buffered (the requester sees its first seq past its
# start); "empty", the end marker alone. llm-d @ ebab6879 (pkg/kvevents/zmq_subscriber.go,
# requestReplay) fails a replay whose first seq is not the one it asked for, resets the pod,
# waits 30 s and asks again from seq 0: with "oldest" that repeats while the buffer has rolled,
# and every live batch is dropped meanwhile; an empty answer to a request from seq 0 succeeds,
# and llm-d applies the live stream from the next batch on (routers/llmd_replay.py measures both).
ROLLED_OLDEST = "oldest"
ROLLED_EMPTY = "empty"


class _Answer:
    """One replay answer in progress: what to send next to whom."""

    __slots__ = ("envelope", "start", "next_seq", "end_seq", "sent", "last_progress")

    def __init__(self, envelope: tuple[bytes, ...], start: int, end_seq: int, now: float) -> None:
        self.envelope = envelope
        self.start = start
        self.next_seq = start
        self.end_seq = end_seq  # the newest seq buffered when the request arrived
        self.sent = 0
        self.last_progress = now


class ReplayServer:
    """Bounded, incremental replay answers over one ROUTER socket."""

    def __init__(self, owner: str, topic: bytes, *, max_active: int = 4, max_waiting: int = 64,
                 batches_per_call: int = 256, stall_s: float = 2.0,
                 max_stalled: int = 16, rolled: str = ROLLED_OLDEST) -> None:
        if rolled not in (ROLLED_OLDEST, ROLLED_EMPTY):
            raise ValueError(f"{owner}: rolled={rolled!r} must be {ROLLED_OLDEST!r} or "
                             f"{ROLLED_EMPTY!r}")
        self._rolled = rolled
        self.rolled_requests = 0  # requests whose start had left the buffer
        self._owner = owner
        self._topic = topic
        self._max_active = max_active
        self._max_waiting = max_waiting
        self._per_call = batches_per_call
        self._stall_s = stall_s
        self._max_stalled = max_stalled
        # Peers whose answer was dropped with their queue full: envelope -> next probe time.
        self._stalled: dict[tuple[bytes, ...], float] = {}
        self._active: collections.deque[_Answer] = collections.deque()
        self._waiting: collections.deque[_Answer] = collections.deque()
        self._log = RateLimitedLog(logger)
        self.requests = 0
        self.bad_requests = 0
        self.batches_sent = 0
        self.aborted = 0  # the peer vanished, or its answer stalled (below)
        self.peers_dropped = 0  # answers dropped because the peer did not read
        self.refused = 0  # requests beyond max_active + max_waiting

    @property
    def busy(self) -> bool:
        """Answers are in progress or waiting, or stalled peers are left to release: call
        :meth:`service` again soon."""
        return bool(self._active or self._waiting or self._stalled)

    def stats(self) -> dict[str, int]:
        return {
            "replay_requests": self.requests,
            "replay_bad_requests": self.bad_requests,
            "replay_batches_sent": self.batches_sent,
            "replay_aborted": self.aborted,
            "replay_peers_dropped": self.peers_dropped,
            "replay_refused": self.refused,
            "replay_rolled_requests": self.rolled_requests,
            "replay_active": len(self._active),
            "replay_waiting": len(self._waiting),
            "replay_stalled_peers": len(self._stalled),
        }

    def service(self, router: zmq.Socket, buffer: collections.deque[tuple[int, bytes]],
                *, shared: bool = False) -> bool:
        """Take new requests and move the answers in progress on; never blocks. Returns
        whether every request that had arrived was read (the ROUTER had none left).

        Called by the socket-owning thread whenever the ROUTER is readable and, while
        :attr:`busy`, every few milliseconds. ``shared``: another thread appends to ``buffer``
        (``publish`` on the executor thread), so answers are sent from a copy taken once per
        call, and only when an answer is in progress (a copy per request would make reading
        requests slower than an outsider can send them).
        """
        now = time.monotonic()
        if self._stalled:
            self._probe_stalled(router, now)
        drained = self._receive(router, _ends(buffer), now)
        if self._active:
            answering = collections.deque(list(buffer)) if shared else buffer
            budget = self._per_call
            for answer in list(self._active):
                if budget <= 0:
                    break
                budget -= self._advance(router, answering, answer, budget, now)
        while self._waiting and len(self._active) < self._max_active:
            answer = self._waiting.popleft()
            answer.last_progress = now
            self._active.append(answer)
        return drained

    def _receive(self, router: zmq.Socket, ends: tuple[int, int] | None, now: float) -> bool:
        """Read up to :data:`REQUESTS_PER_CALL` requests (bounded so the live stream keeps
        flowing); True when the ROUTER had no more. ``ends``: the oldest and newest seq
        buffered (None while the buffer is empty)."""
        for _ in range(REQUESTS_PER_CALL):
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return True
            self.requests += 1
            envelope, start = parse_replay_request(frames)
            if envelope is None or start is None:
                self.bad_requests += 1
                self._log.log(logging.WARNING, "replay-bad", "%s: malformed replay request "
                              "%s (want [b'', 8-byte start seq] from a DEALER)", self._owner,
                              saferepr(frames[1:]))
                continue
            answer = _Answer(envelope, start, ends[1] if ends else -1, now)
            if ends and start < ends[0]:
                self.rolled_requests += 1
                if self._rolled == ROLLED_EMPTY:
                    # "Nothing from your start is left": the end marker alone (a strict
                    # requester then applies the live stream from its next batch).
                    with contextlib.suppress(zmq.ZMQError):
                        router.send_multipart((*envelope, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
                    continue
            if len(self._stalled) >= self._max_stalled:
                self._refuse(router, answer, f"{len(self._stalled)} requesters stopped reading")
            elif len(self._active) < self._max_active:
                self._active.append(answer)
            elif len(self._waiting) < self._max_waiting:
                self._waiting.append(answer)
            else:
                self._refuse(router, answer, f"{len(self._active)} replays in progress and "
                             f"{len(self._waiting)} waiting")
        return False

    def _refuse(self, router: zmq.Socket, answer: _Answer, why: str) -> None:
        self.refused += 1
        self._log.log(logging.WARNING, "replay-refused", "%s: replay from seq %d refused "
                      "(answered with the end marker only): %s", self._owner, answer.start, why)
        with contextlib.suppress(zmq.ZMQError):
            router.send_multipart((*answer.envelope, b"", END_SEQ, b""), flags=zmq.NOBLOCK)

    def _probe_stalled(self, router: zmq.Socket, now: float) -> None:
        """Give each stalled peer its end marker once it has room (or forget it once gone)."""
        for envelope, when in list(self._stalled.items()):
            if now < when:
                continue
            try:
                router.send_multipart((*envelope, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.Again:
                self._stalled[envelope] = now + 0.1  # still not reading
                continue
            except zmq.ZMQError:
                pass  # EHOSTUNREACH: disconnected, its queue is gone
            del self._stalled[envelope]

    def _advance(self, router: zmq.Socket, buffer: collections.deque[tuple[int, bytes]],
                 answer: _Answer, budget: int, now: float) -> int:
        """Send up to ``budget`` batches of ``answer`` (then its END_SEQ); returns how many."""
        sent = 0
        try:
            index = _first_at_or_after(buffer, answer.next_seq)
            while index < len(buffer) and sent < budget:
                seq, payload = buffer[index]
                if seq > answer.end_seq:
                    break
                router.send_multipart((*answer.envelope, self._topic, _SEQ.pack(seq), payload),
                                      flags=zmq.NOBLOCK)
                sent += 1
                answer.next_seq = seq + 1
                index += 1
            if sent < budget:  # everything up to end_seq is out: the end marker
                router.send_multipart((*answer.envelope, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
                self._active.remove(answer)
        except zmq.Again:
            # The peer's queue is full (PEER_HWM): it is not reading (yet).
            if sent:
                answer.last_progress = now
            elif now - answer.last_progress > self._stall_s:
                self._drop(answer, f"its peer read nothing for {self._stall_s:.1f}s")
                self.peers_dropped += 1
                self._stalled[answer.envelope] = now + 0.1
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the requester is gone.
            self._drop(answer, str(exc))
        else:
            if sent:
                answer.last_progress = now
        answer.sent += sent
        self.batches_sent += sent
        return sent

    def _drop(self, answer: _Answer, why: str) -> None:
        self._active.remove(answer)
        self.aborted += 1
        self._log.log(logging.WARNING, "replay-abort", "%s: replay from seq %d aborted after %d "
                      "batches: %s", self._owner, answer.start, answer.sent, why)


def _ends(buffer: collections.deque[tuple[int, bytes]]) -> tuple[int, int] | None:
    """The oldest and newest seq in ``buffer`` (None when empty); safe while another thread
    appends and evicts (each index is one atomic deque read)."""
    try:
        return buffer[0][0], buffer[-1][0]
    except IndexError:
        return None


def _first_at_or_after(buffer: collections.deque[tuple[int, bytes]], seq: int) -> int:
    """Index of the first buffered batch with a seq >= ``seq`` (len(buffer) if none).

    Buffered seqs increase by 1 except where a batch was lost before it was buffered, so
    ``seq - oldest`` is at or past the answer; step back over the rare holes.
    """
    if not buffer:
        return 0
    index = min(len(buffer), max(0, seq - buffer[0][0]))
    while index > 0 and buffer[index - 1][0] >= seq:
        index -= 1
    return index


def parse_replay_request(frames: Sequence[bytes]) -> tuple[tuple[bytes, ...] | None, int | None]:
    """``(reply envelope, start seq)`` from a ROUTER-received replay request.

    A DEALER that mimics REQ sends ``[b"", start]`` (received as ``[id, b"", start]``); a bare
    DEALER sends ``[start]`` (received as ``[id, start]``). The reply envelope repeats what came
    in. ``(None, None)`` for anything else.
    """
    if len(frames) == 3 and frames[1] == b"":
        envelope: tuple[bytes, ...] = (frames[0], b"")
        start = frames[2]
    elif len(frames) == 2:
        envelope, start = (frames[0],), frames[1]
    else:
        return None, None
    if len(start) != 8:
        return None, None
    return envelope, _SEQ.unpack(start)[0]
