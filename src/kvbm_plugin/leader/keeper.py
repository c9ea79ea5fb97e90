"""The leader's keeper thread: applies the workers' reports off the executor thread, and keeps
the router's view live while TensorRT-LLM's loop blocks.

Reports: the completion hub nudges the keeper whenever a worker's reports are handed in; the
keeper then applies them (the leader's ``_keeper_apply``: the requests whose object died
reaped, then the reports folded, committed, their tier STOREs registered) under the leader's
lock, if the lock is free at that moment. A hook that holds it applies reports itself where it
did before, so nothing waits for the keeper and nothing is applied later than without it; what
the keeper applies, the executor thread does not (measured: ``bench_leader_thread.py``). Like
any Python thread, the keeper holds the GIL while it applies: the executor thread may wait for
it in wall time (not in its thread CPU) up to one apply's length, as it may for the event
pump's steps.

Idle: TensorRT-LLM makes no connector call while its loop waits for a request
(``py_executor.py`` @ 0004396720054: ``_fetch_and_enqueue_requests`` blocks in the request
queue when nothing is active), so without help the last GPU-tier events would stay undrained
until the next request. Once no connector hook ran for ``period_s``, the keeper runs the
leader's ``idle_tick`` every ``period_s``: a report, event or tier change is published at most
about ``2 * period_s`` after it happened (0.2 s by default, under the 1 s bound the plugin
promises).

Sweep: every ``sweep_period_s`` (10 s), busy or idle, where the lock is free, the keeper runs
the sweep of overdue ops (``OpCompletions.sweep``: those some rank never reported, a lost
report, are failed after ``REPORT_DEADLINE_S``).

Safety: every hook of the leader and ``idle_tick`` run under the leader's lock (:func:`locked`),
so leader state is never touched by two threads at once; the lock is held for O(events) work,
never across I/O (publishing hands batches to publisher threads). Neither the keeper's apply
nor ``idle_tick`` reads a request object (a weak reference's death only); ``idle_tick`` touches
no TensorRT-LLM state except ``KVCacheManager.get_latest_events(0)`` (drain mode only), which
TensorRT-LLM's own KV-event dispatch thread already calls off the executor thread (the C++
event manager guards its queue with a mutex). It never looks for the KV cache manager (the
frame walk works from the executor thread only).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvbm_plugin._util.ratelimit import RateLimitedLog

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def locked(method: _F) -> _F:
    """Run a leader method under ``self._lock`` and note that the engine called it (a wait
    for the lock counted in ``self._stats``)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = self._lock
        if not lock.acquire(blocking=False):
            # The keeper holds it (an apply or an idle tick): what the hook waits for is
            # counted (``hook_lock_waits``), never hidden.
            self._stats["hook_lock_waits"] += 1
            lock.acquire()
        try:
            self._last_call = time.monotonic()
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return wrapper  # type: ignore[return-value]


class LeaderKeeper:
    """The leader's keeper thread: ``apply()`` (True: it applied reports) under ``lock`` soon
    after each :meth:`nudge` (the completion hub's, from the threads that hand reports in)
    when the lock is free, and ``tick()`` under ``lock`` every ``period_s`` while
    ``last_call()`` is older than ``period_s``; ``sweep()`` (the overdue ops failed:
    ``OpCompletions.sweep``) under ``lock`` every ``sweep_period_s``, busy or idle, when the
    lock is free (else at its next wake, within ``period_s``). Started by the leader's
    constructor, stopped by its shutdown.

    The nudged ``apply`` moves the folding and committing of the workers' reports off the
    executor thread without adding a wait to it: the lock is only tried, never waited for
    (a hook holds it: the hooks apply reports themselves, as they did before the keeper did),
    so the most the executor thread can wait is the rest of one apply it would otherwise
    have run itself."""

    def __init__(self, tick: Callable[[], None], apply: Callable[[], bool], lock: Any,
                 last_call: Callable[[], float], period_s: float, name: str,
                 sweep: Callable[[], Any] | None = None, sweep_period_s: float = 10.0) -> None:
        self._tick = tick
        self._apply = apply
        self._sweep = sweep
        self.sweep_period_s = sweep_period_s
        self._lock = lock
        self._last_call = last_call
        self.period_s = period_s
        self.ticks = 0  # idle ticks run (leader stats)
        self.nudged = 0  # wakes by a nudge, done
        self.applies = 0  # of those, the ones that applied reports (``apply`` said so)
        self.busy = 0  # of those, the ones that found the lock held (a hook applies them)
        self.errors = 0
        self.cpu_s = 0.0  # this thread's CPU time in applies and ticks (benchmarks)
        self._log = RateLimitedLog(logger)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        """Reports were handed in (any thread; never blocks, never raises): apply them soon."""
        if not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        clock = time.thread_time
        next_idle = time.monotonic() + self.period_s
        next_sweep = time.monotonic() + self.sweep_period_s
        while not self._stop.is_set():
            nudged = self._wake.wait(max(0.0, next_idle - time.monotonic()))
            if self._stop.is_set():
                return
            if nudged:
                self._wake.clear()  # (before the apply: a report handed in during it nudges)
                applied = self._if_free(self._apply, "apply reports")
                if applied is None:
                    self.busy += 1
                elif applied:
                    self.applies += 1
                self.nudged += 1  # (counted once the wake's work is done)
            now = time.monotonic()
            if self._sweep is not None and now >= next_sweep \
                    and self._if_free(self._sweep, "sweep overdue ops") is not None:
                next_sweep = now + self.sweep_period_s
            if now < next_idle:
                continue
            next_idle = now + self.period_s
            if now - self._last_call() < self.period_s:
                continue  # the engine is calling the connector: it publishes itself
            with self._lock:
                if self._stop.is_set():
                    return
                start = clock()
                try:
                    self._tick()
                    self.ticks += 1
                except Exception:  # the keeper must survive a bad tick; counted, logged
                    self.errors += 1
                    logger.exception("kvbm_plugin: the leader's idle tick failed")
                finally:
                    self.cpu_s += clock() - start

    def _if_free(self, work: Callable[[], Any], what: str) -> bool | None:
        """Run ``work`` under the lock if it is free now, never waiting for it: None when a
        hook holds it, else whether ``work`` returned true. A failing ``work`` is survived:
        counted in :attr:`errors` and logged at most once per 10 s per kind of work."""
        if not self._lock.acquire(blocking=False):
            return None
        start = time.thread_time()
        try:
            return bool(work())
        except Exception as exc:
            self.errors += 1
            self._log.log(logging.ERROR, f"keeper-{what}", "kvbm_plugin: the leader's keeper "
                          "failed to %s (%d errors so far): %r", what, self.errors, exc)
            return False
        finally:
            self._lock.release()
            self.cpu_s += time.thread_time() - start

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
