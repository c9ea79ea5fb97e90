"""Event publishers: the transport that carries wire-format batches to consumers.

``EventPublisher`` is the interface (one per stream: a rank's GPU tier, or the consolidated
output; defined in :mod:`kvbm_plugin.wire.publisher_base`, which the registry sees too, and
re-exported here); implementations are found by name in the ``kvbm_plugin.publishers`` entry
points and built by :func:`create_publisher`. ``publish`` is called on TensorRT-LLM's executor
thread, so it never blocks: the ZMQ publisher builds the payload and hands it to ZMQ with a
non-blocking send (or, without a GIL-holding send, to a bounded queue for its thread).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvbm_plugin._util.plugins import PUBLISHERS_GROUP, get_plugin
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    TRTLLM_ZMQ_PORT,
    ConfigError,
    Endpoint,
    PublisherSettings,
    topic_for_rank,
)
from kvbm_plugin.wire.access import Allowlist
from kvbm_plugin.wire.batch_encoding import BatchEncoding
from kvbm_plugin.wire.events import (
    event_count,
    payload_encoder,
)
from kvbm_plugin.wire.gil_send import (  # gil_holding_sender: re-exported
    WAKE,
    _libzmq_send_functions,
    gil_holding_sender,
    wake_fds,
)
from kvbm_plugin.wire.guard import SubscriptionGuard
from kvbm_plugin.wire.publisher_base import (  # re-exported
    EventPublisher,
    NullEventPublisher,
    WireEvent,
    bind_error,
)
from kvbm_plugin.wire.reconnect import keep_alive
from kvbm_plugin.wire.replay_endpoint import ReplayEndpoint
from kvbm_plugin.wire.replay_ring import ReplayRing
from kvbm_plugin.wire.replay_server import parse_replay_request  # re-exported
from kvbm_plugin.wire.send_gate import SendGate

logger = logging.getLogger(__name__)
_SEQ = struct.Struct(">Q")
_Prepared = tuple[int, bytes, Sequence[WireEvent]]  # seq, payload, events: ready to send


class ZmqEventPublisher(EventPublisher):
    """ZMQ XPUB, a PUB on the wire (+ optional replay ROUTER); what peers make it hold is
    bounded (``wire/guard.py``, ``wire/peers.py``).

    Wire: every batch is three frames ``[topic, seq (u64 big-endian, +1 per batch from 0),
    payload]``, payload msgpack ``[ts, events, data_parallel_rank]`` (see :mod:`events`).

    Threads and ownership (``sends``):

    - ``"caller"`` (the default): ``publish`` runs on the caller's thread (TensorRT-LLM's
      executor thread for the GPU tier) and there builds the payload (the event sink's
      compiled batch hands it already encoded, so this is mostly a copy) and hands it to ZMQ
      with a non-blocking send that keeps the GIL (:func:`gil_holding_sender`): ZMQ queues it
      for its own I/O thread, which does the socket I/O; a PUB socket drops at its high-water
      mark rather than wait, so the call never waits. A lock serialises callers on different
      threads (the socket is single-threaded); it is held only across that non-blocking
      hand-off. A service thread owns the ROUTER and answers replay requests from a snapshot
      of the replay buffer, and reads the XPUB's subscriptions under that lock (the executor
      thread never does; ``wire/guard.py``); while commands wait for the XPUB, ``publish``
      defers the send to it (``wire/send_gate.py``). Why: a hand-off to a publisher thread
      costs more than the send itself. That thread sleeps between engine iterations, and
      waking it for each batch costs ~70-150 us of CPU per batch (cold caches after the
      pause), against ~20 us for building and sending the batch on the executor thread, whose
      caches are warm (``benchmarks/bench_event_sink.py``). Where the GIL-holding send is
      unavailable (libzmq not identifiable), ``"caller"`` falls back to ``"thread"``: pyzmq's
      own send releases the GIL, and getting it back could make the executor thread wait a
      switch interval.
    - ``"thread"``: ``publish`` reserves the batch's seq and ``put_nowait``s it into a bounded
      queue under one lock (so callers on several threads queue in seq order); one daemon
      thread creates, binds, uses and closes both sockets: it encodes each batch, sends it,
      keeps it in the bounded replay buffer and answers replay requests.
      Live sends keep the GIL there too: with pyzmq's GIL-releasing send, each frame can make
      the thread wait up to a switch interval (5 ms) to get the GIL back from a busy executor
      thread, and the queue backs up.
    - A batch lost anywhere (queue full, encode error, send error, publisher closed) keeps its
      reserved seq, so every consumer sees a gap; each loss is counted and logged rate-limited.

    ``inline=True`` is for an owner that already runs its own background thread (the
    consolidator's ingest thread, never TensorRT-LLM's executor thread): there is no queue and
    no publisher thread; the constructor binds the sockets and ``publish`` encodes and sends on
    the caller's thread, with the same non-blocking send, seq, replay buffer and loss counting.
    The owner answers replay requests by polling :attr:`replay_socket` and calling
    :meth:`service_replay`, and calls ``publish``, ``service_replay`` and ``shutdown`` from one
    thread at a time (ZMQ sockets are single-threaded). This saves the queue hand-off and the
    GIL hand-offs between the two threads, which cost more than the encoding itself.

    ``endpoint`` is the endpoint this publisher binds as given (the caller picks the rank's
    endpoint, e.g. ``ConsolidatorConfig.publish_endpoint(rank)``); the XPUB always binds. The replay
    ROUTER binds ``replay_endpoint`` when one is given.

    Keyword-only options: ``context`` (a ZMQ context to share; default: a private one for
    tcp/ipc, so shutdown can terminate it and the port is free when ``shutdown`` returns, and
    the process-wide ``Context.instance()`` for inproc, whose peers must share a context),
    ``linger_ms`` (upper bound on how long closing waits for unsent messages),
    ``start_timeout`` (seconds to wait for the sockets to bind), ``encoder`` (the payload
    encoder, called on the publisher thread; default :func:`events.payload_encoder`),
    ``poll_interval`` (while batches keep coming or replay answers are in progress, seconds
    the publisher thread sleeps between drains of the queue, so that batches arriving
    meanwhile cost one wake-up; the most such a batch waits before it is encoded),
    ``replay_stall_s`` (a replay answer whose requester reads nothing for this long is
    dropped; see :mod:`kvbm_plugin.wire.replay_server` for the other replay bounds).

    Idle, the publisher thread uses no CPU: when a timed sleep found no batch and no replay
    answer is in progress, it sleeps until ``publish`` wakes it through a wake-up fd
    (signalled only by the first batch after such a sleep, never per batch) or a replay
    request arrives.
    """

    def __init__(self, settings: PublisherSettings, endpoint: Endpoint | None = None,
                 replay_endpoint: Endpoint | None = None, data_parallel_rank: int = 0, *,
                 context: zmq.Context | None = None, linger_ms: int = 1000,
                 start_timeout: float = 10.0,
                 encoder: Callable[[Any], bytes] | None = None,
                 poll_interval: float = 0.001, inline: bool = False,
                 replay_stall_s: float = 2.0, sends: str = "caller",
                 replay_rolled: str = "oldest") -> None:
        super().__init__(settings, endpoint, replay_endpoint, data_parallel_rank)
        for name in ("buffer_steps", "buffer_bytes", "hwm", "max_queue_size"):
            value = getattr(settings, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{type(self).__name__}: settings.{name}={value!r} must be a "
                                  "positive integer")
        if endpoint is None:
            raise ConfigError(f"{type(self).__name__} needs an endpoint to bind (rank "
                              f"{data_parallel_rank}); set {TRTLLM_ZMQ_PORT} or "
                              f"{EVENTS_ENDPOINT}, or use the 'null' publisher")
        if linger_ms < 0:
            raise ConfigError(f"{type(self).__name__}: linger_ms={linger_ms} must be >= 0")
        if sends not in ("caller", "thread"):
            raise ConfigError(f"{type(self).__name__}: sends={sends!r} must be 'caller' or "
                              "'thread'")
        self._topic = topic_for_rank(settings.topic, data_parallel_rank).encode("utf-8")
        self._bind_addr = endpoint.bind
        self._replay_addr = None if replay_endpoint is None else replay_endpoint.bind
        # The variables the endpoints came from, for a bind error that names what to change.
        self._sources = (endpoint.source, "" if replay_endpoint is None else replay_endpoint.source)
        if self._replay_addr is not None and self._replay_addr == self._bind_addr:
            raise ConfigError(f"{type(self).__name__}: replay endpoint {self._replay_addr} "
                              "is the publish endpoint; they must differ")
        self._own_context = context is None and endpoint.scheme != "inproc"
        if context is None:
            # inproc peers must share one context; the shared instance is never terminated
            # (other components may use it). tcp/ipc get a private context so that shutdown can
            # terminate it, which is the only way to know the port is released on return.
            context = zmq.Context() if self._own_context else zmq.Context.instance()
        self._context = context
        self._linger_ms = linger_ms
        self._encoder = encoder
        # The batch's encoded runs are copied into the payload (see events.batch_payload).
        self.accepts_encoded_events = True
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=settings.max_queue_size)
        self._ring = ReplayRing(settings.buffer_steps, settings.buffer_bytes)
        self._buffer = self._ring.entries  # what replays are answered from
        self._seq = itertools.count()  # reserved at accept (sends="thread": under _send_lock)
        self._closed = False
        self._close_lock = threading.Lock()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._drain_deadline = float("inf")
        self._close_linger_ms = linger_ms
        self._idle_s = poll_interval
        # Set by the publisher thread just before it sleeps with no timeout; ``publish`` then
        # writes the wake-up fd once (see _sleep_until_work).
        self._asleep = False
        self._wake_r = self._wake_w = -1
        # Live sender that keeps the GIL (set on the publisher thread; None: pyzmq's send).
        self._send_live: Callable[[bytes, bytes, bytes], None] | None = None
        self._log = RateLimitedLog(logger)
        # Counters. Each is written by exactly one thread (caller or publisher thread).
        self._accepted = 0
        self._lost_queue_full = 0
        self._lost_closed = 0
        self._queue_high_water = 0
        self._published = 0
        self._events_published = 0
        self._encoding = BatchEncoding(type(self).__name__, self._log)
        self._send_errors = 0
        self._lost_at_shutdown = 0
        # Batches ``publish`` accepted (returned True) and the publisher thread lost later
        # (encode, send, shutdown): the caller counted them as published; see stats().
        self._lost_after_accept = 0
        self._replay = ReplayEndpoint(type(self).__name__, self._topic,
                                      max_peers=settings.max_peers, stall_s=replay_stall_s,
                                      rolled=replay_rolled)
        # The XPUB's subscriptions: only the topic's prefixes take effect (wire/guard.py).
        self._guard = SubscriptionGuard(type(self).__name__, self._topic,
                                        max_peers=settings.max_peers)
        self._guard_more = False  # the last guard service ran out of budget: call again soon
        self._next_input_check = 0.0  # sends="caller": when publish next looks for input
        self._gate: SendGate | None = None  # sends="caller" only (wire/send_gate.py)
        self._allowlist = Allowlist(settings.allow)
        self._inline = inline
        # Sends on the caller's thread, replay answered by a replay thread (see the class doc).
        self._caller_sends = (not inline and sends == "caller"
                              and _libzmq_send_functions() is not None)
        # publish() knows at once whether the batch was lost (no publisher thread).
        self._synchronous = inline or self._caller_sends
        self._send_lock = threading.Lock()
        self._pub: zmq.Socket | None = None
        self._encode: Callable[[Any], bytes] | None = None
        if self._synchronous:
            try:
                self._pub = self._open_sockets()
            except RuntimeError as exc:
                self._closed = True
                raise ConfigError(f"{type(self).__name__} (rank {data_parallel_rank}) cannot "
                                  f"bind: {exc}") from exc
            self._encode = encoder or payload_encoder()
            self._send_live = gil_holding_sender(self._pub)
            if self._caller_sends:
                # The service thread reads the XPUB's subscriptions (under the send lock) and
                # answers replay requests: the executor thread never does either.
                self._pub_fd = self._pub.getsockopt(zmq.FD)
                self._gate = SendGate(self._pub_fd, settings.max_queue_size,
                                      type(self).__name__, self._log)
                self._wake_r, self._wake_w = wake_fds()
                self._thread = threading.Thread(
                    target=self._run_service,
                    name=f"kvbm-zmq-service-dp{data_parallel_rank}", daemon=True)
                self._thread.start()
            return
        self._wake_r, self._wake_w = wake_fds()
        self._thread = threading.Thread(
            target=self._run, name=f"kvbm-zmq-publisher-dp{data_parallel_rank}", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            self._closed = True
            self._stopping.set()
            self._wake()
            raise RuntimeError(f"{type(self).__name__}: sockets for {self._bind_addr} not ready "
                               f"after {start_timeout}s")
        if self._start_error is not None:
            self._closed = True
            self._thread.join(start_timeout)
            self._close_wake_fds()
            err = self._start_error
            raise ConfigError(f"{type(self).__name__} (rank {data_parallel_rank}) cannot bind: "
                              f"{err}") from err

    # ---- caller side (executor thread) ----------------------------------------------------

    def publish(self, events: Sequence[WireEvent], data_parallel_rank: int | None = None) -> bool:
        """Queue one batch; called once per engine iteration on the caller's thread.

        Never blocks. ``events`` (wire-form maps) is handed over: the caller must not mutate it
        afterwards. ``data_parallel_rank`` defaults to the publisher's rank. Returns False when
        the batch was lost (queue full or publisher closed): counted, logged rate-limited, and
        visible to consumers as a seq gap (a closed publisher has no consumers left).
        """
        if self._closed:
            self._lost_closed += 1
            self._log.log(logging.WARNING, "closed", "%s: batch of %d events published after "
                          "shutdown was lost", type(self).__name__, len(events))
            return False
        rank = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        if self._caller_sends:
            # Never wait for the service thread: under a subscription flood its turn can
            # be long, and this is TensorRT-LLM's executor thread.
            if not self._send_lock.acquire(blocking=False):
                return self._defer_busy(events, rank)
            try:  # held across non-blocking work only (class doc)
                pub, encode = self._pub, self._encode
                if pub is None or encode is None:  # shut down by another thread meanwhile
                    self._lost_closed += 1
                    return False
                self._accepted += 1
                now = time.time()
                item = (next(self._seq), now, events, rank)
                gate = self._gate
                assert gate is not None  # made with the sockets (sends="caller")
                if gate.holds():
                    # Commands wait for the XPUB (subscriptions, maybe): a send here would take
                    # them in, ahead of the thread that reads them (wire/send_gate.py).
                    prepared = self._prepare(encode, item)
                    if prepared is None:
                        return False
                    gate.defer(prepared)
                    sent = check = True
                else:
                    sent = self._send_batch(pub, encode, item)
                    # A send processes the commands that came since the gate looked (about a
                    # microsecond), which may take subscriptions in and the XPUB fd's wake-up
                    # with them: every _SERVICE_BUSY_S, wake the service thread to read them.
                    # Not by asking libzmq (ZMQ_EVENTS processes the socket's commands, and a
                    # churn of connections kept this thread inside that call for minutes).
                    check = now >= self._next_input_check
                    if check:
                        self._next_input_check = now + _SERVICE_BUSY_S
            finally:
                self._send_lock.release()
            if check:
                self._wake()
            return sent
        if self._inline:  # one caller thread at a time (class doc)
            seq = next(self._seq)
            self._accepted += 1
            pub, encode = self._pub, self._encode
            assert pub is not None and encode is not None  # open until shutdown closes them
            # Subscriptions first (a non-blocking read when none came): a subscriber takes
            # effect by the next batch even where the owner polls only at times.
            self._guard_more = self._guard.service(pub)
            return self._send_batch(pub, encode, (seq, time.time(), events, rank))
        # The seq is reserved and the batch queued in one step: with two callers, a batch
        # given a later seq must never be queued (so sent) first. The lock is held across the
        # non-blocking put only.
        with self._send_lock:
            seq = next(self._seq)
            try:
                self._queue.put_nowait((seq, time.time(), events, rank))
            except queue.Full:
                self._lost_queue_full += 1
                full = True
            else:
                full = False
                self._accepted += 1
                depth = self._queue.qsize()
                if depth > self._queue_high_water:
                    self._queue_high_water = depth
                wake = self._asleep
                if wake:
                    self._asleep = False
        if full:
            self._log.log(logging.WARNING, "queue-full", "%s: queue full (%d batches), batch "
                          "seq %d lost; consumers see a gap", type(self).__name__,
                          self.settings.max_queue_size, seq)
            return False
        if wake:  # the first batch after an idle spell: wake the publisher thread
            self._wake()
        return True

    def _wake(self) -> None:
        """Make the publisher thread's poll return (any thread; never blocks)."""
        fd = self._wake_w
        if fd < 0:
            return
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending
            os.write(fd, WAKE)

    def _defer_busy(self, events: Sequence[WireEvent], rank: int) -> bool:
        """``publish`` while the service thread holds the send lock (sends="caller", the
        caller's thread): encode, buffer and defer the batch behind those deferred already,
        and wake the service thread, which sends it after its turn."""
        encode, gate = self._encode, self._gate
        if encode is None or gate is None or self._pub is None:  # shut down meanwhile
            self._lost_closed += 1
            return False
        self._accepted += 1
        prepared = self._prepare(encode, (next(self._seq), time.time(), events, rank))
        if prepared is None:
            return False
        gate.defer(prepared)
        self._wake()
        return True

    def _send_deferred(self, pub: zmq.Socket) -> None:
        """Send the batches ``publish`` deferred (sends="caller": the service thread, or
        shutdown, under the send lock), after the subscriptions were read."""
        for prepared in self._gate.take() if self._gate is not None else ():
            self._send_prepared(pub, prepared, True)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Drain what is queued within ``timeout`` s, close sockets, join; idempotent.

        Called once by the owner (leader teardown, sidecar exit); safe to call again. Batches
        still queued when the time is up are counted as lost. Closing waits at most
        ``min(linger_ms, time left)`` for unsent messages; with a private context the port is
        free when this returns.
        """
        if self._inline:
            self._shutdown_inline(timeout)
            return
        if self._caller_sends:
            self._shutdown_caller_sends(timeout)
            return
        with self._close_lock:
            if self._closed and not self._thread.is_alive():
                return
            self._closed = True
        if self._stopping.is_set() and not self._thread.is_alive():
            return
        start = time.monotonic()
        timeout = max(0.0, timeout)
        # Keep part of the budget for closing the sockets after the drain.
        linger_s = min(self._linger_ms / 1000.0, timeout / 2)
        self._close_linger_ms = int(linger_s * 1000)
        self._drain_deadline = start + timeout - linger_s
        self._stopping.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)
        self._wake()
        self._thread.join(timeout + 1.0)
        if self._thread.is_alive():
            logger.error("%s: publisher thread did not stop within %.1fs; its sockets stay "
                         "open until it does", type(self).__name__, timeout)
            return
        self._close_wake_fds()

    def _close_wake_fds(self) -> None:
        """Close the wake-up fd(s) once the publisher thread has exited (shutdown)."""
        fds = {self._wake_r, self._wake_w}
        self._wake_r = self._wake_w = -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _shutdown_caller_sends(self, timeout: float) -> None:
        """Stop the service thread (which closes the ROUTER and the monitors), close the XPUB
        (after any send in progress), then release the context."""
        with self._close_lock:
            if self._closed and self._pub is None:
                return
            self._closed = True
        timeout = max(0.0, timeout)
        thread = getattr(self, "_thread", None)
        if thread is not None:  # first: it polls the XPUB's fd, which must stay open meanwhile
            self._stopping.set()
            self._wake()
            thread.join(timeout + 1.0)
        with self._send_lock:
            pub, self._pub = self._pub, None
            if pub is not None:
                self._send_deferred(pub)  # deferred by the last publish calls
        if pub is not None:
            pub.close(linger=int(min(self._linger_ms / 1000.0, timeout) * 1000))
        if thread is not None:
            if thread.is_alive():
                logger.error("%s: service thread did not stop within %.1fs; its socket stays "
                             "open until it does", type(self).__name__, timeout)
                return
            self._close_wake_fds()
        self._allowlist.stop()
        if self._own_context:
            self._context.term()

    def _run_service(self) -> None:
        """Service thread (``sends="caller"``): read the XPUB's subscriptions (holding the send
        lock across that non-blocking work only) and answer replay requests from a snapshot
        of the replay buffer, which ``publish`` appends to on the caller's thread
        (``list(deque)`` copies it atomically under the GIL).

        It polls the XPUB's own fd (``ZMQ_FD``, a plain OS poll: it never calls into the socket
        the executor thread sends on), the connection monitors, the ROUTER and the wake-up fd,
        which ``publish`` writes when it deferred a batch or finds subscriptions waiting (its
        sends may take the XPUB fd's wake-ups) and ``shutdown`` writes to stop it. After the
        subscriptions it sends the deferred batches (``wire/send_gate.py``). No timer while
        idle or sending.
        """
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._pub_fd, zmq.POLLIN)
        for fd in self._signal_fds():  # connection events (the connection watch's wake-ups)
            poller.register(fd, zmq.POLLIN)
        if self._replay.router is not None:
            poller.register(self._replay.router, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                busy = self._guard_more or self._replay.busy
                poller.poll(self._idle_s * 1000.0 if busy else None)
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    os.read(self._wake_r, 8)
                if self._stopping.is_set():
                    break
                with self._send_lock:  # the executor sends on this socket
                    pub = self._pub
                    if pub is None:
                        break
                    self._guard_more = self._guard.service(pub)
                    self._send_deferred(pub)
                self._replay.service(self._buffer, shared=True)
        except Exception:  # never expected; the loop itself must not die silently
            logger.exception("%s: service thread failed", type(self).__name__)
        finally:
            with self._send_lock:  # stopping the monitor is a call on the XPUB
                self._guard.close()
            self._replay.close()

    def _shutdown_inline(self, timeout: float) -> None:
        with self._close_lock:
            self._closed = True
            pub, self._pub = self._pub, None
            self._guard.close()
        if pub is None:
            return
        linger_ms = int(min(self._linger_ms / 1000.0, max(0.0, timeout)) * 1000)
        self._replay.close(linger_ms)
        pub.close(linger=linger_ms)
        self._allowlist.stop()
        if self._own_context:
            self._context.term()

    @property
    def replay_socket(self) -> zmq.Socket | None:
        """Inline mode: the replay ROUTER for the owner to poll (None without replay, and
        always None in the threaded mode, whose thread answers replays itself)."""
        return self._replay.router if self._inline else None

    @property
    def sockets_to_poll(self) -> list[zmq.Socket | int]:
        """Inline mode: the XPUB (subscriptions), the replay ROUTER and the connection watch's
        wake-up fds of both, for the owner to poll (empty otherwise); when one is readable the
        owner calls :meth:`service_replay`."""
        if not self._inline or self._pub is None:
            return []
        return [*(s for s in (self._pub, self._replay.router) if s is not None),
                *self._signal_fds()]

    def _signal_fds(self) -> list[int]:
        """Readable after connection events on the XPUB or the replay ROUTER."""
        fd = self._replay.signal_fd
        return [*self._guard.sockets, *([fd] if fd is not None else [])]

    @property
    def replay_busy(self) -> bool:
        """Inline mode: replay answers are in progress or subscriptions are left to read; the
        owner calls :meth:`service_replay` every few milliseconds until this is False."""
        if not self._inline:
            return False
        return self._guard_more or self._replay.busy

    def service_replay(self) -> None:
        """Inline mode: read subscriptions, take replay requests and move answers on
        (non-blocking, bounded).

        Called by the owner's thread when one of :attr:`sockets_to_poll` is readable, and
        every few milliseconds while :attr:`replay_busy`.
        """
        if not self._inline:
            return
        if self._pub is not None:
            self._guard_more = self._guard.service(self._pub)
        self._replay.service(self._buffer)

    def stats(self) -> dict[str, int]:
        """Counters (any thread; values are snapshots)."""
        gate = self._gate
        dropped = 0 if gate is None else gate.dropped  # lost live past the gate's bound
        lost = (self._lost_queue_full + dropped + self._lost_closed + self._encoding.errors
                + self._send_errors + self._lost_at_shutdown)
        return {
            "batches_accepted": self._accepted,
            "batches_published": self._published,
            "events_published": self._events_published,
            "lost_batches": lost,
            "lost_queue_full": self._lost_queue_full + dropped,
            "lost_closed": self._lost_closed,
            "lost_at_shutdown": self._lost_at_shutdown,
            "encode_errors": self._encoding.errors,
            "events_unencodable": self._encoding.events_unencodable,
            "send_errors": self._send_errors,
            "lost_after_accept": self._lost_after_accept + dropped,
            **self._replay.stats(),
            **self._guard.stats(),
            "queue_high_water": self._queue_high_water,
            "queue_depth": self._queue.qsize() + (0 if gate is None else len(gate)),
            "sends_deferred": 0 if gate is None else gate.deferred,
            "deferred_high_water": 0 if gate is None else gate.high_water,
            "replay_buffered": len(self._buffer),
            "replay_bytes_buffered": self._ring.bytes,
        }

    # ---- publisher thread -----------------------------------------------------------------

    def _open_sockets(self) -> zmq.Socket:
        """Create and bind the XPUB and the replay ROUTER if any (publisher thread); on
        failure close what was opened. Returns the XPUB."""
        pub = None
        addr, source = self._bind_addr, self._sources[0]
        try:
            self._allowlist.start(self._context, self._own_context)
            # An XPUB with manual subscriptions instead of a PUB: the same wire (a SUB accepts
            # either), but what peers subscribe is bounded (wire/guard.py).
            pub = self._context.socket(zmq.XPUB)
            pub.setsockopt(zmq.LINGER, self._linger_ms)
            pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
            keep_alive(pub)  # a subscriber gone silent is dropped, not kept towards the cap
            self._guard.configure(pub)
            self._allowlist.configure(pub)
            pub.bind(addr)
            if self._replay_addr is not None:
                addr, source = self._replay_addr, self._sources[1]
                self._replay.open(self._context, addr, self._allowlist)
        except BaseException as exc:
            self._guard.close()
            self._replay.close()
            if pub is not None:
                pub.close(linger=0)
            self._allowlist.stop()
            if self._own_context:
                self._context.term()  # returns once the sockets are gone: the port is free
            raise RuntimeError(bind_error(addr, source, exc)) from exc
        return pub

    def _run(self) -> None:
        try:
            pub = self._open_sockets()
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        encode = self._encoder or payload_encoder()
        self._send_live = gil_holding_sender(pub)
        gate = SendGate(pub.getsockopt(zmq.FD), 0, type(self).__name__, self._log)  # holds()
        self._ready.set()
        get_nowait = self._queue.get_nowait
        idle = self._idle_s
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(pub, zmq.POLLIN)  # subscriptions (this thread owns the XPUB)
        for fd in self._signal_fds():  # and connection events (the connection watch's)
            poller.register(fd, zmq.POLLIN)
        if self._replay.router is not None:
            poller.register(self._replay.router, zmq.POLLIN)
        busy = True
        try:
            while True:
                # Not a blocking get(): a blocked consumer is woken by every put, and on two
                # cores those per-batch wake-ups (GIL hand-offs) cost the executor thread far
                # more than the work itself. While batches keep coming (the last sleep found
                # one), sleep ``idle`` s between drains; once a sleep found none, sleep until
                # publish or a replay request wakes the thread: no wake-ups while idle.
                try:
                    item = get_nowait()
                    busy = True
                except queue.Empty:
                    item = None
                    # Replay answers in progress need the timed sleep too: their stall
                    # checks and stalled peers' probes run on time, not on socket events.
                    self._sleep_until_work(
                        poller, idle if busy or self._replay.busy or self._guard_more else None)
                    busy = False
                while item is not None:
                    # Drain what is queued before waiting again: fewer wake-ups, and fewer GIL
                    # hand-offs with the executor thread that fills the queue. Subscriptions
                    # first while commands wait: a send would take them in unread
                    # (wire/send_gate.py), which a long backlog could repeat thousands of times.
                    if gate.holds():
                        self._guard_more = self._guard.service(pub)
                    if item is not _STOP:
                        self._send_batch(pub, encode, item)
                    try:
                        item = get_nowait()
                    except queue.Empty:
                        item = None
                self._guard_more = self._guard.service(pub)
                self._replay.service(self._buffer)
                if self._stopping.is_set():
                    if self._queue.empty():
                        break
                    if time.monotonic() >= self._drain_deadline:
                        self._count_left_over()
                        break
        except Exception:  # never expected; the loop itself must not die silently
            logger.exception("%s: publisher thread failed", type(self).__name__)
            self._closed = True
            self._count_left_over()
        finally:
            self._guard.close()
            self._replay.close(self._close_linger_ms)
            pub.close(linger=self._close_linger_ms)
            self._allowlist.stop()
            if self._own_context:
                self._context.term()

    def _sleep_until_work(self, poller: zmq.Poller, timeout: float | None) -> None:
        """Sleep ``timeout`` s, or with None until ``publish`` or ``shutdown`` writes the
        wake-up fd or a replay request arrives (publisher thread)."""
        if timeout is None:
            self._asleep = True
            # Re-checked after raising the flag: a batch queued before publish could see it.
            if not self._queue.empty() or self._stopping.is_set():
                self._asleep = False
                return
        poller.poll(None if timeout is None else timeout * 1000.0)
        self._asleep = False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            os.read(self._wake_r, 8)

    def _count_left_over(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self._lost_at_shutdown += 1
                self._lost_after_accept += 1
                self._log.log(logging.WARNING, "shutdown", "%s: batch seq %d still queued at "
                              "shutdown was lost", type(self).__name__, item[0])

    def _send_batch(self, pub: zmq.Socket, encode: Callable[[Any], bytes],
                    item: tuple[int, float, Sequence[WireEvent], int]) -> bool:
        """Encode, buffer for replay and send one batch; False when it was lost live."""
        prepared = self._prepare(encode, item)
        return prepared is not None and self._send_prepared(pub, prepared,
                                                            not self._synchronous)

    def _prepare(self, encode: Callable[[Any], bytes],
                 item: tuple[int, float, Sequence[WireEvent], int]) -> _Prepared | None:
        """Encode one batch and buffer it for replay: what :meth:`_send_prepared` sends (None
        when it could not be encoded: counted)."""
        seq, ts, events, rank = item
        payload, events = self._encoding.payload(encode, seq, ts, events, rank)
        if payload is None:
            if not self._synchronous:
                self._lost_after_accept += 1
            return None
        # Buffered even if the live send fails: a replay can then fill the live gap.
        self._ring.keep(seq, payload)
        return seq, payload, events

    def _send_prepared(self, pub: zmq.Socket, prepared: _Prepared, after_accept: bool) -> bool:
        """Send a prepared batch live; False when that failed (counted; ``after_accept``: the
        caller was told it was accepted)."""
        seq, payload, events = prepared
        seq_frame = _SEQ.pack(seq)
        send_live = self._send_live
        try:
            if send_live is not None and type(payload) is bytes:
                send_live(self._topic, seq_frame, payload)
            else:
                pub.send_multipart((self._topic, seq_frame, payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._send_errors += 1
            if after_accept:
                self._lost_after_accept += 1
            self._log.log(logging.ERROR, "send", "%s: sending batch seq %d failed, lost live "
                          "(kept for replay): %s", type(self).__name__, seq, exc)
            return False
        self._published += 1
        self._events_published += event_count(events)
        return True



_STOP = object()  # tells the publisher thread to stop (after what is queued before it)
# While batches are sent on the caller's thread, it wakes the service thread this often (s) to
# read subscriptions: its sends may take the XPUB fd's wake-ups.
_SERVICE_BUSY_S = 0.01
__all__ = ["EventPublisher", "NullEventPublisher", "ZmqEventPublisher", "create_publisher",
           "gil_holding_sender", "parse_replay_request"]


def create_publisher(settings: PublisherSettings, endpoint: Endpoint | None = None,
                     replay_endpoint: Endpoint | None = None,
                     data_parallel_rank: int = 0) -> EventPublisher:
    """Build the publisher named by ``settings.kind`` from the entry points."""
    cls = get_plugin(PUBLISHERS_GROUP, settings.kind)
    return cls(settings, endpoint, replay_endpoint, data_parallel_rank)
