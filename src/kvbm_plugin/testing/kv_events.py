"""The buffered KV-event path of a simulated TensorRT-LLM engine, as TRT-LLM has it.

Upstream (NVIDIA/TensorRT-LLM: the V1 ``KVCacheManager`` in
``tensorrt_llm/_torch/pyexecutor/resource_manager.py`` (``flush_iteration_events``,
``get_latest_events`` forward to the C++ manager), ``PyExecutor`` in ``py_executor.py``@9521caf4,
the executor worker in ``tensorrt_llm/executor/worker.py``@cc4777e9, the serializer in
``tensorrt_llm/_utils.py``@ed53795b):

* the C++ event manager collects an iteration's events and makes them readable only when
  ``KVCacheManager.flush_iteration_events()`` runs, which ``PyExecutor._add_kv_cache_events``
  does once per iteration after ``update_resources``;
* ``KVCacheManager.get_latest_events(timeout_ms)`` drains the readable queue and returns C++
  event objects (not dicts); the queue is bounded (``event_buffer_max_size``), oldest dropped;
* the executor worker's KV-event dispatch thread (``dispatch_kv_cache_events_task``) calls
  ``PyExecutor.get_latest_kv_cache_events()``, i.e. ``kv_cache_manager.get_latest_events(0)``,
  and serializes the objects with ``KVCacheEventSerializer``: that is what
  ``LLM.get_kv_cache_events``, ``/kv_cache_events`` and Dynamo's TRT-LLM publisher read. Anyone
  else draining the same queue takes those events away from them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from kvbm_plugin.testing.fake_trtllm import KVCacheEventSerializer, event_object

DEFAULT_EVENT_BUFFER_MAX_SIZE = 10_000


class SimKVCacheManager:
    """The event surface of TRT-LLM's ``KVCacheManager`` over the simulated block pool.

    The pool (``gpu_pool.GpuPool``) records an iteration's events as dicts in ``pool.events``;
    :meth:`flush_iteration_events` (executor thread, end of iteration) turns them into C++-like
    event objects and makes them readable. :meth:`get_latest_events` may be called from any
    thread (the executor thread, the dispatch thread).
    """

    def __init__(self, pool: Any, event_buffer_max_size: int = DEFAULT_EVENT_BUFFER_MAX_SIZE
                 ) -> None:
        self.pool = pool
        self.event_buffer_max_size = event_buffer_max_size
        self._ready: deque[Any] = deque()
        self._cond = threading.Condition()
        self.produced = 0  # events made readable so far
        self.dropped = 0  # events the bounded queue dropped (oldest first)

    def flush_iteration_events(self) -> None:
        events, self.pool.events = self.pool.events, []
        if not events or self.event_buffer_max_size <= 0:
            return
        objects = [event_object(e) for e in events]
        with self._cond:
            self._ready.extend(objects)
            self.produced += len(objects)
            while len(self._ready) > self.event_buffer_max_size:
                self._ready.popleft()
                self.dropped += 1
            self._cond.notify_all()

    def get_latest_events(self, timeout_ms: float | None = 0) -> list[Any]:
        """Drain the readable events (C++-like objects), waiting up to ``timeout_ms`` for one."""
        with self._cond:
            if not self._ready and timeout_ms:
                self._cond.wait(timeout_ms / 1000.0)
            out = list(self._ready)
            self._ready.clear()
        return out

    def readable(self) -> int:
        """Events readable and not drained yet (no draining; tests)."""
        with self._cond:
            return len(self._ready)

    def wait_readable(self, timeout_s: float) -> bool:
        """Block until events are readable (no draining); the dispatch reader's wake-up."""
        with self._cond:
            if not self._ready:
                self._cond.wait(timeout_s)
            return bool(self._ready)


class KvEventDispatchReader:
    """TRT-LLM's KV-event dispatch thread: reads through ``executor.get_latest_kv_cache_events``
    (so an instance attribute the plugin put on the KV cache manager is used, as upstream) and
    keeps the serialized dicts, the stream ``LLM.get_kv_cache_events`` would return.

    :meth:`pause` / :meth:`resume` model a reader that polls rarely (an HTTP client of
    ``/kv_cache_events``): while paused it reads nothing, so whatever another party drains in
    that time never reaches it.
    """

    def __init__(self, executor: Any, manager: SimKVCacheManager) -> None:
        self._executor = executor
        self._manager = manager
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # held across one read: pause() waits for it
        self._resumed = threading.Event()
        self._resumed.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sim-kv-event-dispatch",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._resumed.wait(0.2)
            if not self._resumed.is_set():
                continue
            self._manager.wait_readable(0.05)
            self.read_once()

    def read_once(self) -> int:
        """One read of the queue (also callable by a test); returns how many events it got."""
        with self._lock:
            if not self._resumed.is_set() or self._stop.is_set():
                return 0
            raw = self._executor.get_latest_kv_cache_events()
            if not raw:
                return 0
            self._events.extend(KVCacheEventSerializer.serialize(list(raw)))
            return len(raw)

    def pause(self) -> None:
        with self._lock:
            self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._events)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._resumed.set()
        self._thread.join(timeout)
