"""llm-d's replay rules, as a test model: what its ZMQ subscriber does with a publisher's live
stream and replay answers (llm-d/llm-d-router @ ebab6879, ``pkg/kvevents/zmq_subscriber.go``:
``runSubscriber``, ``requestReplay``, ``invalidateReplay``, ``canAttemptReplay``; llm-d cannot
be built here, see :mod:`kvbm_plugin.routers.llmd_model`).

* On connect, with a replay endpoint and no sequence yet, it asks for a replay from seq 0.
* A replay answer must start exactly at the requested seq and go on without holes; a batch
  off that order fails it (``incomplete replay: expected sequence``). An answer that ends
  (3 frames, empty payload) before any batch fails too when the requested start was above 0
  (``sequence N was not available``), and succeeds for a start of 0.
* A failed replay resets the pod (every tier), forgets the sequence and starts a 30 s cooldown
  (``replayCooldown``); while it lasts, a live batch that would need a replay is dropped.
* Live batches: a repeat or an old seq is skipped; a gap asks for a replay from the last seq
  + 1; with no sequence yet, a batch above seq 0 asks for a replay from 0 (once per batch);
  otherwise the batch is applied in order.

Simplified: one attempt per replay (llm-d resumes an interrupted answer up to 3 times within
2 min; an answer that stops here counts as failed), no concurrency limit, no seq-reset branch.
The clock is the caller's (tests advance it past the cooldown). Who calls it: tests only;
single-threaded.
"""

from __future__ import annotations

import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence

import zmq

from kvbm_plugin.routers.llmd_model import LlmdIndexer

REPLAY_COOLDOWN_S = 30.0  # replayCooldown
ATTEMPT_IDLE_S = 2.0  # replayAttemptIdleTimeout
_SEQ = struct.Struct(">Q")


class LlmdSubscriber:
    """One llm-d subscriber for one pod: live frames in through :meth:`on_live`, replays asked
    from ``replay_endpoint`` over a DEALER, applied batches handed to ``indexer``. ``counts``:
    ``applied_live``, ``applied_replayed``, ``replays``, ``replay_failures``, ``dropped``
    (live batches not applied), ``resets``."""

    def __init__(self, indexer: LlmdIndexer, pod: str, replay_endpoint: str,
                 context: zmq.Context, clock: Callable[[], float] = time.monotonic) -> None:
        self.indexer, self.pod, self.replay_endpoint = indexer, pod, replay_endpoint
        self._ctx, self._clock = context, clock
        self.last_seq = self.last_live_seq = 0
        self.has_last_seq = self.has_last_live_seq = False
        self.last_failure: float | None = None
        self.counts: Counter = Counter()

    def can_replay(self) -> bool:
        return self.last_failure is None or self._clock() - self.last_failure >= \
            REPLAY_COOLDOWN_S

    def connect(self) -> None:
        """``runSubscriber``'s proactive replay on connect."""
        if not self.has_last_seq and self.can_replay():
            self.request_replay(0)

    def on_live(self, frames: Sequence[bytes]) -> None:
        """One live message, by ``runSubscriber``'s rules."""
        if len(frames) != 3 or len(frames[1]) < 8:
            self.counts["dropped"] += 1
            return
        seq = _SEQ.unpack(frames[1][:8])[0]
        attempted = False
        if self.has_last_live_seq and seq == self.last_live_seq:
            return
        self.last_live_seq, self.has_last_live_seq = seq, True
        if self.has_last_seq and seq <= self.last_seq:
            return
        if self.has_last_seq and seq > self.last_seq + 1:
            if not self.can_replay():
                self.counts["dropped"] += 1
                return
            attempted = True
            if not self.request_replay(self.last_seq + 1):
                self.counts["dropped"] += 1
                return
        if not self.has_last_seq and seq > 0:
            if attempted or not self.can_replay():
                self.counts["dropped"] += 1
                return
            if not self.request_replay(0):
                self.counts["dropped"] += 1
                return
        if self.has_last_seq and (seq <= self.last_seq or seq > self.last_seq + 1):
            self.counts["dropped"] += 1
            return
        self.indexer.receive(frames)
        self.counts["applied_live"] += 1
        self.last_seq, self.has_last_seq = seq, True

    def _invalidate(self) -> None:
        self.indexer.clear_pod(self.pod)
        self.counts["resets"] += 1
        self.last_seq, self.has_last_seq = 0, False
        self.last_failure = self._clock()

    def request_replay(self, start: int) -> bool:
        """``requestReplay``, one attempt."""
        self.counts["replays"] += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        replayed, expected, complete = 0, start, False
        try:
            dealer.send_multipart([b"", _SEQ.pack(start)])
            while dealer.poll(int(ATTEMPT_IDLE_S * 1000)):
                frames = dealer.recv_multipart()
                if frames and not frames[0]:
                    frames = frames[1:]
                if len(frames) == 3 and not frames[2]:
                    complete = True
                    break
                if len(frames) != 3 or len(frames[1]) < 8 or \
                        _SEQ.unpack(frames[1][:8])[0] != expected:
                    break  # malformed, or "incomplete replay: expected sequence"
                self.indexer.receive(frames)
                self.counts["applied_replayed"] += 1
                self.last_seq, self.has_last_seq = expected, True
                replayed += 1
                expected += 1
        finally:
            dealer.close(0)
        if not complete or (replayed == 0 and start > 0):
            self.counts["replay_failures"] += 1
            self._invalidate()
            return False
        self.last_failure = None
        return True


__all__ = ["ATTEMPT_IDLE_S", "REPLAY_COOLDOWN_S", "LlmdSubscriber"]
