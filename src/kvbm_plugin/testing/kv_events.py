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

Attention DP (``cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp``, stored file id
161320417): every rank has its own event manager and every event carries its
``attention_dp_rank``; rank 0's queue holds ``event_buffer_max_size × dp_size``; an exchange
thread on each rank runs every ``attention_dp_events_gather_period_ms`` (default 5), and on a
rank other than 0 takes (serialises and clears) its whole readable queue and sends it to
rank 0, which appends it to its own. Only rank 0's ``get_latest_events`` therefore returns
every rank's events (appended past the bound, which the next local flush applies); a second
reader of another rank's queue would race the exchange thread.
:class:`AttentionDpGather` is that thread; :attr:`SimKVCacheManager.reads` counts reads of a
queue that is gathered away, which must stay 0.
"""

from __future__ import annotations

import pickle
import threading
from collections import deque
from collections.abc import Callable
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

    def __init__(self, pool: Any, event_buffer_max_size: int = DEFAULT_EVENT_BUFFER_MAX_SIZE,
                 *, attention_dp_rank: int | None = None, attention_dp_size: int = 1) -> None:
        self.pool = pool
        self.attention_dp_rank = attention_dp_rank
        # rank 0 keeps every rank's events (upstream: maxKVEventEntries × dp size)
        self.event_buffer_max_size = event_buffer_max_size * (
            attention_dp_size if attention_dp_rank == 0 else 1)
        self.reads = 0  # get_latest_events on a rank whose queue is gathered to rank 0
        self.gathered_in = 0  # events appended from other ranks (rank 0)
        self._ready: deque[Any] = deque()
        self._cond = threading.Condition()
        self.produced = 0  # events made readable so far
        self.dropped = 0  # events the bounded queue dropped (oldest first)

    def flush_iteration_events(self) -> None:
        events = self.pool.take_events()
        if not events or self.event_buffer_max_size <= 0:
            return
        if self.attention_dp_rank is not None:
            events = [{**e, "attention_dp_rank": self.attention_dp_rank} for e in events]
        objects = [event_object(e) for e in events]
        self.produced += len(objects)
        self._append(objects)

    def _append(self, objects: list[Any], bounded: bool = True) -> None:
        with self._cond:
            self._ready.extend(objects)
            while bounded and len(self._ready) > self.event_buffer_max_size:
                self._ready.popleft()
                self.dropped += 1
            self._cond.notify_all()

    def receive_gathered(self, objects: list[Any]) -> None:
        """Rank 0: another rank's events, appended by the exchange (any thread). Upstream
        inserts them past the bound; the next local flush drops the oldest."""
        self.gathered_in += len(objects)
        self._append(objects, bounded=False)

    def take_for_gather(self) -> list[Any]:
        """A rank other than 0: the exchange thread's take (the whole readable queue)."""
        with self._cond:
            out = list(self._ready)
            self._ready.clear()
        return out

    def get_latest_events(self, timeout_ms: float | None = 0) -> list[Any]:
        """Drain the readable events (C++-like objects), waiting up to ``timeout_ms`` for one."""
        if self.attention_dp_rank:
            self.reads += 1  # a reader racing the exchange thread for this rank's events
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


class AttentionDpGather:
    """The exchange thread of an attention-DP rank other than 0: every ``period_s`` it takes
    the rank's readable events and hands them to ``send`` (rank 0's
    :meth:`SimKVCacheManager.receive_gathered`, or a socket to rank 0's process)."""

    def __init__(self, manager: SimKVCacheManager, send: Callable[[list[Any]], None],
                 period_s: float = 0.005) -> None:
        self._manager = manager
        self._send = send
        self._period_s = period_s
        self.sent = 0  # events handed to rank 0
        self._lock = threading.Lock()  # a take and its send are one step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"sim-adp-gather-r{manager.attention_dp_rank}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.gather_once()

    def gather_once(self) -> int:
        with self._lock:
            objects = self._manager.take_for_gather()
            if objects:
                self._send(objects)
                self.sent += len(objects)
            return len(objects)

    def snapshot(self) -> tuple[int, int]:
        """(events readable and not taken yet, events sent so far), consistent."""
        with self._lock:
            return self._manager.readable(), self.sent

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self.gather_once()  # what the last pass produced


def pickled_sender(socket: Any) -> Callable[[list[Any]], None]:
    """A ``send`` for :class:`AttentionDpGather` across processes: one pickled message per
    take on a ZMQ PUSH socket (upstream: MPI send of the serialised events)."""
    return lambda objects: socket.send(pickle.dumps(objects))


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
