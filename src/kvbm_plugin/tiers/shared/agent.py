"""SharedAgent: the leader's background thread that keeps its shared-tier directory true.

One per leader (rank 0's process, or each attention-DP owner), started by the leader at
bring-up. Who calls what:

* TensorRT-LLM's executor thread: :meth:`SharedAgent.hand_over` (every rank reported the puts
  of a batch of blocks: the list is kept for the agent's thread, which checks and queues it
  for confirmation; no I/O, one pipe write per idle period; :meth:`SharedAgent.committed`
  checks and queues on the caller's thread) and :attr:`SharedAgent.available`. Offers are
  :meth:`~.directory.SharedDirectory.lookup`'s.
* The agent's own thread (``kvbm-shared-agent``), which alone calls the store and owns the
  announcement sockets:

  - **confirm**: pending blocks (own commits, peers' announcements) are checked with one
    batched ``exists()`` over every rank's key (:meth:`~.keys.SharedLayout.key` of each layout);
    on all-1 a block becomes resident with ``deadline = call start + lease`` (``exists()`` leases
    the object on Mooncake: ``MasterService::ExistKey`` calls ``GrantLease``), ``on_store`` is
    called, and an own block is announced to the peers. A block absent on any rank is forgotten;
    one whose check failed (store unavailable) is checked again at the next renewal sweep, at
    most :attr:`SharedAgent.CONFIRM_TRIES` times. A block is never tracked on hearsay.
  - **renew**: every ``lease / 3`` every resident block is checked again, batched, which renews
    its lease; a block absent on any rank is dropped with its descendants (``on_remove``); one
    not renewed in time is dropped (with descendants) once it can no longer be offered
    (``deadline - margin``), so what the leader advertises is what it can load.
  - **available**: false from a call that answered ``UNAVAILABLE`` (the circuit breaker open,
    the store unreachable) until a later call succeeds; with nothing to renew, one ``exists()``
    of a key no block has is made per renewal period instead. A store with an ``available`` property
    (:class:`~.breaker.GuardedStore`, whose breaker another thread's failed call may open) is
    asked too, at every lookup. While false nothing is offered.

``on_store`` / ``on_remove`` run on the agent thread and must not block (they feed the
consolidator's queue): ``on_remove`` gets each batch of dropped blocks, every descendant before
its ancestors; an exception from either is counted and logged, never kills the thread.

The thread waits on a poller (announcement sockets and a wake pipe) with a timeout to the next
renewal or expiry: nothing sleeps, and :meth:`SharedAgent.close` wakes and joins it. After a
wake it lingers (polls every :attr:`SharedAgent.LINGER_S` for ``LINGER_ROUNDS`` quiet turns
with its wake flag set), so the leader's commits while batches keep coming write nothing to
the pipe.

**Every turn is bounded, whatever peers and outsiders send.** A turn reads the announcement
sockets for at most ``Announcer.receive``'s budget (:data:`~.announce.HEAR_BUDGET_S`, a bounded
number of frames), confirms at most ``_BATCHES_PER_TURN`` batches and checks the clock for a
renewal sweep; a sweep hears between its chunks within :attr:`SharedAgent.SWEEP_HEAR_SHARE` of
the renewal period. So a flood on the announce endpoint slows how fast announcements are
heard, never the renewals (the longest turn is in ``stats()["turn_max_ms"]``). Without a secret
(``DYN_KVBM_SHARED_ANNOUNCE_SECRET_FILE``) the agent opens no announcement socket at all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.tiers.shared.announce import HEAR_BUDGET_S, Announcer, mm_of_scope
from kvbm_plugin.tiers.shared.block import SharedBlock, check_block, make_block
from kvbm_plugin.tiers.shared.directory import SharedDirectory
from kvbm_plugin.tiers.shared.store import FAILED, MISSING, UNAVAILABLE, SharedStore

if TYPE_CHECKING:
    from kvbm_plugin.settings.shared import SharedSettings
    from kvbm_plugin.tiers.shared.keys import SharedLayout

__all__ = ["SharedAgent"]

# The digest of the probe key: blake2b never yields it for a block (odds 2**-128).
_PROBE_DIGEST: Final = bytes(16)

logger = logging.getLogger(__name__)

_COUNTERS: Final = (
    "committed", "commits_known", "commits_refused", "commits_malformed", "confirmed",
    "confirmed_own",
    "confirmed_heard",
    "confirm_absent", "confirm_failed", "confirm_gave_up", "heard_queued", "heard_known",
    "renewal_sweeps", "renewed", "renewals_failed", "renewals_skipped", "store_calls",
    "store_errors", "probes", "callback_errors", "unavailable_periods",
    "wakes_handled", "turns", "turn_max_ms", "turn_max_cpu_ms", "flood_pauses")


_BLOCK_FIELDS: Final = 7  # make_block's arguments, as the leader hands a commit over


class SharedAgent:
    """The leader's background thread for the shared tier (see the module docstring)."""

    BATCH_BLOCKS: Final = 256  # blocks per exists() call
    # Checks of a pending block (failed, or waiting for its parent) before it is given up; a
    # waiting block is checked again at once the first _WAIT_TRIES times, then at each sweep
    # like a failed one.
    CONFIRM_TRIES: Final = 6
    _WAIT_TRIES: Final = 3
    _BATCHES_PER_TURN: Final = 16  # confirm batches between looks at sockets and deadlines
    # Of each renewal period, the share a sweep may spend hearing announcements between its
    # chunks (a flood must not stretch a sweep past the leases it renews).
    SWEEP_HEAR_SHARE: Final = 0.1
    _MAX_MM: Final = 65536  # own pending blocks' multimodal scope parts kept, at most
    # After a turn whose reading stopped at a bound (frames still waiting: a flood), the
    # thread waits this long (or for a wake) before the next: under a flood it is busy about
    # half the time, not all of it (the engine's executor thread shares its process's GIL).
    FLOOD_PAUSE_S: Final = 0.02
    # After a turn that answered a wake (the leader's commits), the thread looks again every
    # LINGER_S for LINGER_ROUNDS quiet turns with its wake flag left set: while batches of
    # commits keep coming, the executor thread's wake() writes no byte to the pipe (about
    # 40 us of its thread CPU each time, measured in the engine).
    LINGER_S = 0.005
    LINGER_ROUNDS = 20

    def __init__(self, settings: SharedSettings, store: SharedStore,
                 layouts: Sequence[SharedLayout], directory: SharedDirectory,
                 on_store: Callable[[SharedBlock], None],
                 on_remove: Callable[[list[SharedBlock]], None],
                 announce_endpoint: str | None, peers: Sequence[str], *,
                 context: zmq.Context | None = None) -> None:
        if not layouts:
            raise ValueError("SharedAgent needs the layout of every TP rank (none given)")
        prefixes: dict[str, SharedLayout] = {}
        for layout in layouts:  # replicated pages: one key for every rank
            prefixes.setdefault(layout.prefix(), layout)
        self._layouts = tuple(prefixes.values())
        lease = directory.lease_s
        if store.lease_s is not None and store.lease_s < lease:
            logger.warning("kvbm_plugin: the shared store leases objects for %.3g s, less than "
                           "%s=%.3g: leases are counted from the store's", store.lease_s,
                           cc.SHARED_LEASE_S, lease)
            lease = store.lease_s
        if lease <= directory.margin_s:
            raise cc.ConfigError(f"{cc.SHARED_LOAD_MARGIN_S}={directory.margin_s!r} must be "
                                 f"below the store's lease ({lease!r} s): nothing could be "
                                 "offered")
        self.settings = settings
        self.lease_s: Final = lease
        self.period_s: Final = lease / 3
        self._store = store
        self._directory = directory
        self._clock = directory.clock
        self._on_store = on_store
        self._on_remove = on_remove
        secret = settings.announce_secret
        if secret is None and peers:
            raise cc.ConfigError(f"{cc.SHARED_PEERS}={','.join(peers)!r} needs "
                                 f"{cc.SHARED_ANNOUNCE_SECRET_FILE}")
        if secret is None and announce_endpoint is not None:
            logger.info("kvbm_plugin: shared-tier announcements are off (no %s): other "
                        "engines do not learn this engine's writes", cc.SHARED_ANNOUNCE_SECRET_FILE)
            announce_endpoint = None
        self._announcer = Announcer(announce_endpoint, peers, secret=secret, context=context,
                                    tokens_per_block=self._layouts[0].tokens_per_block,
                                    rate=settings.announce_rate)
        self._mm: dict[bytes, str] = {}  # own pending block -> its multimodal scope part
        # The leader's commits handed over (hand_over, executor thread), queued by this
        # thread at the start of its next turn: lists appended and popped whole (atomic).
        self._handed: deque[Sequence[tuple[SharedBlock, str | None]]] = deque()
        self._n = dict.fromkeys(_COUNTERS, 0)
        self._log = RateLimitedLog(logger)
        self._retry: list[tuple[SharedBlock, bool, int]] = []  # checks again at the next sweep
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._open_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._ticket_lock = threading.Lock()
        self._wakes = 0  # the latest ticket handed out
        self._closed = False
        self._seen_available = False
        directory.set_available(False)  # until the store has answered
        if isinstance(getattr(type(store), "available", None), property):
            # A circuit breaker shared with this process's worker opens on its failures too.
            guarded: Any = store
            directory.set_available_source(lambda: bool(guarded.available))

    # ---- leader (bring-up, executor thread) -----------------------------------------

    def start(self) -> None:
        """Start the thread; returns once the announcement sockets are bound and connected and
        the store answered a first probe (one ``exists()``). Raises ConfigError naming the
        endpoint when the sockets cannot be bound or connected."""
        if self._thread is not None:
            raise RuntimeError("SharedAgent.start called twice")
        self._thread = threading.Thread(target=self._run, name="kvbm-shared-agent",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._open_error is not None:
            self._thread.join()
            self._close_pipe()
            self._closed = True
            raise cc.ConfigError(
                f"shared-tier announcements: cannot bind {self._announcer.endpoint!r} "
                f"({cc.SHARED_ANNOUNCE_ENDPOINT}, default {cc.LEADER_ZMQ_PUB_PORT} + 2000 + "
                f"dp rank) or connect {cc.SHARED_PEERS}={','.join(self._announcer.peers)!r}: "
                f"{self._open_error}") from self._open_error

    def committed(self, block: SharedBlock, scope: str | None = None, *,
                  wake: bool = True) -> None:
        """Every rank reported its put of ``block``, keyed under the reuse scope ``scope``
        (``wire.identity.request_scope``): confirm it, then make it loadable and announce it
        (with the multimodal part of ``scope``, which the block's fields do not carry, so
        that a peer can recompute its digest). Executor thread; never blocks. ValueError
        for a malformed block. ``wake`` False: the caller calls :meth:`wake` itself once
        after a batch of commits (the leader, after each batch of reports), instead of a
        wake-up per block."""
        if self.committed_many([(block, scope)]) and wake:
            self.wake()

    def committed_many(self, blocks: Sequence[tuple[SharedBlock, str | None]]) -> int:
        """:meth:`committed` of each ``(block, scope)``, in order, with one hold of the
        directory's lock, without waking the thread (the leader calls :meth:`wake` after);
        returns how many were queued. Every block is checked before any is queued
        (ValueError: none is). Executor thread; never blocks."""
        for block, _ in blocks:
            check_block(block)
        if self._closed:
            self._n["commits_refused"] += len(blocks)
            return 0
        return self._queue_commits(blocks)

    def hand_over(self, blocks: Sequence[tuple[Any, str | None]]) -> int:
        """:meth:`committed_many` of the leader's commits of one batch of reports, done on the
        agent's thread: this keeps the list (the caller hands it over and must not change it)
        and wakes the thread, which checks and queues it at the start of its next turn (the
        blocks made, checked, the multimodal parts and the directory's lock off the executor
        thread). Each commit is ``(block, scope)``, the block a :class:`SharedBlock` or the
        tuple of its fields in ``make_block``'s order (what the leader hands over). A
        malformed block is counted there (``commits_malformed``) and logged, the others
        queued. Executor thread; never blocks (a deque append and :meth:`wake`). Returns the
        wake's ticket: once ``wakes_handled`` reaches it the blocks are queued (or counted),
        0 when the agent is closed (counted refused)."""
        if self._closed:
            self._n["commits_refused"] += len(blocks)
            return 0
        self._handed.append(blocks)
        return self.wake()

    @property
    def wakes_handled(self) -> int:
        """The latest ticket a turn answered (any thread; :meth:`wake`, :meth:`hand_over`)."""
        return self._n["wakes_handled"]

    def _take_handed(self) -> None:
        """Queue the commits handed over since the last turn, oldest first (agent thread)."""
        handed = self._handed
        while handed:
            blocks = handed.popleft()
            good = []
            for item in blocks:
                try:
                    block = item[0]
                    if type(block) is tuple:  # the leader's fields: the block is made here
                        if len(block) != _BLOCK_FIELDS:
                            raise ValueError(f"commit fields: {len(block)} values, not "
                                             f"{_BLOCK_FIELDS}: {saferepr(block)}")
                        block = make_block(*block)
                    check_block(block)
                except ValueError as exc:  # the leader's bug: never queued, never silent
                    self._n["commits_malformed"] += 1
                    self._log.log(logging.ERROR, "malformed-commit", "kvbm_plugin: shared-tier "
                                  "commit not tracked: %s", exc)
                    continue
                good.append((block, item[1]))
            self._queue_commits(good)

    def _queue_commits(self, blocks: Sequence[tuple[SharedBlock, str | None]]) -> int:
        """Queue checked commits for confirmation (:meth:`committed_many`, :meth:`_take_handed`);
        returns how many were queued."""
        for block, scope in blocks:
            mm = mm_of_scope(scope)
            if mm is not None and len(self._mm) < self._MAX_MM:
                # Before the block is queued: the agent may confirm and announce it at once.
                # (A GIL-atomic store; the agent pops it; a digest names its scope, so an
                # entry left by a block tracked already is right too, and the next sweep
                # forgets it.)
                self._mm[block.digest] = mm
        queued = 0
        directory = self._directory
        for (block, _), ok in zip(blocks, directory.enqueue_many([b for b, _ in blocks], True),
                                  strict=True):
            if ok:
                queued += 1
            elif directory.is_tracked(block.digest):
                self._n["commits_known"] += 1
            else:
                self._n["commits_refused"] += 1  # too many pending (the directory counts it)
                self._log.log(logging.WARNING, "pending-full", "kvbm_plugin: shared-tier block "
                              "%s not tracked: %d blocks already await their check",
                              block.digest.hex(), directory.pending_limit)
        self._n["committed"] += queued
        return queued

    @property
    def available(self) -> bool:
        """Whether the store answered the agent's last call (executor thread: offer or not)."""
        return self._directory.available

    def stats(self) -> dict[str, int]:
        """Every count (any thread): ``committed`` (own commits queued), ``commits_malformed``
        (handed over and refused by their check), ``confirmed`` (blocks
        made resident: ``confirmed_own`` + ``confirmed_heard``), ``confirm_absent`` /
        ``confirm_failed`` / ``confirm_gave_up``, ``renewed`` (lease renewals, per block;
        also as ``renewals``), ``renewals_failed``, ``renewal_sweeps``, ``store_calls``,
        ``store_errors`` (calls with a failed key), ``unavailable_periods``, ``turns``,
        ``turn_max_ms`` (the longest turn of the thread, wall clock), ``turn_max_cpu_ms`` (the
        most CPU one turn used: the wall clock also counts time the OS gave other processes),
        ``flood_pauses``; the announcer's
        (``announced``, ``heard``, ``bad_announcements``, ``unauthenticated``, ``replayed``,
        ``stale``, ``forged``, ``rate_limited``, ``peer_disconnects``, ``lost``,
        ``subscriptions``, ...);
        the directory's drops (``dropped_absent``, ``dropped_expired``, ``dropped_lru``,
        ``dropped_descendants``) and sizes (``resident``, ``pending``, ``pinned``)."""
        out = dict(self._n)
        out.update(self._announcer.stats())
        d = self._directory.stats()
        for key in ("dropped_absent", "dropped_expired", "dropped_lru", "dropped_descendants",
                    "resident", "pending", "pinned", "refused_orphan", "refused_full",
                    "refused_collision", "refused_pending_full"):
            out[key] = d[key]
        out["renewals"] = out["renewed"]  # the design note's name for it
        out["available"] = int(self._directory.available)
        return out

    def wake(self) -> int:
        """Make the thread look at its queues and clock now (a commit; a test that moved its
        clock; close). Any thread. Returns a ticket: once :meth:`stats`' ``wakes_handled``
        reaches it, a whole turn of the thread (hear, confirm, a sweep if due, expiry) has
        run after this call."""
        with self._ticket_lock:
            self._wakes = ticket = self._wakes + 1
        if not self._wake_pending and not self._closed:
            self._wake_pending = True
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")
        return ticket

    def close(self) -> None:
        """Stop and join the thread, close the sockets; idempotent. Tracked blocks are left as
        they are (their leases run out in the store)."""
        if self._closed:
            return
        self._stop.set()
        self._wake_pending = False
        self.wake()
        self._closed = True
        if self._thread is not None:
            self._thread.join()
        while self._handed:  # handed over after the thread's last turn: never tracked
            self._n["commits_refused"] += len(self._handed.popleft())
        self._close_pipe()

    # ---- the agent thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._announcer.open()
        except BaseException as exc:  # the caller re-raises it as a ConfigError
            self._open_error = exc
            self._ready.set()
            return
        # Before start() returns: availability known, the first sweep one period from now.
        self._probe()
        next_sweep = self._clock() + self.period_s
        self._ready.set()
        try:
            self._loop(next_sweep)
        except Exception:  # a bug: the tier stops confirming and renewing, loudly
            logger.exception("kvbm_plugin: the shared-tier agent stopped; its shared blocks "
                             "are dropped (nothing would renew their leases)")
            self._directory.set_available(False)
            roots = [b.digest for b in self._directory.blocks() if b.parent_digest is None]
            self._report_removed(self._directory.drop(roots, "expired"))
        finally:
            self._announcer.close()

    def _loop(self, next_sweep: float) -> None:
        poller = zmq.Poller()
        for sock in self._announcer.sockets():
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        wake_only = zmq.Poller()
        wake_only.register(self._wake_r, zmq.POLLIN)
        directory, clock, announcer = self._directory, self._clock, self._announcer
        n = self._n
        linger = 0  # quiet turns left in which this thread polls instead of sleeping
        handled = 0  # the latest ticket a turn answered
        while not self._stop.is_set():
            turn_start, turn_cpu = time.monotonic(), time.thread_time()
            ticket = self._drain_wake()
            self._take_handed()  # every list handed over before ``ticket`` was counted
            if ticket != handled:
                linger = self.LINGER_ROUNDS
            handled = ticket
            self._hear()
            self._confirm_pending()
            if clock() >= next_sweep:
                start = clock()
                self._sweep()
                next_sweep = start + self.period_s
            self._report_removed(directory.expire())
            n["wakes_handled"] = ticket
            n["turns"] += 1
            turn_ms = int((time.monotonic() - turn_start) * 1000)
            if turn_ms > n["turn_max_ms"]:
                n["turn_max_ms"] = turn_ms
            turn_cpu_ms = int((time.thread_time() - turn_cpu) * 1000)
            if turn_cpu_ms > n["turn_max_cpu_ms"]:
                n["turn_max_cpu_ms"] = turn_cpu_ms
            if self._stop.is_set():
                return
            if directory.has_pending():
                timeout = 0.0
            else:
                now = clock()
                timeout = next_sweep - now
                expiry = directory.next_expiry()
                if expiry is not None:
                    timeout = min(timeout, expiry - now)
                if linger > 0 and timeout > self.LINGER_S:
                    linger -= 1  # the flag stays set: a waker writes nothing
                    timeout = self.LINGER_S
                else:
                    # About to sleep longer: the next wake() writes the byte. A waker that
                    # still saw the flag set has counted its ticket (and queued its
                    # commits) before this clear: another turn answers it at once.
                    self._wake_pending = False
                    if self._wakes != handled or directory.has_pending():
                        timeout = 0.0
            if announcer.saturated:
                n["flood_pauses"] += 1
                timeout = max(0.0, min(timeout, self.FLOOD_PAUSE_S))
                wake_only.poll(int(timeout * 1000) + 1 if timeout > 0 else 0)
            else:
                poller.poll(max(0, int(timeout * 1000) + 1) if timeout > 0 else 0)

    def _drain_wake(self) -> int:
        """Empty the wake pipe; returns the latest ticket this turn answers. The flag is
        cleared by the loop only before a sleep longer than a linger (a wake after the clear
        writes the pipe again; one before it is seen by the ticket check there)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass
        return self._wakes

    def _hear(self, budget_s: float | None = None) -> None:
        """Queue the announced blocks a bounded read of the sockets found (agent thread)."""
        blocks = self._announcer.receive() if budget_s is None \
            else self._announcer.receive(budget_s)
        for block in blocks:
            if self._directory.enqueue(block, False):
                self._n["heard_queued"] += 1
            else:
                self._n["heard_known"] += 1

    def _confirm_pending(self) -> None:
        for _ in range(self._BATCHES_PER_TURN):
            batch = self._directory.take_pending(self.BATCH_BLOCKS)
            if not batch:
                return
            self._confirm(batch)

    def _confirm(self, batch: list[tuple[SharedBlock, bool, int]]) -> None:
        directory = self._directory
        start = self._clock()
        codes = self._exists([b.digest for b, _, _ in batch])
        width = len(self._layouts)
        present: list[SharedBlock] = []
        own: set[bytes] = set()
        tries_of: dict[bytes, int] = {}
        absent: list[bytes] = []
        for i, (block, is_own, tries) in enumerate(batch):
            mine = codes[i * width:(i + 1) * width]
            if all(c == 1 for c in mine):
                present.append(block)
                tries_of[block.digest] = tries
                if is_own:
                    own.add(block.digest)
            elif any(c == 0 or c == MISSING for c in mine):
                absent.append(block.digest)
            else:
                self._n["confirm_failed"] += 1
                self._retry_later(block, is_own, tries + 1)
        if absent:
            self._n["confirm_absent"] += len(absent)
            directory.forget(absent)
        if not present:
            return
        result = directory.admit(present, start + self.lease_s)
        self._report_removed(result.evicted)
        announce: list[SharedBlock] = []
        for block in result.resident:
            self._callback(self._on_store, block)
            if block.digest in own:
                self._n["confirmed_own"] += 1
                announce.append(block)
            else:
                self._n["confirmed_heard"] += 1
        # Counted once the leader was told: a reader that sees the count (a test, a sweep
        # waiting on it) sees the callbacks' effects too.
        self._n["confirmed"] += len(result.resident)
        for block in result.waiting:
            tries = tries_of[block.digest] + 1
            if tries < self._WAIT_TRIES:
                directory.requeue(block, block.digest in own, tries)
            else:
                self._retry_later(block, block.digest in own, tries)
        for block, why in result.refused:
            self._log.log(logging.WARNING, f"refused-{why}", "kvbm_plugin: shared-tier block "
                          "%s not tracked (%s)", block.digest.hex(), why)
        mm = self._mm
        self._announcer.publish(announce, [mm.pop(b.digest, None) for b in announce]
                                if mm else None)

    def _retry_later(self, block: SharedBlock, own: bool, tries: int) -> None:
        if tries >= self.CONFIRM_TRIES:
            self._n["confirm_gave_up"] += 1
            self._directory.forget([block.digest])
            self._log.log(logging.WARNING, "gave-up", "kvbm_plugin: shared-tier block %s given "
                          "up after %d checks (the store did not answer)", block.digest.hex(),
                          tries)
        else:
            self._retry.append((block, own, tries))

    def _sweep(self) -> None:
        """Renew every resident block's lease (chunks of :attr:`BATCH_BLOCKS`)."""
        directory = self._directory
        retry, self._retry = self._retry, []
        for digest in list(self._mm):  # not pending any more, and not announced by us
            if not directory.is_tracked(digest) or directory.deadline_of(digest) is not None:
                self._mm.pop(digest, None)
        for block, own, tries in retry:
            directory.requeue(block, own, tries)
        cursor = 0
        swept = 0
        hear_until = time.monotonic() + self.SWEEP_HEAR_SHARE * self.period_s
        while not self._stop.is_set():
            cursor, digests = directory.renewal_chunk(cursor, self.BATCH_BLOCKS)
            if not digests:
                break
            swept += len(digests)
            start = self._clock()
            codes = self._exists(digests)
            width = len(self._layouts)
            renewed: list[bytes] = []
            absent: list[bytes] = []
            unavailable = 0
            for i, digest in enumerate(digests):
                mine = codes[i * width:(i + 1) * width]
                if all(c == 1 for c in mine):
                    renewed.append(digest)
                elif any(c == 0 or c == MISSING for c in mine):
                    absent.append(digest)
                elif any(c == UNAVAILABLE for c in mine):
                    unavailable += 1
            failed = len(digests) - len(renewed) - len(absent)
            self._n["renewed"] += directory.renew(renewed, start + self.lease_s)
            self._n["renewals_failed"] += failed
            if absent:
                self._report_removed(directory.drop(absent, "absent"))
            if unavailable == len(digests):
                # The store is not answering: the rest would fail the same way; the
                # blocks expire at their deadlines unless the next sweep renews them.
                self._n["renewals_skipped"] += 1
                break
            # A long sweep: keep up with commits and announcements, within the sweep's share.
            self._hear(max(0.0, min(HEAR_BUDGET_S, hear_until - time.monotonic())))
            self._confirm_pending()
        if not swept:
            self._probe()
        # Counted once done: a test that waits for a sweep then sees all it did.
        self._n["renewal_sweeps"] += 1

    def _exists(self, digests: Sequence[bytes]) -> list[int]:
        """Codes of every rank's key of each digest, in order (rank-major per block); a raising
        or malformed call reads as FAILED for every key. Updates :attr:`available`."""
        keys = [layout.key(d) for d in digests for layout in self._layouts]
        self._n["store_calls"] += 1
        try:
            codes = list(self._store.exists(keys))
            if len(codes) != len(keys):
                raise ValueError(f"{len(codes)} results for {len(keys)} keys")
        except Exception as exc:  # a store client must not raise; count it, go on
            self._n["store_errors"] += 1
            self._log.log(logging.WARNING, "exists-raised", "kvbm_plugin: shared store "
                          "exists() failed: %s: %s", type(exc).__name__, saferepr(str(exc)))
            return [FAILED] * len(keys)
        errors = sum(1 for c in codes if c < 0 and c != MISSING)
        if errors:
            self._n["store_errors"] += 1
            self._log.log(logging.WARNING, "exists-codes", "kvbm_plugin: shared store "
                          "exists(): %d of %d keys failed (%s)", errors, len(keys),
                          "unavailable" if UNAVAILABLE in codes else "failed")
        self._set_available(UNAVAILABLE not in codes)
        return codes

    def _probe(self) -> None:
        """With nothing to renew: one ``exists()`` of a key no block has, so availability is
        learnt the way renewals learn it (through a circuit breaker, the call that lets it
        probe the store and close again)."""
        self._n["probes"] += 1
        self._exists([_PROBE_DIGEST])

    def _set_available(self, available: bool) -> None:
        if self._seen_available and not available:
            self._n["unavailable_periods"] += 1
        self._seen_available = available
        self._directory.set_available(available)

    def _report_removed(self, blocks: list[SharedBlock]) -> None:
        if blocks:
            self._callback(self._on_remove, blocks)

    def _callback(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            fn(arg)
        except Exception as exc:  # the caller's bug: counted and logged, the thread goes on
            self._n["callback_errors"] += 1
            self._log.log(logging.ERROR, f"callback-{getattr(fn, '__name__', '?')}",
                          "kvbm_plugin: shared-tier callback %s raised %s: %s",
                          getattr(fn, "__qualname__", fn), type(exc).__name__,
                          saferepr(str(exc)))

    def _close_pipe(self) -> None:
        # Forget the numbers first: a late wake() must not write into a reused descriptor.
        fds = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
