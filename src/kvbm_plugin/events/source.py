"""How an event sink receives a live TensorRT-LLM KV cache manager's events.

:func:`attach_event_source` tees the manager, without patching TensorRT-LLM (only the one
manager instance's attributes are wrapped): KVCacheManagerV2's event-sink hooks are forwarded
to the sink as they are called; the buffered path (``get_latest_events``) is drained every
iteration or only copied from TRT-LLM's own readers (``DYN_KVBM_KV_EVENTS_SOURCE``, see
docs/event_sources.md). The leader attaches once it finds the manager and polls the returned
:class:`EventSource` once per iteration on the executor thread, before ``sink.flush()``.
No torch or TensorRT-LLM import.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.wire.events import WireFormatError

if TYPE_CHECKING:
    from kvbm_plugin.event_sink import KvEventSink

logger = logging.getLogger(__name__)

V2_HOOKS: tuple[str, ...] = (
    "add_created_event", "add_stored_event", "add_stored_block_event_from_block",
    "add_stored_life_cycle_event_from_block", "add_removed_event",
    "add_removed_life_cycle_event", "add_updated_event", "set_layer_group_window_sizes",
)


class EventSource:
    """How a sink receives a KV cache manager's events; made by :func:`attach_event_source`.

    ``kind`` is ``"v2-hooks"`` or ``"buffered"``. The leader calls :meth:`poll` once per
    iteration before ``sink.flush()`` (executor thread) and :meth:`detach` at teardown.
    """

    def __init__(self, kind: str, poll: Callable[[], int], detach: Callable[[], None],
                 mode: str = "tap", drains: Callable[[], bool] = lambda: False) -> None:
        self.kind = kind
        self.mode = mode  # DYN_KVBM_KV_EVENTS_SOURCE as applied: auto | drain | tap
        # Hook calls (V2) or events (buffered) that reached the tee: whether anything arrives
        # at all (the leader's self-check). Incremented on the caller's thread (GIL).
        self.events_seen = 0
        self._drains = drains
        self._poll = poll
        self._detach = detach
        self._detached = False

    @property
    def drains(self) -> bool:
        """Whether :meth:`poll` drains TRT-LLM's buffer now (``auto`` and ``drain`` stop once
        another reader appeared; V2 hooks and ``tap`` never drain)."""
        return not self._detached and self._drains()

    def describe(self) -> str:
        """One line for the start-up log and ``doctor``."""
        if self.kind == "v2-hooks":
            return ("KVCacheManagerV2 Python event hooks wrapped (never drains TRT-LLM's "
                    "queue); " + ("receiving" if self.events_seen else
                                  "unconfirmed: no GPU-tier event received yet"))
        if self.mode == "tap":
            return ("buffered get_latest_events, tap: copies what TRT-LLM's own readers drain, "
                    "never drains")
        return (f"buffered get_latest_events, {self.mode}: " + (
            "draining (the leader's event pump, every 5 ms while the engine "
            "iterates) until another reader appears" if self.drains
            else "another reader appeared; tapping what it drains"))

    def poll(self) -> int:
        """Drain events the manager buffered (buffered kind with drain=True); returns count."""
        return 0 if self._detached else self._poll()

    def detach(self) -> None:
        """Remove the tee; idempotent."""
        if not self._detached:
            self._detached = True
            self._detach()


def attach_event_source(kv_cache_manager: Any, sink: KvEventSink, *,
                        serialize: Callable[[Any], list[dict[str, Any]]] | None = None,
                        drain: bool = True, mode: str | None = None,
                        v2_backend: str | None = None) -> EventSource:
    """Make ``sink`` receive the events of a live TRT-LLM KV cache manager, without patching
    TensorRT-LLM (only the one manager instance's attributes are wrapped).

    Called once by the leader after the executor built its KV cache manager (executor thread).

    - KVCacheManagerV2 (``kv_cache_manager.event_manager`` has the V2 hooks; exists when
      ``kv_cache_config.event_buffer_max_size > 0``): each hook of that event-manager instance
      is wrapped so the call goes to TRT-LLM's manager first, then to the sink. TRT-LLM's own
      pull path (``LLM.get_kv_cache_events``, ``/kv_cache_events``) keeps working; every rank
      (also each attention-DP rank) sees its own events before any gather.
    - Buffered path (released versions: ``kv_cache_manager.get_latest_events(timeout_ms)``):
      that method is wrapped so that whoever drains the buffer (TRT-LLM's KV-event dispatch
      thread, or :meth:`EventSource.poll`) also feeds the sink. ``serialize`` turns the C++
      event objects into dicts (``tensorrt_llm._utils.KVCacheEventSerializer.serialize``;
      dicts pass through). ``mode`` (``DYN_KVBM_KV_EVENTS_SOURCE``) says whether ``poll``
      drains the buffer too: ``tap`` never (only what TRT-LLM's own readers drain is seen,
      and nothing is taken from them); ``auto`` drains until the wrapped getter is called by
      anyone else, then taps; ``drain`` the same, with a warning when that other reader
      appears. Two drainers would split the stream: each drain takes every event queued so
      far (``KVCacheManager.get_latest_events`` reaches the batch manager's
      ``KVCacheEventManager::getEvents``, which returns ``std::exchange(mEvents, {})``;
      ``cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp``, stored file id 161320417),
      so the other reader's stream would miss the removals the plugin took, and a block the
      engine freed would stay published there (Dynamo's TRT-LLM publisher,
      ``/kv_cache_events``) for good (issue 27, item 6).
      ``drain=False`` is the older spelling of ``mode="tap"``. The tee runs on the caller's
      thread (TRT-LLM's KV-event dispatch thread): ``sink.ingest`` takes one short lock.
      Each drain is ingested before the next drain starts, whoever drains (see
      ``_tee_buffered``): what reaches the sink is in the buffer's order.

    ``v2_backend``: TensorRT-LLM's KVCacheManagerV2 backend when known
    (``TLLM_KV_CACHE_MANAGER_V2_BACKEND`` as the loaded module read it; see
    :func:`cpp_sink`). A V2 event manager whose hooks the C++ radix tree calls natively is
    refused (ValueError, :data:`CPP_SINK_REFUSED`): its wrapped Python attributes would
    never be called.

    Raises ValueError naming what is missing when neither path is available.
    """
    event_manager = getattr(kv_cache_manager, "event_manager", None)
    if event_manager is not None and hasattr(event_manager, "add_stored_block_event_from_block"):
        cpp = cpp_sink(event_manager, v2_backend)
        if cpp:
            raise ValueError(CPP_SINK_REFUSED.format(cpp))
        return _tee_v2(event_manager, sink)
    get_latest = getattr(kv_cache_manager, "get_latest_events", None)
    if get_latest is None or hasattr(kv_cache_manager, "add_stored_block_event_from_block"):
        raise ValueError(
            f"{type(kv_cache_manager).__name__} exposes neither a V2 event manager "
            "(.event_manager with add_stored_block_event_from_block) nor get_latest_events: "
            "set kv_cache_config.event_buffer_max_size > 0 and enable_block_reuse=True so that "
            "TensorRT-LLM produces KV cache events")
    # The buffered getter exists whether or not the buffer does; with size 0 it would return
    # nothing forever, so say so instead of publishing an empty stream.
    size = getattr(kv_cache_manager, "event_buffer_max_size", None)
    if isinstance(size, int) and size <= 0:
        raise ValueError(f"kv_cache_config.event_buffer_max_size={size}: TensorRT-LLM buffers no "
                         "KV cache events; set it > 0 (e.g. 1024, as `kvbm-plugin yaml` does)")
    if mode is None:
        mode = "drain" if drain else "tap"
    if mode not in ("auto", "drain", "tap"):
        raise ValueError(f"attach_event_source: mode={mode!r} is not auto | drain | tap")
    return _tee_buffered(kv_cache_manager, get_latest, sink, serialize, mode)


# Where TensorRT-LLM's C++ KVCacheManagerV2 types live (nanobind): ``tensorrt_llm/runtime/
# kv_cache_manager_v2/__init__.py`` (stored id 57009499785) binds ``KVCacheEventManager =
# _cpp.KVCacheEventManager`` from ``tensorrt_llm.bindings.internal.batch_manager.
# kv_cache_manager_v2`` (or ``bindings.internal...`` when loaded standalone) unless
# ``TLLM_KV_CACHE_MANAGER_V2_BACKEND=python``; its default is ``cpp``.
_BINDINGS_MODULES = ("tensorrt_llm.bindings", "bindings.")

# The hooks that report a block (what the self-check waits for); the other two are set-up.
_BLOCK_HOOKS = frozenset(V2_HOOKS) - {"add_created_event", "set_layer_group_window_sizes"}

CPP_SINK_REFUSED = (
    "KVCacheManagerV2's event manager is TensorRT-LLM's C++ one ({}): its radix tree calls the "
    "event sink natively, so the plugin's Python hooks would receive nothing. Turn on "
    "TensorRT-LLM's own streaming publisher (kv_cache_config.kv_events_config, publisher "
    "'zmq'), which the plugin reads and consolidates as the GPU-tier source, or run "
    "TLLM_KV_CACHE_MANAGER_V2_BACKEND=python")


def cpp_sink(event_manager: Any, v2_backend: str | None = None) -> str:
    """Why ``event_manager``'s hooks are not called through Python, or ``""``.

    C++ backend (TensorRT-LLM's default): the radix tree calls its ``StreamingEventSink`` /
    event manager natively (``kv_cache_events.py`` @44004b3864a7, stored id 57357230020: "the
    C++ radix tree calls the sink natively, not through Python"; the sink itself
    ``streamingEventSink.cpp`` @1454f28a18fa, stored id 68391744805), so an instance
    attribute set from Python shadows nothing it calls. Told by the event manager's type (a
    class of TensorRT-LLM's bindings anywhere in its MRO) or by ``v2_backend`` (``"cpp"``).
    A backend that hides both is caught by the leader's self-check instead."""
    for cls in type(event_manager).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module.startswith(_BINDINGS_MODULES):
            return f"{module}.{cls.__qualname__}"
    if (v2_backend or "").lower() == "cpp":
        return "TLLM_KV_CACHE_MANAGER_V2_BACKEND=cpp"
    return ""


def _tee_v2(event_manager: Any, sink: KvEventSink) -> EventSource:
    wrapped: list[str] = []
    source: EventSource | None = None
    log = RateLimitedLog(logger)
    # TRT-LLM's V2 event manager calls its own hooks from inside each other (the life-cycle
    # hook calls stored-from-block, which calls add_stored_event, through ``self``, so through
    # these instance attributes). Only the outermost call per thread is observed: one store
    # per block, under the hash of the outermost call, which is the hash later removed.
    nesting = threading.local()

    for name in V2_HOOKS:
        original = getattr(event_manager, name, None)
        if original is None:
            continue
        ours = getattr(sink, name)

        def tee(*args: Any, _orig: Any = original, _ours: Any = ours, _name: str = name,
                **kwargs: Any) -> Any:
            if getattr(nesting, "active", False):
                return _orig(*args, **kwargs)  # called by another hook: TRT-LLM's only
            nesting.active = True
            if source is not None and _name in _BLOCK_HOOKS:
                source.events_seen += 1
            try:
                result = _orig(*args, **kwargs)
            finally:
                nesting.active = False
            try:
                _ours(*args, **kwargs)
            except Exception as exc:  # the caller is TRT-LLM's KV cache manager: never break it
                if not isinstance(exc, WireFormatError):  # those were counted by the sink
                    sink._count_lost_input(1)
                log.log(logging.ERROR, "v2-hook", "attach_event_source: KvEventSink.%s "
                        "failed, event not published: %s: %s", _name, type(exc).__name__, exc)
            return result

        setattr(event_manager, name, tee)  # instance attribute: shadows the class method
        wrapped.append(name)
    # The window map was set while the manager was built, before we attached.
    sizes = getattr(event_manager, "_window_size_by_layer_group", None)
    if isinstance(sizes, Mapping) and sizes:
        sink.set_layer_group_window_sizes(sizes)

    def detach() -> None:
        for name in wrapped:
            event_manager.__dict__.pop(name, None)

    source = EventSource("v2-hooks", lambda: 0, detach, "tap")
    return source


# Events serialized and ingested at a time. TensorRT-LLM's serializer writes each event as dicts,
# one per token (about 7.5 KB for a 32-token block); a whole iteration of 256 stored and 256
# removed blocks is about 2 MB, more than a core's L2 (1 MB on the machine of
# docs/performance.md). Read after all of them were built, the dicts come from further out:
# at 1,024 + 1,024 blocks per iteration the sink cost 1.8 us per block against 0.95 sliced
# (median of 7, benchmarks/bench_vs_vllm.py's feeds). A slice at a time, the sink reads each
# while it is still in L2, and the next slice reuses the memory the last one freed.
# ``KVCacheEventSerializer.serialize`` writes each event on its own
# (``[cls.to_json_str(event) for event in events]``, ``tensorrt_llm/_utils.py``, stored id
# 52995752), so slices give the same dicts as the whole.
SERIALIZE_CHUNK = 64


def _tee_buffered(manager: Any, get_latest: Callable[..., Any], sink: KvEventSink,
                  serialize: Callable[[Any], list[dict[str, Any]]] | None,
                  mode: str) -> EventSource:
    """The buffered tee. Its drainers may run at once: :meth:`EventSource.poll` on the
    executor thread and TensorRT-LLM's own readers, which call
    ``PyExecutor.get_latest_kv_cache_events`` -> ``get_latest_events(0)`` from worker threads
    (``tensorrt_llm/executor/base_worker.py`` ``fetch_kv_cache_events``, run through
    ``asyncio.to_thread`` by ``rpc_worker_mixin.py`` ``fetch_kv_cache_events_async``,
    TensorRT-LLM @2d06866f). Each call takes the events queued so far (the C++ buffer is
    swapped out under its own mutex), so two drainers hold consecutive slices of the stream;
    fed to the sink in the order they finish, a "remove X" could overtake its "store X" and
    leave X published for good. ``order`` makes each drain and its ingest one step: a reader
    waits for a poll in progress (a zero-timeout drain plus one short ingest); the poll never
    waits for a reader (whose getter may block up to its own timeout): when a reader holds
    the step, the poll skips this iteration, as that reader is draining anyway."""
    log = RateLimitedLog(logger)
    ours = threading.local()  # set while poll() itself calls the getter
    state = {"others": mode == "tap"}  # True once anyone else read (auto: stop draining)
    # Reentrant: poll() holds it across manager.get_latest_events, which is this tee.
    order = threading.RLock()

    def feed(raw: Any) -> None:
        if not raw:
            return
        items = list(raw)
        if not isinstance(items[0], Mapping):
            if serialize is None:
                sink._count_lost_input(len(items))
                log.log(logging.ERROR, "serialize", "attach_event_source: %d KV events are %s "
                        "objects, not dicts, and no serialize= was given; pass "
                        "tensorrt_llm._utils.KVCacheEventSerializer.serialize", len(items),
                        type(items[0]).__name__)
                return
            # A slice at a time, each ingested while its dicts are still in the CPU cache.
            for start in range(0, len(items), SERIALIZE_CHUNK):
                chunk = items[start:start + SERIALIZE_CHUNK]
                try:
                    dicts = serialize(chunk)
                except Exception as exc:
                    sink._count_lost_input(len(chunk))
                    log.log(logging.ERROR, "serialize-failed", "attach_event_source: "
                            "serializing %d KV events failed, not published (counted as "
                            "malformed): %s: %s", len(chunk), type(exc).__name__, exc)
                    continue
                sink.ingest(dicts)
                source.events_seen += len(chunk)
            return
        sink.ingest(items)
        source.events_seen += len(items)

    def tee(*args: Any, **kwargs: Any) -> Any:
        if not state["others"] and not getattr(ours, "polling", False):
            state["others"] = True  # a plain store, read by the executor thread (GIL)
            if mode == "auto":
                logger.info("kvbm_plugin: another reader of TensorRT-LLM's KV events appeared "
                            "(%s); no longer draining, publishing what it drains",
                            threading.current_thread().name)
            elif mode == "drain":
                logger.warning(
                    "kvbm_plugin: DYN_KVBM_KV_EVENTS_SOURCE=drain, but another reader of "
                    "TensorRT-LLM's KV events drains them too (%s: LLM.get_kv_cache_events, "
                    "/kv_cache_events or Dynamo's publisher). Two drainers split the stream and "
                    "that reader would keep blocks the engine freed; the plugin stops draining "
                    "and publishes what that reader drains (set "
                    "DYN_KVBM_KV_EVENTS_SOURCE=tap where such a reader always runs)",
                    threading.current_thread().name)
        with order:  # what is drained is ingested before anyone drains again
            raw = get_latest(*args, **kwargs)
            try:
                feed(raw)
            except Exception:  # the caller is TRT-LLM's thread: never break its pull path
                logger.exception("attach_event_source: feeding KV events to the sink failed")
        return raw

    manager.get_latest_events = tee

    def drains() -> bool:
        return mode in ("auto", "drain") and not state["others"]

    def poll() -> int:
        if not drains():
            return 0
        if not order.acquire(blocking=False):
            return 0  # a reader is draining (and feeding) right now: never wait for it
        try:
            if not drains():  # a reader appeared between the check and the step
                return 0
            ours.polling = True
            try:
                raw = manager.get_latest_events(0)
            finally:
                ours.polling = False
        finally:
            order.release()
        return len(raw) if raw else 0

    def detach() -> None:
        if getattr(manager, "__dict__", {}).get("get_latest_events") is tee:
            del manager.get_latest_events

    source = EventSource("buffered", poll, detach, mode, drains)
    return source
