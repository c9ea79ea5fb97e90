"""The leader's idle keeper: keeps the router's view live while TensorRT-LLM's loop blocks.

TensorRT-LLM makes no connector call while its loop waits for a request
(``py_executor.py`` @ 0004396720054: ``_fetch_and_enqueue_requests`` blocks in the request
queue when nothing is active), so without help the last completion reports would stay
unapplied (their tier STOREs unpublished) and the last GPU-tier events undrained until the
next request. :class:`IdleKeeper` is one daemon thread per leader that, once no connector hook
ran for ``period_s``, runs the leader's ``idle_tick`` every ``period_s``: a report, event or
tier change is published at most about ``2 * period_s`` after it happened (0.2 s by default,
under the 1 s bound the plugin promises).

Safety: every hook of the leader and ``idle_tick`` run under the leader's lock (:func:`locked`),
so leader state is never touched by two threads at once; the lock is held for O(events) work,
never across I/O (publishing hands batches to publisher threads). ``idle_tick`` touches no
TensorRT-LLM state except ``KVCacheManager.get_latest_events(0)`` (drain mode only), which
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

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def locked(method: _F) -> _F:
    """Run a leader method under ``self._lock`` and note that the engine called it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._last_call = time.monotonic()
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class IdleKeeper:
    """Calls ``tick()`` under ``lock`` every ``period_s`` while ``last_call()`` is older than
    ``period_s``. Started by the leader's constructor, stopped by its shutdown."""

    def __init__(self, tick: Callable[[], None], lock: Any, last_call: Callable[[], float],
                 period_s: float, name: str) -> None:
        self._tick = tick
        self._lock = lock
        self._last_call = last_call
        self.period_s = period_s
        self.ticks = 0  # idle ticks run (leader stats)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if time.monotonic() - self._last_call() < self.period_s:
                continue  # the engine is calling the connector: it publishes itself
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    self._tick()
                    self.ticks += 1
                except Exception:  # the keeper must survive a bad tick; counted, logged
                    self.errors += 1
                    logger.exception("kvbm_plugin: the leader's idle tick failed")

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
