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
from kvbm_plugin.connector import native_events as _native
from kvbm_plugin.connector.keeper import locked
from kvbm_plugin.connector.trtllm_compat import find_kv_cache_manager, kv_event_serializer
from kvbm_plugin.consolidator_config import EVENTS_SOURCE

logger = logging.getLogger("kvbm_plugin.connector_leader")


class GpuEventFeed:
    """GPU-tier event methods of the leader (see the module docstring)."""

    _MAX_ATTACH_ATTEMPTS: int
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
                mode=self._events_source)
        except ValueError as exc:
            self._attach_attempts = self._MAX_ATTACH_ATTEMPTS
            self._event_source_problem = f"unavailable: {exc}"
            logger.warning("kvbm_plugin: GPU-tier events unavailable: %s", exc)
            return
        logger.info("kvbm_plugin: GPU-tier events attached: %s", self.event_source_status)
        if self._par.attention_dp and self.event_source.kind == "v2-hooks":
            logger.warning(_llm_args.V2_UNDER_ATTENTION_DP)

    @property
    def event_source_status(self) -> str:
        """Where GPU-tier events come from now, in words (logged at attach time)."""
        if self.event_source is not None:
            return self.event_source.describe()
        if self._native is not None or self._events_source == "off":
            return self._source_line()
        return self._event_source_problem

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
