"""The leader's GPU-tier event feed: attaching to TensorRT-LLM's KV cache manager, draining
(or tapping) its events into the sink, publishing them, and learning the names they give blocks.

A mixin of :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader` (its state lives
there); every method runs under the leader's lock, on the executor thread (rank 0, or each
attention-DP rank) or the leader's idle keeper thread. No I/O; never imports torch.
"""

from __future__ import annotations

import logging
from typing import Any

from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector import trtllm_publisher as _native
from kvbm_plugin.connector.keeper import locked
from kvbm_plugin.connector.trtllm_compat import (
    find_kv_cache_manager,
    kv_cache_manager_v2_backend,
    kv_event_serializer,
)
from kvbm_plugin.consolidator_config import EVENTS_SOURCE

logger = logging.getLogger("kvbm_plugin.connector_leader")


class GpuEventFeed:
    """GPU-tier event methods of the leader (see the module docstring)."""

    _MAX_ATTACH_ATTEMPTS: int
    # The self-check: iterations in which the leader knows the pool holds computed blocks
    # (a tracked request with a full block of computed prompt KV) with no GPU-tier event from
    # the source yet; after this many, the source is reported silent (warned, counted).
    SELF_CHECK_ITERATIONS: int = 32
    _self_check_iterations: int
    _stats: dict[str, int]
    _block_size: int
    _log: Any
    _attach_attempts: int
    _event_source_problem: str
    _events_source: str
    _native: Any
    _native_feed: Any
    _stream_names: Any
    _held: dict[Any, Any]
    _reqs: dict[int, Any]
    _naming: Any
    _par: Any
    _config: Any
    _dp_rank: int
    _host_name: str
    _tier_events: Any
    _fallback_serializer: Any
    event_sink: Any
    event_source: Any

    _release_held: Any  # connector.tier_book.TierBookkeeping
    _shared_sync: Any  # connector.shared_book.SharedBook

    def _attach_event_source(self) -> None:
        """Find the engine's KV cache manager through the calling PyExecutor's frames and tee
        its KV events into the sink (see ``gpu_events.source.attach_event_source``). Executor
        thread, first iterations only; frame inspection, no I/O."""
        self._attach_attempts += 1
        manager = find_kv_cache_manager()
        if manager is None:
            if self._attach_attempts == 1:
                # Said at the first iteration, once: the executor that calls us holds no KV
                # cache manager we can find (e.g. TRT-LLM's coroutine executor); later
                # iterations keep looking quietly, and say so if one turns up.
                logger.warning(
                    "kvbm_plugin: no KV cache manager with events found in the executor's call "
                    "stack (an executor without self.kv_cache_manager, e.g. PyExecutorCoro?); "
                    "GPU-tier events are not published from this process until one is found "
                    "(set %s=off and run `kvbm-plugin sidecar` against trtllm-serve, or push "
                    "them with event_sink.ingest)", EVENTS_SOURCE)
            self._event_source_problem = "no KV cache manager found"
            return
        from kvbm_plugin.gpu_events.source import attach_event_source

        try:
            self.event_source = attach_event_source(
                manager, self.event_sink,
                serialize=kv_event_serializer() or self._fallback_serializer,
                mode=self._events_source, v2_backend=kv_cache_manager_v2_backend())
        except ValueError as exc:
            self._attach_attempts = self._MAX_ATTACH_ATTEMPTS
            self._event_source_problem = f"unavailable: {exc}"
            logger.warning("kvbm_plugin: GPU-tier events unavailable: %s", exc)
            return
        # Not "attached": V2 hooks are confirmed only once an event arrives (the self-check).
        logger.info("kvbm_plugin: GPU-tier event source found: %s", self.event_source_status)
        if self._par.attention_dp and self.event_source.kind == "v2-hooks":
            logger.warning(_llm_args.V2_UNDER_ATTENTION_DP)

    @property
    def event_source_status(self) -> str:
        """Where GPU-tier events come from now, in words (logged at attach time)."""
        if self.event_source is not None:
            if (self._stats.get("gpu_source_silent_iterations")
                    and not self.event_source.events_seen):
                return self._silent_line()
            return self.event_source.describe()
        if self._native is not None or self._events_source == "off":
            return self._source_line()
        return self._event_source_problem

    def _self_check(self) -> None:
        """Never report a source as working while nothing arrives (issue 26, item 2): a V2
        event manager whose hooks TensorRT-LLM's C++ radix tree calls natively leaves the
        wrapped Python hooks uncalled, and not every such backend can be told from Python
        (``gpu_events.source.cpp_sink``). Per iteration (executor thread, under the
        lock), until the first event: count the iterations in which a tracked request holds a
        full block of computed prompt KV; past :attr:`SELF_CHECK_ITERATIONS` of them with no event,
        count each further one (``gpu_source_silent_iterations``) and warn, rate-limited.
        Costs one pass over the tracked requests per iteration, only until confirmed."""
        source = self.event_source
        if source.kind != "v2-hooks" or source.events_seen:
            return
        bs = self._block_size
        # Prompt blocks only: KVCacheManagerV2 commits a context request's tokens into its
        # radix tree (a stored event) up to its context position, then stops committing, so
        # generated tokens never make one (``kv_cache_manager_v2.py``'s ``update_resources``,
        # stored id 3501434665: ``kv_cache.commit(...)`` then ``stop_committing()``).
        if not any(min(s.valid_tokens, s.prompt_tokens) >= bs for s in self._reqs.values()):
            return
        self._self_check_iterations += 1
        if self._self_check_iterations <= self.SELF_CHECK_ITERATIONS:
            return
        self._stats["gpu_source_silent_iterations"] += 1
        self._log.log(logging.WARNING, "gpu-source-silent", "kvbm_plugin: %s",
                      self._silent_line())

    def _silent_line(self) -> str:
        return (f"GPU-tier events: NOT receiving: the KVCacheManagerV2 Python hooks were "
                f"wrapped but no event arrived in {self._self_check_iterations} iterations "
                "while the pool held computed blocks (the C++ backend calls its event sink "
                "natively); the router sees no GPU-tier blocks from this rank. Turn on "
                "TensorRT-LLM's streaming publisher (kv_cache_config.kv_events_config), which "
                "the plugin consolidates, or run TLLM_KV_CACHE_MANAGER_V2_BACKEND=python")

    def _source_line(self) -> str:
        """The configured GPU-tier source, in words (start-up log, ``doctor``'s wording)."""
        return _native.gpu_source_line(self._native, self._events_source, self._config,
                                       self._dp_rank, self._host_name)

    @locked
    def flush_events(self) -> None:
        """Publish this iteration's GPU-tier batch and hand queued tier events on.

        Called by ``build_connector_meta`` once per iteration (executor thread, rank 0 / each
        attention-DP rank); also callable when the engine is idle to push out the events of the
        last iteration. Drains the engine's event buffer without waiting; no I/O here.
        """
        if self.event_sink is not None:
            if self.event_source is None and self._attach_attempts < self._MAX_ATTACH_ATTEMPTS:
                self._attach_event_source()
            if self.event_source is not None:
                self.event_source.poll()
                self._self_check()
            self.event_sink.flush()
        flush = getattr(self._tier_events, "flush", None)
        if flush is not None:
            flush()

    def _sync_gpu_events(self) -> None:
        """Publish TRT-LLM's events produced since the last call and learn the hashes they
        name, then advertise the held tier blocks whose names are known now. Outside
        TRT-LLM's allocation callback (``get_num_new_matched_tokens`` runs inside it and
        never drains)."""
        if self.event_source is not None or self._stream_names is not None:
            if self._stream_names is not None:  # attention DP, rank > 0
                self._stream_names.poll()
            else:
                self.event_source.poll()
                self.event_sink.flush()
            self._naming.refresh(self._reqs.values())
        batches = self._native_feed.drain()
        if batches:  # TRT-LLM's own stream, as the consolidator received it
            for rank, events in batches:
                self._naming.names.observe(rank, events)
            self._naming.refresh(self._reqs.values())
        if self._held:
            self._release_held()
        self._shared_sync()  # connector.shared_book: the shared tier's queued STOREs/REMOVEs
