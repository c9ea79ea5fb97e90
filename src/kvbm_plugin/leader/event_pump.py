"""The leader's event pump: drains TensorRT-LLM's buffered KV events into the sink and
publishes the sink's batches on a thread of its own, off the executor thread.

TensorRT-LLM drains those events off its executor thread too: its own readers call
``PyExecutor.get_latest_kv_cache_events`` -> ``KVCacheManager.get_latest_events(0)`` from
worker threads (``tensorrt_llm/executor/base_worker.py`` ``fetch_kv_cache_events``, run
through ``asyncio.to_thread``; TensorRT-LLM @2d06866f), and the C++ event manager swaps its
queue out under its own mutex. Doing the same here takes the drain, the serializer, the sink's
ingest, the encode and the send (about half of what the leader's hooks cost per block, see
docs/performance.md) off the thread every iteration waits for.

Who calls what:

* the executor thread (``build_connector_meta``, under the leader's lock) calls :meth:`wake`
  once per iteration: a flag, it never waits for the pump;
* the pump's thread steps every :attr:`EventPump.BUSY_S` while iterations come, and every
  ``period_s`` once they stopped (so a tap-mode sink fed by TensorRT-LLM's readers is
  published while no iteration runs), until the next iteration's wake;
* a caller that needs this iteration's events now runs :meth:`step` itself: the leader while
  names are awaited from them (a tier block waits for one, or a rule it computes names by is
  not confirmed yet: the first requests of each rule), ``publish_now``, the idle keeper and
  shutdown. It waits for a step the pump has in progress, at most one.

Where KVCacheManagerV2's Python hooks feed the sink (on the executor thread, without the
sink's lock), the leader stops the pump's thread at attach time and flushes on the executor
thread as before (``GpuTierEvents._attach``).

One step at a time (``_step_lock``): two concurrent sink flushes could publish one rank's
batches out of order. What the sink's ``on_flush`` observer sees goes through
``events.trtllm_publisher.TrtllmNameFeed`` to the executor thread, which owns the name
table.

Never imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog

logger = logging.getLogger(__name__)

__all__ = ["EventPump"]


class EventPump:
    """One daemon thread per leader that has a GPU-tier sink (see the module docstring).
    ``poll`` drains the source (None until the executor thread attached it), ``flush``
    publishes the sink's pending batches; both are the sink's and the source's own calls."""

    # While the engine iterates, the pump steps every BUSY_S: the period at which
    # TensorRT-LLM's own attention-DP event exchange runs by default
    # (``attention_dp_events_gather_period_ms`` = 5). A wake per iteration instead cost the
    # executor thread ~20 us of thread CPU (the waiter's futex) in the leader benchmark.
    BUSY_S = 0.005
    # Steps with no iteration in between before the pump dozes (period_s between steps, woken
    # by the next iteration's wake): the engine is idle.
    QUIET_STEPS = 20

    def __init__(self, poll: Callable[[], Any], flush: Callable[[], Any], name: str,
                 period_s: float = 0.1) -> None:
        self._poll = poll
        self._flush = flush
        self.period_s = period_s
        self._step_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # Plain flags, read and written under the GIL: the executor thread sets _pending and
        # reads _dozing; the pump sets _dozing and reads _pending, in that order each, so a
        # wake is never lost (one of the two sees the other's store).
        self._pending = False
        self._dozing = False
        self.steps = 0  # steps run on the pump's thread (leader stats)
        self.inline_steps = 0  # steps run by a caller that needed the events at once
        self.errors = 0
        self.cpu_s = 0.0  # the pump thread's CPU time in steps (benchmarks read it)
        self._log = RateLimitedLog(logger)  # a step failing every 5 ms: one line per 10 s
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Executor thread, once per iteration: the pump drains and publishes within
        :attr:`BUSY_S`. Two attribute stores and a load; an ``Event.set`` only when the pump
        dozes (the first iteration after an idle spell)."""
        self._pending = True
        if self._dozing:
            self._dozing = False
            self._wake.set()

    def step(self) -> None:
        """Drain and publish now on the calling thread, after a step the pump's thread has in
        progress (at most one step: the work the caller would otherwise do itself)."""
        with self._step_lock:
            self.inline_steps += 1
            self._once()

    def _once(self) -> None:
        self._poll()
        self._flush()

    def _run(self) -> None:
        clock = time.thread_time
        quiet = 0
        while not self._stop.is_set():
            if quiet >= self.QUIET_STEPS:
                self._dozing = True
                if not self._pending:  # else a wake came after the last step: no doze
                    self._wake.wait(self.period_s)
                self._dozing = False
                self._wake.clear()
            else:
                self._stop.wait(self.BUSY_S)
            if self._stop.is_set():
                return
            pending, self._pending = self._pending, False
            quiet = 0 if pending else quiet + 1
            with self._step_lock:
                start = clock()
                try:
                    self._once()
                    self.steps += 1
                except Exception as exc:  # the pump must survive a bad step; counted, logged
                    self.errors += 1
                    self._log.log(logging.ERROR, "step", "kvbm_plugin: the leader's event pump "
                                  "step failed (%s: %s; event_pump_errors=%d)",
                                  type(exc).__name__, exc, self.errors)
                self.cpu_s += clock() - start

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (a step in progress finishes first); the caller then runs the last
        step itself (shutdown). Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
