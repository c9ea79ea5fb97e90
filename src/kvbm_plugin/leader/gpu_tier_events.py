"""The leader's GPU-tier events: attaching to TensorRT-LLM's KV cache manager, draining (or
tapping) its events into the sink, publishing them, and learning the names they give blocks.

:class:`GpuTierEvents` is owned by :class:`~kvbm_plugin.connector_leader.KvbmConnectorLeader`;
every method runs under the leader's lock, on the executor thread (rank 0, or each attention-DP
rank) or the leader's idle keeper thread; the request states it reads are passed in. The drain
and the publishing run on the event pump's thread (``leader.event_pump``), which the executor
thread only wakes, unless a tier block waits for a name only this iteration's events give. No
I/O; never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector.trtllm_compat import (
    find_kv_cache_manager,
    kv_cache_manager_v2_backend,
    kv_event_serializer,
)
from kvbm_plugin.consolidator_config import EVENTS_SOURCE
from kvbm_plugin.events import trtllm_publisher
from kvbm_plugin.leader.event_pump import EventPump
from kvbm_plugin.leader.requests import RequestState
from kvbm_plugin.naming.names import BlockNaming

logger = logging.getLogger("kvbm_plugin.connector_leader")


class GpuTierEvents:
    """Where this rank's GPU-tier events come from and how they reach the sink (see the module
    docstring). ``sink`` is None until :meth:`connect` (and stays None where this rank
    publishes no GPU-tier stream); ``source`` is None until attached."""

    # Iterations to look for the engine's KV cache manager before giving up (it is there from
    # the first iteration in every TRT-LLM version; the margin covers unusual call stacks).
    MAX_ATTACH_ATTEMPTS = 8
    # The self-check: iterations in which the leader knows the pool holds computed blocks
    # (a tracked request with a full block of computed prompt KV) with no GPU-tier event from
    # the source yet; after this many, the source is reported silent (warned, counted).
    SELF_CHECK_ITERATIONS: int = 32

    def __init__(self, *, mode: str, trtllm_pub: Any, config: Any, par: Any, host_name: str,
                 block_size: int, naming: BlockNaming, stats: dict[str, int],
                 fallback_serializer: Any, log: RateLimitedLog) -> None:
        """``mode``: DYN_KVBM_EVENTS_SOURCE; ``trtllm_pub``: TensorRT-LLM's own streaming publisher
        (events.trtllm_publisher) or None; ``config``: the consolidator config."""
        self._mode = mode
        self._trtllm_pub = trtllm_pub
        self._config = config
        self._attention_dp = par.attention_dp
        self._dp_rank = par.dp_rank
        self._host_name = host_name
        self._block_size = block_size
        self._naming = naming
        self._stats = stats
        self._fallback_serializer = fallback_serializer
        self._log = log
        self.sink: Any = None
        self.source: Any = None
        self._tier_events: Any = None
        self._stream_names: Any = None
        self.trtllm_names = trtllm_publisher.TrtllmNameFeed()  # its stored blocks: the tiers' names
        # The same for this rank's own sink (its on_flush, on whichever thread flushed), for
        # the name table the executor thread owns; and the thread that drains and publishes.
        self.observed = trtllm_publisher.TrtllmNameFeed()
        self.pump: EventPump | None = None
        self._flush_here = False  # KVCacheManagerV2's hooks: flushed on the executor thread
        self._problem = "not attached yet"
        self.attach_attempts = 0
        self._self_check_iterations = 0
        if par.attention_dp and par.dp_rank:  # no sink, never read: see assemble_event_path
            self._problem = _llm_args.GATHERED_TO_RANK_0.format(par.dp_rank)
        if trtllm_pub is not None or mode == "off":
            self.attach_attempts = self.MAX_ATTACH_ATTEMPTS  # never look for the manager

    def connect(self, sink: Any, tier_events: Any, stream_names: Any) -> None:
        """The assembled event path (leader constructor): this rank's sink (or None), the tier
        events' receiver, and the names read off rank 0's stream (attention DP, rank > 0)."""
        self.sink = sink
        self._tier_events = tier_events
        self._stream_names = stream_names
        if sink is not None and self.pump is None:
            self.pump = EventPump(self._poll_source, lambda: sink.flush(),
                                  f"kvbm-event-pump-r{self._dp_rank}")

    def _poll_source(self) -> int:
        """The pump's drain (its thread, or an inline step): the source once attached."""
        source = self.source
        return source.poll() if source is not None else 0

    def learn_from_flushes(self) -> None:
        """From now on every flushed batch is kept for the name table (:meth:`sync` learns
        from it): the first request without ``RequestData.block_hashes``."""
        if self.sink is not None:
            self.sink.on_flush = self.observed.observe

    def _attach(self) -> None:
        """Find the engine's KV cache manager through the calling PyExecutor's frames and tee
        its KV events into the sink (see ``events.source.attach_event_source``). Executor
        thread, first iterations only; frame inspection, no I/O."""
        self.attach_attempts += 1
        manager = find_kv_cache_manager()
        if manager is None:
            if self.attach_attempts == 1:
                # Said at the first iteration, once: the executor that calls us holds no KV
                # cache manager we can find (e.g. TRT-LLM's coroutine executor); later
                # iterations keep looking quietly, and say so if one turns up.
                logger.warning(
                    "kvbm_plugin: no KV cache manager with events found in the executor's call "
                    "stack (an executor without self.kv_cache_manager, e.g. PyExecutorCoro?); "
                    "GPU-tier events are not published from this process until one is found "
                    "(set %s=off and run `kvbm-plugin sidecar` against trtllm-serve, or push "
                    "them with event_sink.ingest)", EVENTS_SOURCE)
            self._problem = "no KV cache manager found"
            return
        from kvbm_plugin.events.source import attach_event_source

        try:
            self.source = attach_event_source(
                manager, self.sink,
                serialize=kv_event_serializer() or self._fallback_serializer,
                mode=self._mode, v2_backend=kv_cache_manager_v2_backend())
        except ValueError as exc:
            self.attach_attempts = self.MAX_ATTACH_ATTEMPTS
            self._problem = f"unavailable: {exc}"
            logger.warning("kvbm_plugin: GPU-tier events unavailable: %s", exc)
            return
        if self.source.kind == "v2-hooks" and self.pump is not None:
            # The V2 hooks fill the sink's batches on the executor thread without its lock
            # (events/v2_hooks.py: ~1 us per block), so the batches are flushed on that thread
            # too: the pump's thread stops (after a step in progress: a one-time wait, here at
            # the first iterations) and flush() steps inline from now on.
            self.pump.stop()
            self._flush_here = True
        # Not "attached": V2 hooks are confirmed only once an event arrives (the self-check).
        logger.info("kvbm_plugin: GPU-tier event source found: %s", self.status)
        if self._attention_dp and self.source.kind == "v2-hooks":
            logger.warning(_llm_args.V2_UNDER_ATTENTION_DP)

    @property
    def status(self) -> str:
        """Where GPU-tier events come from now, in words (logged at attach time)."""
        if self.source is not None:
            if (self._stats.get("gpu_source_silent_iterations")
                    and not self.source.events_seen):
                return self._silent_line()
            return self.source.describe()
        if self._trtllm_pub is not None or self._mode == "off":
            return self.source_line()
        return self._problem

    def _self_check(self, requests: Iterable[RequestState]) -> None:
        """Never report a source as working while nothing arrives (issue 26, item 2): a V2
        event manager whose hooks TensorRT-LLM's C++ radix tree calls natively leaves the
        wrapped Python hooks uncalled, and not every such backend can be told from Python
        (``events.source.cpp_sink``). Per iteration (executor thread, under the
        lock), until the first event: count the iterations in which a tracked request holds a
        full block of computed prompt KV; past :attr:`SELF_CHECK_ITERATIONS` of them with no event,
        count each further one (``gpu_source_silent_iterations``) and warn, rate-limited.
        Costs one pass over the tracked requests per iteration, only until confirmed."""
        source = self.source
        if source.kind != "v2-hooks" or source.events_seen:
            return
        bs = self._block_size
        # Prompt blocks only: KVCacheManagerV2 commits a context request's tokens into its
        # radix tree (a stored event) up to its context position, then stops committing, so
        # generated tokens never make one (``kv_cache_manager_v2.py``'s ``update_resources``,
        # stored id 3501434665: ``kv_cache.commit(...)`` then ``stop_committing()``).
        if not any(min(s.valid_tokens, s.prompt_tokens) >= bs for s in requests):
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

    def source_line(self) -> str:
        """The configured GPU-tier source, in words (start-up log, ``doctor``'s wording)."""
        return trtllm_publisher.gpu_source_line(self._trtllm_pub, self._mode, self._config,
                                                self._dp_rank, self._host_name)

    def flush(self, requests: Iterable[RequestState], *, now: bool = False) -> None:
        """Have this iteration's GPU-tier batch published and hand queued tier events on.

        Called by ``build_connector_meta`` once per iteration (executor thread, rank 0 / each
        attention-DP rank), which only wakes the pump (``now=False``: the drain and the
        publishing run on its thread; KVCacheManagerV2's hooks excepted, whose batches are
        flushed here); with ``now=True`` (``flush_events``, the idle keeper, ``publish_now``)
        the events are drained and published before it returns.
        """
        if self.sink is not None:
            if self.source is None and self.attach_attempts < self.MAX_ATTACH_ATTEMPTS:
                self._attach()
            assert self.pump is not None
            if now or self._flush_here:
                self.pump.step()
            else:
                self.pump.wake()
            if self.source is not None:
                self._self_check(requests)
        flush = getattr(self._tier_events, "flush", None)
        if flush is not None:
            flush()

    def sync(self, requests: Iterable[RequestState], *, need_names: bool,
             now: bool = False) -> None:
        """Learn the names TRT-LLM's events published so far give ``requests`` (the leader
        then announces the tier blocks named now). ``need_names``: a tier block waits for a
        name, or a rule the leader computes names by is not confirmed yet, so this
        iteration's events are drained, published and read here first, as before the pump
        (waiting for a step the pump has in progress: at most one step, the work this thread
        did itself before; only while names are awaited, the first requests of each rule,
        never once they are computed); ``now``: the same for the idle keeper and
        ``publish_now``.
        Outside TRT-LLM's allocation callback (``get_num_new_matched_tokens`` runs inside it
        and never drains)."""
        if self._stream_names is not None:  # attention DP, rank > 0
            self._stream_names.poll()
        elif self.pump is not None and (now or need_names):
            self.pump.step()
        # This rank's sink's batches, and TRT-LLM's own stream as the consolidator received it
        batches = self.observed.drain() + self.trtllm_names.drain()
        for rank, events in batches:
            self._naming.names.observe(rank, events)
        if batches or self.source is not None or self._stream_names is not None:
            self._naming.refresh(requests)

    def stats(self) -> dict[str, int]:
        """The pump's counters (leader stats)."""
        pump = self.pump
        return {"event_pump_steps": pump.steps if pump else 0,
                "event_pump_inline_steps": pump.inline_steps if pump else 0,
                "event_pump_errors": pump.errors if pump else 0,
                "observed_batches_dropped": self.observed.dropped}

    def close(self, timeout: float) -> None:
        """Stop the pump (shutdown; the leader then drains and publishes the last events)."""
        if self.pump is not None:
            self.pump.stop(timeout)
