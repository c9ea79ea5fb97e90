"""The consolidator shell's GPU-tier streams: sequence checks, replays, resyncs, and the
decode and apply of each batch.

:class:`GpuStreams`, owned by :class:`~kvbm_plugin.consolidator.service.KvEventConsolidator`,
handles what arrives from each rank's GPU-tier publisher: a SUB's live batches and a DEALER's
replays, and the batches handed over in the same process. Everything here runs on the
consolidator's ingest thread, which owns the sockets and the core; the registration and
output side is in ``service.py``.

A rank's stream is in order when each batch's seq is the one after the last applied. A gap is
filled from the rank's replay endpoint (live batches wait meanwhile) or, where it cannot be, the
rank's GPU residency is resynced (treated as cleared until new stores arrive). A replay after a
reconnection first checks that the last batch applied comes back unchanged, to tell a restarted
publisher from a network blip.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.consolidator.core import ConsolidatorCore, UnknownMediumError
from kvbm_plugin.consolidator_config import ConsolidatorConfig
from kvbm_plugin.wire.events import (
    END_SEQ,
    EncodedBatch,
    WireFormatError,
    decode_seq,
    encode_seq,
    events_as_maps,
)
from kvbm_plugin.wire.reconnect import BACK, JOINED, LOST, ConnectionWatch, keep_alive


class _Replay:
    """A replay in flight for one stream: live messages wait in ``pending`` until it ends."""

    __slots__ = ("deadline", "pending", "failed", "startup", "verify")

    def __init__(self, deadline: float, startup: bool = False,
                 verify: tuple[int, bytes] | None = None) -> None:
        self.deadline = deadline
        self.pending: list[list[bytes]] = []
        self.failed = False  # a hole inside the replayed range was already resynced
        self.startup = startup  # the catch-up request sent at start (publisher may be absent)
        # (seq, payload) of a batch already applied: the first answer must repeat it byte for
        # byte, or the publisher is not the one that sent it (it restarted).
        self.verify = verify


class _Stream:
    """The GPU-tier stream of one rank: its sockets and sequence state (ingest thread only)."""

    __slots__ = ("rank", "sub", "dealer", "watch", "expected", "replay", "dp_ranks", "seen",
                 "last_payload", "anchor")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.sub: zmq.Socket | None = None
        self.dealer: zmq.Socket | None = None
        self.watch: ConnectionWatch | None = None  # the SUB's connection events
        self.expected = 0  # next seq; a first message above 0 is a gap (joined late)
        self.replay: _Replay | None = None
        self.dp_ranks: set[int] = {rank}  # dp ranks this stream's batches named
        self.seen = False
        self.last_payload: bytes | None = None  # payload of seq ``expected - 1`` (a reference)
        # (seq, payload) of the last batch applied when the connection was lost: checked by a
        # replay once it is back, to tell a restarted publisher from a network blip.
        self.anchor: tuple[int, bytes] | None = None

    def last_applied(self) -> tuple[int, bytes] | None:
        """(seq, payload) of the last batch applied with a seq, if any."""
        if not self.seen or self.expected == 0 or self.last_payload is None:
            return None
        return self.expected - 1, self.last_payload


class GpuStreams:
    """Sequence, replay and apply for the GPU-tier streams of one consolidator.

    Owned by :class:`~kvbm_plugin.consolidator.service.KvEventConsolidator`, which makes it in
    its constructor and lends it the core, the ZMQ context, its rate-limited log and its
    counters (``counts``, a dict the shell's ``stats`` reads). Everything here runs on the
    consolidator's ingest thread; the shell's loop calls :meth:`on_live`,
    :meth:`drain_replay`, :meth:`on_connection_event`, :meth:`replay_failed`,
    :meth:`apply_direct` and :meth:`resync`, and sets :attr:`poller` and :attr:`by_dealer`
    once it has opened the sockets."""

    def __init__(self, config: ConsolidatorConfig, core: ConsolidatorCore, ctx: zmq.Context,
                 log: RateLimitedLog, counts: dict[str, int], *, replay_timeout: float,
                 max_pending: int,
                 engine_observer: Callable[[int, list[Any]], None] | None = None) -> None:
        self.config = config
        self._core = core
        self._ctx = ctx
        self._log = log
        self._c = counts
        self._replay_timeout = replay_timeout
        self._max_pending = max_pending
        # Ingest-loop failures since the last message applied cleanly: sets the shell's back-off.
        self.loop_failures = 0
        # The ingest thread's poller and DEALER -> stream map (set by the shell's loop).
        self.poller = zmq.Poller()
        self.by_dealer: dict[Any, _Stream] = {}
        # Called on the ingest thread with (dp rank, the batch's raw event maps) after each
        # GPU-tier batch was applied; must be cheap and thread-safe (the leader queues them
        # for itself).
        self.engine_observer = engine_observer
        # Where the GPU-tier streams are TensorRT-LLM's own: turns each batch's events into
        # the fields the core accepts (consolidator.engine_forms.EngineForms); set before the
        # ingest thread starts.
        self.engine_forms: Callable[[int, list[Any]], list[Any]] | None = None

    def open_dealer(self, stream: _Stream, poller: zmq.Poller) -> zmq.Socket | None:
        endpoint = self.config.stream_replay(stream.rank)
        if endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        keep_alive(dealer)  # a rank gone silent: connected again, its replays answered
        dealer.connect(endpoint.connect)
        poller.register(dealer, zmq.POLLIN)
        return dealer

    def on_live(self, stream: _Stream, frames: list[bytes]) -> None:
        if stream.replay is not None:
            if len(stream.replay.pending) < self._max_pending:
                stream.replay.pending.append(frames)
                return
            # The replay takes too long for the live rate: give it up.
            self._c["replay_failures"] += 1
            self._finish_replay(stream, incomplete=True)
        self._on_message(stream, frames, live=True)

    def _on_message(self, stream: _Stream, frames: list[bytes], live: bool) -> None:
        """Sequence check, then apply. ``live`` False: the frames came from a replay."""
        if len(frames) == 3:
            try:
                seq = decode_seq(frames[1])
            except WireFormatError as exc:
                self._bad_message(stream, exc)
                return
            payload = frames[2]
        elif len(frames) == 2:
            seq, payload = None, frames[1]  # no seq: nothing to check
        else:
            self._bad_message(stream, WireFormatError(
                f"message has {len(frames)} frames, expected 2 or 3"))
            return
        if seq is not None:
            expected = stream.expected
            if seq != expected:
                if not live:
                    if seq < expected:
                        return  # already applied
                    if stream.seen:
                        # A hole inside the replayed range: what is missing is gone.
                        self._c["unfillable_gaps"] += 1
                        if stream.replay is not None:
                            stream.replay.failed = True
                        self.resync(stream, f"replay from seq {expected} skipped to {seq}")
                elif seq < expected:
                    # The publisher restarted (its seq starts at 0 again): its GPU pool is new.
                    self._c["restarts"] += 1
                    self.resync(stream, f"seq went back from {expected - 1} to {seq}")
                    stream.expected = 0
                    stream.last_payload = None
                    if seq != 0:
                        self._gap(stream, frames, seq)
                        return
                else:
                    self._gap(stream, frames, seq)
                    return
            stream.expected = seq + 1
            stream.last_payload = payload
        if not stream.seen:
            stream.seen = True
            if seq:  # batches before this one are gone for good
                self._c["late_joins"] += 1
        self._apply_payload(stream, payload)

    def _gap(self, stream: _Stream, frames: list[bytes], seq: int) -> None:
        """Live ``seq`` arrived past ``stream.expected``: replay the hole or resync."""
        first = not stream.seen  # joined late: nothing of ours to repair, just catch up
        if not first:
            self._c["gaps"] += 1
        start = stream.expected
        if stream.dealer is not None:
            # From the last batch applied, not the first missing one: if that batch comes back
            # different, the publisher restarted and the higher seq is not a gap in our stream.
            self._request_replay(stream, start, verify=stream.last_applied())
            stream.replay.pending.append(frames)  # type: ignore[union-attr]
            return
        if not first:
            self._c["unfillable_gaps"] += 1
            self.resync(stream, f"seq {start}..{seq - 1} lost and no replay endpoint")
        stream.expected = seq
        self._on_message(stream, frames, live=True)

    def _request_replay(self, stream: _Stream, start: int, startup: bool = False,
                        verify: tuple[int, bytes] | None = None) -> None:
        """Ask the rank's publisher for its batches from ``start`` on (from ``verify``'s seq
        when given: that batch must come back unchanged first, see :class:`_Replay`)."""
        assert stream.dealer is not None
        self._c["replay_requests"] += 1
        first = start if verify is None else verify[0]
        # zmq.Again: not connected yet; the deadline turns this into a failed replay.
        with contextlib.suppress(zmq.Again):
            stream.dealer.send_multipart([b"", encode_seq(first)], zmq.NOBLOCK)
        stream.replay = _Replay(time.monotonic() + self._replay_timeout, startup, verify)

    def _renew_dealer(self, stream: _Stream) -> None:
        """A fresh DEALER, so a late answer to an abandoned request cannot be taken for the
        answer to a later one."""
        if stream.dealer is None:
            return
        self.by_dealer.pop(stream.dealer, None)
        self.poller.unregister(stream.dealer)
        stream.dealer.close(linger=0)
        stream.dealer = self.open_dealer(stream, self.poller)
        if stream.dealer is not None:
            self.by_dealer[stream.dealer] = stream

    def on_connection_event(self, stream: _Stream, event: str) -> None:
        """The rank's SUB reached its publisher for the first time, lost it, or reached one
        again (ingest thread)."""
        if event == JOINED:
            # Our subscription is on its way only now: what the rank published before reached
            # us nowhere live, and the stream may stay quiet after it, so no later seq would
            # show the gap. Everything its replay buffer still holds is asked for now (a live
            # batch that came first has already started that replay).
            if stream.dealer is not None and not stream.seen and stream.replay is None:
                self._request_replay(stream, stream.expected, startup=True)
            return
        if event == LOST:
            stream.anchor = stream.last_applied()
            return
        assert event == BACK
        self._c["reconnects"] += 1
        anchor, stream.anchor = stream.anchor, None
        if not stream.seen:
            return  # nothing applied yet: the seq alone tells where the new stream starts
        if stream.dealer is None:
            # Batches sent while disconnected are gone and a restart cannot be told from a
            # blip: what the rank held may have changed, so treat it as cleared.
            self.resync(stream, "reconnected to the publisher without a replay endpoint")
            stream.seen, stream.expected, stream.last_payload = False, 0, None
            return
        if anchor is None:
            return
        # Replay from the last batch applied before the connection was lost: unchanged means
        # the same publisher (and the replay fills whatever was missed meanwhile).
        pending: list[list[bytes]] = []
        if stream.replay is not None:
            pending = stream.replay.pending
            self._renew_dealer(stream)
        if stream.dealer is not None:
            self._request_replay(stream, anchor[0] + 1, verify=anchor)
            stream.replay.pending.extend(pending)  # type: ignore[union-attr]
        else:
            for frames in pending:
                self._on_message(stream, frames, live=True)

    def publisher_restarted(self, stream: _Stream, why: str) -> None:
        """A replay showed that the rank's publisher is not the one whose batches were
        applied: forget the old stream, then take the new one from its first buffered batch."""
        self._c["restarts"] += 1
        self.resync(stream, f"publisher restarted ({why})")
        pending = stream.replay.pending if stream.replay is not None else []
        stream.replay = None
        stream.seen, stream.expected, stream.last_payload = False, 0, None
        self._renew_dealer(stream)
        if stream.dealer is None:
            for frames in pending:
                self._on_message(stream, frames, live=True)
            return
        self._request_replay(stream, 0, startup=True)
        stream.replay.pending.extend(pending)  # type: ignore[union-attr]

    def drain_replay(self, stream: _Stream, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if stream.replay is None:
                continue  # a late reply to a replay we gave up on
            # Replies are [b"", topic, seq, payload] (DEALER keeps the empty delimiter);
            # older publishers omit the topic. The end marker's seq frame is END_SEQ.
            body = frames[1:] if len(frames) == 4 and frames[0] == b"" else frames
            verify = stream.replay.verify
            if len(body) >= 2 and (body[1] == END_SEQ or body[0] == END_SEQ):
                if verify is not None:
                    self.publisher_restarted(stream, f"its replay no longer holds seq "
                                              f"{verify[0]}")
                    return
                self._finish_replay(stream, incomplete=False)
                return
            if len(body) == 2:
                body = [b"", body[0], body[1]]
            if verify is not None:
                try:
                    first = decode_seq(body[1]) if len(body) == 3 else None
                except WireFormatError:
                    first = None
                if first is not None and first > verify[0]:
                    # The buffer no longer holds it: nothing to compare. What follows is checked
                    # as any replay is (a hole is resynced).
                    stream.replay.verify = None
                elif first == verify[0] and body[2] == verify[1]:
                    stream.replay.verify = None  # the same publisher: go on with the replay
                    continue
                else:
                    self.publisher_restarted(stream, f"its replay of seq {verify[0]} differs "
                                              "from the batch applied")
                    return
            self._c["replayed_batches"] += 1
            self._on_message(stream, body, live=False)

    def replay_failed(self, stream: _Stream) -> None:
        assert stream.replay is not None
        if not stream.replay.startup:  # at start the rank's publisher may simply not be up
            self._c["replay_failures"] += 1
        self._renew_dealer(stream)
        self._finish_replay(stream, incomplete=True)

    def _finish_replay(self, stream: _Stream, incomplete: bool) -> None:
        """Apply the live messages held back during the replay, resyncing over any hole."""
        replay = stream.replay
        assert replay is not None
        stream.replay = None
        for frames in replay.pending:
            try:
                seq = decode_seq(frames[1]) if len(frames) == 3 else None
            except WireFormatError:
                seq = None
            if seq is not None and seq > stream.expected:
                # The replay did not reach this message: the rest of the hole is lost.
                if stream.seen and not replay.failed:
                    self._c["unfillable_gaps"] += 1
                    self.resync(stream, f"replay ended at seq {stream.expected}, live stream "
                                 f"resumed at {seq}" + (" (timed out)" if incomplete else ""))
                replay.failed = True
                stream.expected = seq
            if seq is not None and seq < stream.expected:
                continue  # the replay already applied it
            self._on_message(stream, frames, live=True)

    def resync(self, stream: _Stream, why: str) -> None:
        self._log.log(logging.WARNING, f"resync-{stream.rank}", "rank %d: GPU-tier events lost "
                      "(%s); its GPU residency is treated as cleared until new stores arrive",
                      stream.rank, why)
        for dp_rank in sorted(stream.dp_ranks):
            self._core.resync(dp_rank)

    def _apply_payload(self, stream: _Stream, payload: bytes) -> None:
        """Decode and apply one message's payload; whatever it raises stays with this message.

        Bad input is expected to raise WireFormatError (counted as malformed) inside; anything
        else escaping (a bug met by odd input) is counted in ``message_errors`` and logged
        rate-limited, so one message can neither stop nor slow down the ingest loop.
        """
        try:
            self._apply_payload_unguarded(stream, payload)
        except Exception as exc:
            self._c["message_errors"] += 1
            self._log.log(logging.ERROR, "message-error", "rank %d: message dropped, applying "
                          "it raised %s: %s", stream.rank, type(exc).__name__,
                          saferepr(str(exc)))
            return
        self.loop_failures = 0

    def apply_direct(self, stream: _Stream, dp_rank: int, events: Any) -> None:
        """Apply a batch handed over in this process (``take_gpu_batch``), guarded as
        :meth:`_apply_payload` is; an encoded batch is decoded here, on the ingest thread."""
        try:
            if type(events) is EncodedBatch:
                events = events_as_maps(events)
            self._apply_batch(stream, dp_rank, events)
        except Exception as exc:
            self._c["message_errors"] += 1
            self._log.log(logging.ERROR, "message-error", "rank %d: handed-over batch dropped, "
                          "applying it raised %s: %s", stream.rank, type(exc).__name__,
                          saferepr(str(exc)))
            return
        self.loop_failures = 0

    def _apply_payload_unguarded(self, stream: _Stream, payload: bytes) -> None:
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types
            self._bad_message(stream, WireFormatError(f"payload is not msgpack ({exc}): "
                                                      f"{bytes(payload[:32])!r}"))
            return
        if type(batch) is not list or not 2 <= len(batch) <= 3 or type(batch[1]) is not list:
            self._bad_message(stream, WireFormatError(f"payload is not [ts, events, dp_rank]: "
                                                      f"{saferepr(batch)}"))
            return
        dp_rank = batch[2] if len(batch) == 3 else None
        if dp_rank is None:
            dp_rank = stream.rank
        elif type(dp_rank) is not int or dp_rank < 0:
            self._bad_message(stream, WireFormatError(
                f"batch data_parallel_rank is not an int >= 0: {saferepr(dp_rank, 100)}"))
            return
        self._apply_batch(stream, dp_rank, batch[1])

    def _apply_batch(self, stream: _Stream, dp_rank: int, events: list[Any]) -> None:
        """Apply one GPU-tier batch of dp rank ``dp_rank`` (its events as decoded maps) to the
        core: from a socket's payload (above) or handed over in this process
        (``KvEventConsolidator.take_gpu_batch``). Ingest thread only."""
        if dp_rank not in stream.dp_ranks:
            if not self._core.admit_dp_rank(dp_rank):  # counted by the core
                self._log.log(logging.WARNING, "dp-rank", "rank %d: batch for "
                              "data_parallel_rank %d dropped: only ranks below %d are accepted "
                              "(unknown_dp_ranks_refused)", stream.rank, dp_rank,
                              self._core.max_dp_ranks)
                return
            stream.dp_ranks.add(dp_rank)
        if self.engine_forms is not None:
            events = self.engine_forms(dp_rank, events)
        applied = self._core.apply_events(dp_rank, events,
                                          lambda exc: self._bad_event(stream, exc))
        self._c["batches_applied"] += 1
        self._c["events_applied"] += applied
        observer = self.engine_observer
        if observer is not None:
            try:
                observer(dp_rank, events)
            except Exception as exc:  # the observer's bug must not cost the stream a batch
                self._c["observer_errors"] += 1
                self._log.log(logging.ERROR, "observer", "rank %d: engine_observer raised "
                              "%s: %s", stream.rank, type(exc).__name__, saferepr(str(exc)))

    def _bad_message(self, stream: _Stream, exc: WireFormatError) -> None:
        self._c["malformed"] += 1
        self._log.log(logging.WARNING, "malformed", "rank %d: malformed message dropped: %s",
                      stream.rank, exc)

    def _bad_event(self, stream: _Stream, exc: WireFormatError) -> None:
        if isinstance(exc, UnknownMediumError):
            self._c["unknown_medium"] += 1
            self._log.log(logging.WARNING, "medium", "rank %d: event with an unknown medium "
                          "dropped: %s", stream.rank, exc)
        else:
            self._c["malformed"] += 1
            self._log.log(logging.WARNING, "malformed-event", "rank %d: malformed event "
                          "dropped: %s", stream.rank, exc)
