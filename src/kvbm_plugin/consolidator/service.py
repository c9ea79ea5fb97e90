"""The consolidator: one de-duplicated KV-event stream from the GPU tier and the offload tiers.

Two layers, one concept, in two modules:

* :class:`ConsolidatorCore` (module :mod:`kvbm_plugin.consolidator.core`, re-exported here with
  its source ids and errors) — the pure state machine: no sockets, no threads, no clock, no zmq.
  It takes GPU-tier wire events (per dp rank) and offload-tier registrations, and emits output
  wire events per dp rank; everything the router sees is decided there. Its module docstring
  holds the semantics, and its dedup loops have a compiled form (``consolidator/_core_c.c``).
* :class:`KvEventConsolidator` (this module) — the shell around one core: a SUB per rank's
  GPU-tier publisher in another process, a DEALER per rank's replay endpoint, one ingest
  thread that decodes, applies and flushes, and an
  :class:`~kvbm_plugin.wire.publisher.EventPublisher` for the output (the built-in ZMQ one in
  its inline mode, run by the ingest thread itself). The shell only moves bytes, orders
  batches (sequence checks, replays, resyncs: its
  :class:`~kvbm_plugin.consolidator.streams.GpuStreams`) and queues registrations. A rank
  whose GPU-tier batches are made in this process (``direct_ranks``: the leader's own) hands
  them over by :meth:`KvEventConsolidator.take_gpu_batch`, queued in order with the
  registrations: no encode, socket or decode between the event sink and the core, and no seq
  to check (a queue in one process loses nothing it does not count).

This module is the public face: import the consolidator's names from here.

Who calls what:

* ``KvbmConnectorLeader`` builds a :class:`KvEventConsolidator` from its
  :class:`~kvbm_plugin.consolidator_config.ConsolidatorConfig` when the consolidator is enabled,
  calls :meth:`~KvEventConsolidator.start` once at bring-up and
  :meth:`~KvEventConsolidator.shutdown` at teardown.
* The leader's event sink calls :meth:`~KvEventConsolidator.take_gpu_batch` with each batch of
  the leader's own dp rank, from ``KvEventSink.flush`` (the leader's event pump thread);
  never blocks.
* The leader's host and disk tiers call :meth:`~KvEventConsolidator.register_store`,
  :meth:`~KvEventConsolidator.register_remove` and :meth:`~KvEventConsolidator.register_clear`
  from whatever thread moves blocks; each call only appends to a queue.
* ``kvbm-plugin consolidate`` (:mod:`kvbm_plugin.cli.consolidate`) runs it for engines
  whose GPU-tier events come from elsewhere (TRT-LLM's or vLLM's own publisher).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final

import zmq

from kvbm_plugin._util.plugins import PUBLISHERS_GROUP, get_plugin
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.consolidator.core import (  # re-exported: this module is the public face
    SOURCE_ENGINE,
    SOURCE_TIERS,
    ConsolidatorCore,
    UnknownDpRankError,
    UnknownMediumError,
)
from kvbm_plugin.consolidator.held_back import DEFAULT_MAX_HELD_BACK
from kvbm_plugin.consolidator.streams import GpuStreams, _Stream
from kvbm_plugin.consolidator_config import (
    DP_RANK_FIELD,
    TOPIC,
    ConfigError,
    ConsolidatorConfig,
)
from kvbm_plugin.wire.events import (
    MAX_DP_RANKS,
    normalize_medium,
)
from kvbm_plugin.wire.identity import SALT_TEXTS, lora_name
from kvbm_plugin.wire.publisher import EventPublisher, ZmqEventPublisher, create_publisher
from kvbm_plugin.wire.reconnect import ConnectionWatch, keep_alive
from kvbm_plugin.wire.router_forms import spell_for_routers

logger = logging.getLogger(__name__)

__all__ = [
    "SOURCE_ENGINE",
    "SOURCE_TIERS",
    "UnknownMediumError",
    "UnknownDpRankError",
    "ConsolidatorCore",
    "KvEventConsolidator",
]


_SHELL_COUNTERS: Final = (
    "messages_received", "batches_applied", "events_applied", "malformed", "unknown_medium",
    "gaps", "late_joins", "restarts", "reconnects", "replay_requests", "replayed_batches",
    "replay_failures",
    "unfillable_gaps", "registrations", "registration_errors", "registrations_dropped",
    "batches_out", "events_out", "output_lost", "ingest_errors", "message_errors",
    "observer_errors", "direct_batches", "direct_batches_dropped",
)

_Registration = tuple[Any, ...]  # (kind, medium, dp_rank, ...) built by register_*
# (block hash, parent hash, token ids, lora id, extra keys): one block of register_stores
StoreFields = tuple[int, int | None, list[int], int | None, Any]


class KvEventConsolidator:
    """The consolidator with its sockets: GPU-tier SUBs in, one publisher out.

    Built by the leader (or ``kvbm-plugin consolidate``) from a :class:`ConsolidatorConfig`.
    ``publisher``: the output (default: ``create_publisher(config.publisher, config.output,
    config.output_replay)``, shut down by :meth:`shutdown`; one passed in stays its owner's).
    The built-in ZMQ publisher is created on the ingest thread in its inline mode: the thread
    that applies a batch also encodes and sends the output and answers its replay requests,
    with no publisher thread in between. ``context``: default ``zmq.Context.instance()``, never
    terminated here (other components share it). ``flush_every``: under a backlog, the ingest
    thread publishes the output of at most this many input batches as one output batch per dp
    rank (1: one output batch per input batch); without a backlog every input batch's output is
    published as soon as it is applied. ``start_timeout``: the most :meth:`start` waits for the
    ingest thread's sockets. ``max_held_back``: the core's bound on what one source's stores
    hold back per dp rank (see :mod:`kvbm_plugin.consolidator.held_back`); what it refuses is
    counted (``held_back_dropped``) and logged, rate-limited. ``engine_observer``: called on
    the ingest thread with ``(dp_rank, raw event maps)`` of every GPU-tier batch applied (the
    leader learns TensorRT-LLM's block names from them where TensorRT-LLM publishes the GPU
    tier itself); cheap and thread-safe, its exceptions counted (``observer_errors``).
    ``direct_ranks``: the dp ranks (of ``config.stream_ranks()``) whose GPU-tier batches
    :meth:`take_gpu_batch` hands over; no socket is opened for them. At most ``max_pending``
    such batches wait for the ingest thread; past that a batch is dropped, counted
    (``direct_batches_dropped``), and the rank's GPU residency resynced before its next batch
    (as for a gap no replay can fill).
    """

    # After a round with input, the ingest thread polls every LINGER_MS for LINGER_ROUNDS
    # quiet rounds before it sleeps until woken: while the leader's event pump hands it a
    # batch every 5 ms, its registrations from the executor thread never write the wake pipe.
    LINGER_MS = 5
    LINGER_ROUNDS = 20

    def __init__(self, config: ConsolidatorConfig, *, publisher: EventPublisher | None = None,
                 context: zmq.Context | None = None, replay_timeout: float = 2.0,
                 max_pending: int = 10000, flush_every: int = 16,
                 start_timeout: float = 10.0,
                 max_held_back: int = DEFAULT_MAX_HELD_BACK,
                 engine_observer: Callable[[int, list[Any]], None] | None = None,
                 direct_ranks: Collection[int] = ()) -> None:
        if type(flush_every) is not int or flush_every < 1:
            raise ValueError(f"{type(self).__name__}: flush_every={flush_every!r} must be an "
                             "int >= 1")
        if not start_timeout > 0:
            raise ValueError(f"{type(self).__name__}: start_timeout={start_timeout!r} must be "
                             "> 0 seconds")
        self._start_timeout = start_timeout
        self.config: Final = config
        # Ranks the configuration names are always accepted, and as many as any attention-DP
        # deployment has (one stream may carry several dp ranks); beyond that a payload's
        # rank is refused, so bogus ranks cannot grow the per-rank state without limit.
        self._core = ConsolidatorCore(config.mode,
                                      max_dp_ranks=max(MAX_DP_RANKS, config.num_ranks),
                                      max_held_back=max_held_back)
        self._held_back_dropped = 0  # the core's count when the shell last logged it
        self._publisher = publisher
        self._owns_publisher = publisher is None
        self._inline_output = False  # the ingest thread owns the output publisher's sockets
        self._inline_sockets: list[zmq.Socket | int] = []  # its sockets the ingest thread polls
        self._shutdown_deadline = math.inf
        self._ctx = context if context is not None else zmq.Context.instance()
        self._replay_timeout = replay_timeout
        self._max_pending = max_pending
        self._flush_every = flush_every
        self._log = RateLimitedLog(logger)
        self._c: dict[str, int] = dict.fromkeys(_SHELL_COUNTERS, 0)
        # The GPU-tier streams' sequence, replays and apply (its own state; ingest thread).
        self._streams = GpuStreams(config, self._core, self._ctx, self._log, self._c,
                                   replay_timeout=replay_timeout, max_pending=max_pending,
                                   engine_observer=engine_observer)
        # Registration queue: appended by any thread, drained by the ingest thread. deque
        # append/popleft are atomic under the GIL; the counters are itertools.count (atomic).
        self._queue: collections.deque[_Registration] = collections.deque()
        self._wake_r, self._wake_w = -1, -1
        self._wake_pending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._idle = False
        self._published_batches = 0
        streamed = config.stream_ranks()
        for rank in direct_ranks:
            if rank not in streamed:
                raise ValueError(f"{type(self).__name__}: direct_ranks names dp rank {rank!r}, "
                                 f"which this consolidator does not read (ranks {streamed})")
        # Ranks whose batches take_gpu_batch hands over: their streams have no sockets.
        self._direct: dict[int, _Stream] = {rank: _Stream(rank) for rank in direct_ranks}
        # Handed-over batches queued and applied: each count has one writer (the caller's
        # thread, the ingest thread), so their difference bounds the queue without a lock.
        self._direct_in = self._direct_out = 0
        self._direct_lost: set[int] = set()  # ranks with a resync queued (ingest thread clears)
        self._lock = threading.Lock()  # start/shutdown only
        self._state = "new"  # new -> running -> stopped

    # ------------------------------------------------------------------ lifecycle

    @property
    def engine_observer(self) -> Callable[[int, list[Any]], None] | None:
        """Called on the ingest thread with ``(dp_rank, raw event maps)`` of every GPU-tier
        batch applied (class docstring)."""
        return self._streams.engine_observer

    @engine_observer.setter
    def engine_observer(self, observer: Callable[[int, list[Any]], None] | None) -> None:
        self._streams.engine_observer = observer

    @property
    def engine_forms(self) -> Callable[[int, list[Any]], list[Any]] | None:
        """Where the GPU-tier streams are TensorRT-LLM's own: turns each batch's events into
        the fields the core accepts (``consolidator.engine_forms.EngineForms``); set before
        :meth:`start`."""
        return self._streams.engine_forms

    @engine_forms.setter
    def engine_forms(self, forms: Callable[[int, list[Any]], list[Any]] | None) -> None:
        self._streams.engine_forms = forms

    @property
    def loop_failures(self) -> int:
        """Ingest-loop failures since the last message applied cleanly (the back-off's)."""
        return self._streams.loop_failures

    def start(self) -> None:
        """Start the ingest thread (which creates the built-in output publisher; another kind is
        created here); returns once the sockets exist.

        Called once by the leader at bring-up (or by `kvbm-plugin consolidate`). Raises what socket
        setup raised, after closing whatever it had opened. ConfigError when the topic names
        a ``{dp_rank}`` field but this one output would carry several dp ranks.
        """
        topic, ranks = self.config.publisher.topic, self.config.stream_ranks()
        if DP_RANK_FIELD in topic and len(ranks) > 1:
            # The output has one topic, fixed when it binds: every rank's batches would go out
            # under the first rank's pod, which llm-d (it drops the dp rank) merges into one.
            raise ConfigError(
                f"{TOPIC}={topic!r}: {DP_RANK_FIELD} names one attention-DP rank's pod, but "
                f"this consolidated output carries dp ranks {list(ranks)}; run one "
                f"consolidator per rank (as the leader does) or leave {DP_RANK_FIELD} out")
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"{type(self).__name__} was already started")
            self._state = "running"
            try:
                if self._publisher is None:
                    if get_plugin(PUBLISHERS_GROUP, self.config.publisher.kind) \
                            is ZmqEventPublisher:
                        self._inline_output = True  # created by the ingest thread
                    else:
                        self._publisher = create_publisher(
                            self.config.publisher, self.config.output, self.config.output_replay)
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
                # What was queued before there was a pipe wrote no wake byte: the thread looks
                # at the queue first, and the next submitter must write one.
                self._wake_pending = False
                self._thread = threading.Thread(target=self._run, name="kvbm-consolidator",
                                                daemon=True)
                self._thread.start()
                if not self._ready.wait(self._start_timeout):
                    self._stop.set()
                    raise RuntimeError(f"{type(self).__name__}: ingest thread did not set up "
                                       f"its sockets within {self._start_timeout}s")
                if self._setup_error is not None:
                    self._thread.join(self._start_timeout)
                    raise self._setup_error
            except BaseException:
                self._state = "stopped"
                self._close_pipe()
                if self._owns_publisher and self._publisher is not None:
                    self._publisher.shutdown(1.0)
                raise

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop ingesting, apply what is queued, flush, close sockets; idempotent, bounded.

        Called by the leader at teardown (any thread but the ingest thread). Takes at most about
        ``timeout`` seconds; a thread that does not stop in time is logged and left (daemon).
        """
        with self._lock:
            if self._state == "stopped":
                return
            was_running = self._state == "running"
            self._state = "stopped"
        deadline = time.monotonic() + timeout
        self._shutdown_deadline = deadline
        stuck = False
        if was_running and self._thread is not None:
            self._stop.set()
            self._wake()
            self._thread.join(max(0.0, deadline - time.monotonic()))
            stuck = self._thread.is_alive()
            if stuck:
                logger.warning("%s: ingest thread did not stop within %.1fs; %d registrations "
                               "left unapplied", type(self).__name__, timeout, len(self._queue))
            else:
                self._close_pipe()
        if self._owns_publisher and self._publisher is not None:
            if self._inline_output and stuck:
                # Its sockets belong to the ingest thread, which closes them when it ends.
                return
            self._publisher.shutdown(max(0.1, deadline - time.monotonic()))

    def __enter__(self) -> KvEventConsolidator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ registration API

    def register_store(self, tier: str, dp_rank: int, block_hash: int, parent_hash: int | None,
                       token_ids: Sequence[int], block_size: int, *, lora_id: int | None = None,
                       extra_keys: Sequence[Any] | None = None) -> None:
        """Tier ``tier`` (CPU/DISK, aliases accepted) of dp rank ``dp_rank`` now holds a block.

        Called by the leader's host/disk tier once the block's bytes are in the tier, from any
        thread. Never blocks, no I/O in the common case: validates the arguments (raising
        ValueError for a bad tier or hash) and queues the store for the ingest thread.
        ``token_ids`` is copied (``block_size`` of them, the block's own tokens). ``lora_id``
        and ``extra_keys`` (the block's extra hash keys, e.g. its cache salt) are part of its
        identity, as for a stream event.
        """
        self.register_stores(tier, dp_rank, [(block_hash, parent_hash, list(token_ids),
                                              lora_id, extra_keys)], block_size)

    def register_stores(self, tier: str, dp_rank: int, stores: Sequence[StoreFields],
                        block_size: int) -> None:
        """:meth:`register_store` for several blocks of tier ``tier``, in order, as one queued
        registration: ``stores`` holds ``(block hash, parent hash, token ids, lora id, extra
        keys)`` per block. The leader calls it once per batch of reports it applies (executor
        thread), instead of once per committed block. Every hash is checked before anything
        is queued (ValueError: nothing of the call is). The token lists are taken over, not
        copied: the caller made them for this call and must not change them."""
        medium = normalize_medium(tier)
        lo, hi = _HASH_MIN, _HASH_END
        for block_hash, parent_hash, _, _, _ in stores:
            # _check_hash's test inline (two per block, executor thread): it raises only
            # for the hash that fails it
            if type(block_hash) is not int or not lo <= block_hash < hi:
                _check_hash(block_hash)
            if parent_hash is not None and (type(parent_hash) is not int
                                            or not lo <= parent_hash < hi):
                _check_hash(parent_hash)
        if stores:
            self._submit(("stores", medium, dp_rank, list(stores), block_size))

    def register_remove(self, tier: str, dp_rank: int, block_hashes: Sequence[int]) -> None:
        """Tier ``tier`` of dp rank ``dp_rank`` no longer holds these blocks.

        Called by the tier on eviction, from any thread; never blocks.
        """
        medium = normalize_medium(tier)
        hashes = list(block_hashes)
        for h in hashes:
            _check_hash(h)
        self._submit(("remove", medium, dp_rank, hashes))

    def register_clear(self, tier: str, dp_rank: int) -> None:
        """Tier ``tier`` of dp rank ``dp_rank`` dropped everything (e.g. reset); never blocks."""
        self._submit(("clear", normalize_medium(tier), dp_rank))

    def take_gpu_batch(self, dp_rank: int, events: Sequence[Any]) -> None:
        """One GPU-tier batch of ``dp_rank`` (one of ``direct_ranks``), in the order it was
        made: wire events as maps, or the event sink's :class:`~kvbm_plugin.wire.events
        .EncodedBatch` (decoded on the ingest thread). The caller hands it over and must not
        change it afterwards.

        Called by ``KvEventSink.flush`` on the leader's event pump thread (one thread per
        rank): an append and, after an idle spell, one pipe write; never blocks. Raises
        ValueError for a rank not in ``direct_ranks``.
        """
        if dp_rank not in self._direct:
            raise ValueError(f"{type(self).__name__}.take_gpu_batch: dp rank {dp_rank!r} is not "
                             f"one of direct_ranks {sorted(self._direct)}")
        if self._state == "stopped":
            self._c["direct_batches_dropped"] += 1
            self._log.log(logging.WARNING, "gpu-after-shutdown", "%s: GPU-tier batch of dp rank "
                          "%d after shutdown dropped", type(self).__name__, dp_rank)
            return
        if self._direct_in - self._direct_out >= self._max_pending:
            # The ingest thread is this far behind: what it has not applied yet is bounded.
            self._c["direct_batches_dropped"] += 1
            self._log.log(logging.WARNING, "gpu-backlog", "%s: %d GPU-tier batches wait for the "
                          "ingest thread; a batch of dp rank %d dropped (direct_batches_dropped="
                          "%d): its GPU residency is resynced", type(self).__name__,
                          self._max_pending, dp_rank, self._c["direct_batches_dropped"])
            if dp_rank not in self._direct_lost:
                self._direct_lost.add(dp_rank)
                self._submit(("gpu-lost", None, dp_rank))
            return
        self._direct_in += 1
        self._submit(("gpu", None, dp_rank, events))

    def _submit(self, item: _Registration) -> None:
        if self._state == "stopped":
            self._c["registrations_dropped"] += 1
            self._log.log(logging.WARNING, "registration-after-shutdown", "%s: %s registration "
                          "after shutdown dropped", type(self).__name__, item[0])
            return
        self._queue.append(item)
        # Wake the ingest thread only if it may be asleep: one pipe write per idle period.
        if not self._wake_pending:
            self._wake_pending = True
            self._wake()

    def _wake(self) -> None:
        if self._wake_w >= 0:
            # Pipe full: a wakeup is pending anyway. Closed: shutdown raced us; nothing to wake.
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    # ------------------------------------------------------------------ observation

    def stats(self) -> dict[str, int]:
        """Shell and core counters (safe to call from any thread; values may lag slightly)."""
        out = dict(self._c)
        # GPU-tier batches received however they came: off a socket, or handed over
        # (take_gpu_batch, counted when accepted; ``direct_batches`` when applied).
        out["messages_received"] += self._direct_in
        publisher = self._publisher
        out["output_subscriptions"] = 0
        if publisher is not None:  # lost by a threaded publisher after publish() accepted it
            published = publisher.stats()
            out["output_lost"] += int(published.get("lost_after_accept", 0))
            # Subscriptions the output took in: whether a router's SUB is listening yet.
            out["output_subscriptions"] = int(published.get("subscriptions_applied", 0))
        out["registrations_queued"] = len(self._queue)
        # Salt strings forgotten at the process-wide bound: such a salt goes out by its id's
        # hex from then on (wire.router_forms), which no client's request names.
        out["salt_texts_evicted"] = SALT_TEXTS.evicted
        out["salt_texts_too_long"] = SALT_TEXTS.too_long  # not kept: spelled by the id too
        out.update(self._core.stats())
        return out

    def wait_idle(self, timeout: float) -> bool:
        """True once every accepted input was applied and published (tests and demos).

        "Accepted": registrations submitted and messages already received from the sockets.
        Polls with a deadline; False when ``timeout`` passes first.
        """
        deadline = time.monotonic() + timeout
        while True:
            if self._is_idle():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def _is_idle(self) -> bool:
        # The ingest thread sets _idle only right before it blocks with an empty queue, and
        # clears it as soon as it wakes; a registration in the queue keeps this False.
        if not self._idle or self._queue:
            return False
        publisher = self._publisher
        if publisher is None:
            return True
        stats = publisher.stats()
        done = stats.get("batches_published")
        if done is None:
            return True
        return done + stats.get("batches_lost", 0) + stats.get("lost_batches", 0) \
            >= self._published_batches

    # ------------------------------------------------------------------ ingest thread

    def _run(self) -> None:
        """The ingest thread: owns every input socket, the core and the output calls."""
        streams: list[_Stream] = []
        poller = zmq.Poller()
        inline: ZmqEventPublisher | None = None
        try:
            if self._inline_output:
                inline = ZmqEventPublisher(
                    self.config.publisher, self.config.output, self.config.output_replay,
                    inline=True, replay_rolled=self.config.publisher.output_replay_rolled)
                self._publisher = inline
                # Its subscriptions, replay requests and both sockets' connection events.
                self._inline_sockets = inline.sockets_to_poll
                for sock in self._inline_sockets:
                    poller.register(sock, zmq.POLLIN)
            for rank in self.config.stream_ranks():
                if rank in self._direct:
                    continue  # handed over by take_gpu_batch
                stream = _Stream(rank)
                streams.append(stream)
                sub = self._ctx.socket(zmq.SUB)
                stream.sub = sub
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, self.config.publisher.hwm)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                keep_alive(sub)  # a publisher gone silent: lost, connected again, replayed
                stream.watch = ConnectionWatch(sub)
                poller.register(stream.watch.socket, zmq.POLLIN)
                sub.connect(self.config.stream_endpoint(rank).connect)
                poller.register(sub, zmq.POLLIN)
                stream.dealer = self._streams.open_dealer(stream, poller)
            poller.register(self._wake_r, zmq.POLLIN)
        except BaseException as exc:
            self._setup_error = exc
            try:
                for stream in streams:
                    self._close_stream(stream, poller)
                if self._inline_output and self._publisher is not None:
                    self._publisher.shutdown(0.0)
            finally:
                self._ready.set()  # start() waits for this
            return
        self._ready.set()
        # Each stream catches up on what its rank published before our subscription took
        # effect once its SUB has reached the publisher (JOINED, GpuStreams.on_connection_event).
        by_socket = {s.sub: s for s in streams}
        by_dealer = {s.dealer: s for s in streams if s.dealer is not None}
        self._streams.poller, self._streams.by_dealer = poller, by_dealer
        try:
            while True:
                try:
                    self._loop(streams, poller, by_socket, by_dealer, inline)
                    break
                except zmq.ContextTerminated:
                    break  # the shared context is gone (process exit): nothing left to read
                except Exception:  # a bug, not bad input: count it and keep ingesting
                    self._c["ingest_errors"] += 1
                    self._streams.loop_failures += 1
                    # A failure that repeats must not turn into a busy loop: back off up to 1 s.
                    # The back-off restarts from 2 ms once a message is applied cleanly again.
                    failures = self._streams.loop_failures
                    self._stop.wait(min(1.0, 0.001 * 2 ** min(failures, 10)))
                    if self._c["ingest_errors"] == 1:
                        logger.exception("%s: ingest loop failed; continuing",
                                         type(self).__name__)
                    else:
                        self._log.log(logging.ERROR, "ingest", "%s: ingest loop failed again "
                                      "(%d times); continuing", type(self).__name__,
                                      self._c["ingest_errors"])
        finally:
            self._drain_registrations()
            self._flush()
            for stream in streams:
                self._close_stream(stream, poller)
            if self._inline_output and self._publisher is not None:
                self._publisher.shutdown(max(0.1, self._shutdown_deadline - time.monotonic()))

    @staticmethod
    def _close_stream(stream: _Stream, poller: zmq.Poller) -> None:
        if stream.watch is not None:
            with contextlib.suppress(KeyError):
                poller.unregister(stream.watch.socket)
            stream.watch.close()
            stream.watch = None
        for sock in (stream.sub, stream.dealer):
            if sock is not None:
                with contextlib.suppress(KeyError):
                    poller.unregister(sock)
                sock.close(linger=0)
        stream.sub = stream.dealer = None

    def _loop(self, streams: list[_Stream], poller: zmq.Poller,
              by_socket: dict[Any, _Stream], by_dealer: dict[Any, _Stream],
              inline: ZmqEventPublisher | None = None) -> None:
        wake_r = self._wake_r
        budget = 256  # messages per socket per round: bounds latency of the other inputs
        flush_every = self._flush_every
        linger = 0  # quiet rounds left in which this thread polls instead of sleeping
        while not self._stop.is_set():
            timeout: int | None = None
            now = time.monotonic()
            for stream in streams:
                if stream.replay is not None:
                    left = max(0, int((stream.replay.deadline - now) * 1000) + 1)
                    timeout = left if timeout is None else min(timeout, left)
            if self._queue:
                timeout = 0  # queued registrations (e.g. after a failed round): no sleeping
            if timeout is None and linger > 0:
                # Inputs came lately: look again in LINGER_MS with the wake flag left set, so
                # the leader's registrations on the executor thread write no wake byte (a
                # pipe write cost it ~15 us of thread CPU each time).
                linger -= 1
                self._idle = True  # as below: about to wait with an empty queue
                timeout = self.LINGER_MS
            else:
                if timeout is None:
                    # Sleeping until woken: the next submitter writes the byte. The queue is
                    # looked at after the flag is cleared: an item queued by a submitter that
                    # still saw the flag set is applied now instead of waiting for a wake.
                    self._wake_pending = False
                    if self._queue:
                        timeout = 0
                self._idle = timeout is None
            if inline is not None and inline.replay_busy:
                # Replay answers of our output go out bit by bit as their requesters read (not
                # input work: the consolidator still counts as idle).
                timeout = 5 if timeout is None else min(timeout, 5)
            ready = dict(poller.poll(timeout))
            unflushed = 0  # input batches applied since the last flush (the loop's end flushed)
            self._idle = False
            if ready or self._queue:
                linger = self.LINGER_ROUNDS
            if wake_r in ready:
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                # The flag stays set while this thread lingers; it is cleared right before the
                # next sleep without a timeout (above), never here: a submitter that saw it set
                # has queued its item, which _drain_registrations below applies.
            if inline is not None and (inline.replay_busy
                                       or any(s in ready for s in self._inline_sockets)):
                inline.service_replay()  # our output's subscriptions, replay requests, answers
            for stream in streams:
                # Before the stream's messages: a message from a restarted publisher must not be
                # taken for the old stream's before its reconnection is seen.
                if stream.watch is not None and stream.watch.socket in ready:
                    for event in stream.watch.events():
                        self._streams.on_connection_event(stream, event)
            # A snapshot: draining a replay may replace the stream's DEALER (_renew_dealer).
            for sock, stream in list(by_dealer.items()):
                if sock in ready:
                    self._streams.drain_replay(stream, sock)
            for sock, stream in by_socket.items():
                if sock in ready:
                    for _ in range(budget):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._c["messages_received"] += 1
                        self._streams.on_live(stream, frames)
                        unflushed += 1
                        if unflushed >= flush_every:
                            # Output of up to ``flush_every`` input batches goes out as one
                            # batch per dp rank: a backlog then costs the output publisher
                            # (an encode call and a send) and every consumer one message per
                            # ``flush_every`` inputs instead of one each. Only a
                            # backlog is held: the round's end flushes below, so a lone
                            # batch is published right after it was applied.
                            unflushed = 0
                            self._flush()
            if any(s.replay is not None for s in streams):
                now = time.monotonic()
                for stream in streams:
                    if stream.replay is not None and now >= stream.replay.deadline:
                        if not stream.replay.startup:
                            self._log.log(logging.WARNING, "replay-timeout", "rank %d: replay "
                                          "gave no END_SEQ within %.1fs", stream.rank,
                                          self._replay_timeout)
                        if stream.replay.verify is not None:
                            # The stream could not be checked: assume the worst.
                            self._c["replay_failures"] += 1
                            self._streams.publisher_restarted(stream, "replay to check the stream "
                                                      "after a reconnection timed out")
                            continue
                        self._streams.replay_failed(stream)
            self._drain_registrations()
            self._flush()

    # --- registrations and output

    def _drain_registrations(self) -> None:
        """Apply what is queued, in order: registrations and handed-over GPU-tier batches."""
        queue = self._queue
        core = self._core
        batches = 0
        while queue:
            item = queue.popleft()
            kind = item[0]
            if kind == "gpu":
                self._direct_out += 1
                self._c["direct_batches"] += 1
                self._streams.apply_direct(self._direct[item[2]], item[2], item[3])
                batches += 1
                if batches >= self._flush_every:
                    batches = 0
                    self._flush()  # a backlog goes out in batches, as from the sockets
                continue
            if kind == "gpu-lost":
                self._direct_lost.discard(item[2])
                self._c["unfillable_gaps"] += 1
                self._streams.resync(self._direct[item[2]], "GPU-tier batches dropped at the "
                             "hand-over bound")
                continue
            if kind == "stores":
                self._apply_stores(item[1], item[2], item[3], item[4])
                continue
            try:
                medium, dp_rank = item[1], item[2]
                if kind == "remove":
                    core.remove(SOURCE_TIERS, medium, dp_rank, item[3])
                else:
                    core.clear(SOURCE_TIERS, medium, dp_rank)
                self._c["registrations"] += 1
            except Exception as exc:  # a tier's bug: counted, never raised here
                self._c["registration_errors"] += 1
                self._log.log(logging.WARNING, "registration", "registration %s dropped: %s",
                              saferepr(item), exc)

    def _apply_stores(self, medium: str, dp_rank: int, stores: list[StoreFields],
                      block_size: int) -> None:
        """One :meth:`register_stores` call's blocks, in order, each as a ``store``
        registration would be (an error drops that block only, counted and logged)."""
        store = self._core.store
        applied = 0
        for block_hash, parent_hash, tokens, lora_id, extra_keys in stores:
            try:
                # The adapter named as the GPU-tier stream names it (a router reads lora_name,
                # never lora_id): one identity for a block on every medium.
                store(SOURCE_TIERS, medium, dp_rank, [block_hash], parent_hash, tokens,
                      block_size, lora_id, lora_name(lora_id),
                      None if extra_keys is None else [extra_keys])
                applied += 1
            except Exception as exc:  # e.g. token count != block_size: the tier's bug
                self._c["registration_errors"] += 1
                self._log.log(logging.WARNING, "registration", "registration %s dropped: %s",
                              saferepr(("store", medium, dp_rank, block_hash, parent_hash,
                                        tokens, block_size, lora_id, extra_keys)), exc)
        self._c["registrations"] += applied

    def _flush(self) -> None:
        """Publish what the core produced: one batch per dp rank, dp rank preserved."""
        dropped = self._core.held_back_dropped
        if dropped != self._held_back_dropped:
            self._log.log(logging.WARNING, "held-back-dropped", "%d stores refused at the "
                          "held-back bound (%d per source and dp rank; held_back_dropped=%d): "
                          "their blocks stay unpublished and are forgotten as if not stored, "
                          "until a source stores them again", dropped - self._held_back_dropped,
                          self._core.max_held_back, dropped)
            self._held_back_dropped = dropped
        output = self._core.take_output()
        if not output:
            return
        publisher = self._publisher
        assert publisher is not None
        # Salts and hashes as routers read them (wire.router_forms); pre-encoded int64 hashes
        # only for the built-in publisher, whose msgspec encoder writes them verbatim.
        salt_form = self.config.publisher.salt_form
        wide = isinstance(publisher, ZmqEventPublisher)
        lora_names = dict(self.config.publisher.lora_names)
        for dp_rank, events in output.items():
            events = spell_for_routers(events, salt_form, wide, lora_names)
            self._published_batches += 1
            self._c["batches_out"] += 1
            self._c["events_out"] += len(events)
            try:
                ok = publisher.publish(events, data_parallel_rank=dp_rank)
            except Exception as exc:  # a publisher plugin breaking its never-raise contract
                ok = False
                self._log.log(logging.ERROR, "output-error", "%s.publish raised %s: %s",
                              type(publisher).__name__, type(exc).__name__, exc)
            if not ok:
                self._c["output_lost"] += 1
                self._log.log(logging.WARNING, "output-lost", "output batch for dp rank %d lost "
                              "by the publisher (consumers see a seq gap)", dp_rank)


_HASH_MIN, _HASH_END = -(1 << 63), 1 << 64  # a block hash: signed or unsigned 64-bit


def _check_hash(value: int) -> None:
    if type(value) is not int or not _HASH_MIN <= value < _HASH_END:
        raise ValueError(f"block hash {value!r} is not a signed or unsigned 64-bit integer")
