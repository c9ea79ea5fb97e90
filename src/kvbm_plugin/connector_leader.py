"""KvbmConnectorLeader: TensorRT-LLM's connector scheduler; decides what moves where.

Runs on rank 0 only (TRT-LLM builds the scheduler there), or under attention DP on every rank
(its own requests, tiers, consolidator and worker), on the executor thread, except the
constructor (a thread-pool thread, concurrently with the worker's). Per iteration TRT-LLM calls:

* ``get_num_new_matched_tokens(request, n)``: once per new request, during allocation; result
  broadcast to every rank. Host/disk hits beyond ``n``, then shared-tier hits
  (leader/shared_tier.py); pins them.
* ``update_state_after_alloc(request, block_ids)``: rank 0 only; binds the hits to device blocks.
* ``build_connector_meta(scheduler_output)``: once per iteration; the returned
  :class:`~kvbm_plugin.connector.meta.ConnectorMetadata` is pickled to every rank. Also flushes
  the GPU-tier event sink (one batch per iteration) and applies workers' completion reports.
* ``request_finished(request, block_ids)``: once per terminated request (finished or aborted).

The leader owns the requests, the ops in flight and the metadata, and collaborators that own
their own state and get what they read from the leader in their constructor or as arguments:
:class:`~kvbm_plugin.leader.offload_tiers.OffloadTiers` (the host/disk tier indexes,
evictions, demotions, the names tier events use),
:class:`~kvbm_plugin.leader.offload_planner.OffloadPlanner` (which blocks to offload),
:class:`~kvbm_plugin.leader.gpu_tier_events.GpuTierEvents` (where GPU-tier events come
from, publishing them), :class:`~kvbm_plugin.leader.shared_tier.LeaderSharedTier`
(shared-tier match and write-through) and
:class:`~kvbm_plugin.leader.layer_groups.LayerGroupPages` (several KV layer groups). Tier
indexes live on the leader only; workers learn slots from the metadata. A tier STORE is
registered only after every rank reported the op that wrote the bytes (see connector/meta.py:
the get_finished intersection rule, applied per op); a REMOVE is registered when the leader
evicts a block, before the metadata that reuses its slot exists.
Never imports torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import replace
from itertools import chain
from operator import attrgetter
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector.meta import (
    ConnectorMetadata,
    LoadOp,
    SaveOp,
    SaveOpRun,
    TierLayout,
    ZmqReportReceiver,
    close_hub,
    make_meta,
    open_hub,
)
from kvbm_plugin.connector.metrics import get_metrics
from kvbm_plugin.connector.trtllm_compat import (
    KvCacheConnectorScheduler,
    has_layer_group_api,
)
from kvbm_plugin.consolidator.engine_forms import EngineForms
from kvbm_plugin.consolidator_config import (
    load_consolidator_config,
    load_events_source,
    load_metrics_settings,
    load_tier_settings,
    should_enable_consolidator,
)
from kvbm_plugin.events import trtllm_publisher
from kvbm_plugin.leader.dynamo_streaming import take_yaml_endpoint
from kvbm_plugin.leader.event_path import TierEventPublisher as TierEventPublisher  # re-exported
from kvbm_plugin.leader.event_path import assemble_event_path
from kvbm_plugin.leader.gpu_tier_events import GpuTierEvents
from kvbm_plugin.leader.keeper import LeaderKeeper, locked
from kvbm_plugin.leader.layer_groups import LayerGroupPages, forget_group_windows
from kvbm_plugin.leader.layer_groups import refuse_unsupported as _refuse_layer_groups
from kvbm_plugin.leader.lifetime import request_gone, request_handle
from kvbm_plugin.leader.load_binding import bind_loads, unbind_all, unbind_range
from kvbm_plugin.leader.offload_planner import OffloadPlanner
from kvbm_plugin.leader.offload_tiers import OffloadTiers
from kvbm_plugin.leader.op_completions import SWEEP_PERIOD_S, OpCompletions
from kvbm_plugin.leader.requests import LEADER_STATS, OpTable
from kvbm_plugin.leader.requests import RequestState as _Request
from kvbm_plugin.leader.shared_tier import MATCHED_STAT, TIER_SHARED, LeaderSharedTier
from kvbm_plugin.naming.names import BlockNaming, StreamNames
from kvbm_plugin.tiers.base import (
    block_keys,
)
from kvbm_plugin.tiers.disk import claim_directory
from kvbm_plugin.wire.identity import remember_salt_text, request_scopes, salt_of

logger = logging.getLogger(__name__)
_request_id = attrgetter("request_id")  # a RequestData's id, read in C


class KvbmConnectorLeader(KvCacheConnectorScheduler):  # type: ignore[misc,valid-type]
    """Scheduler-side connector; runs on rank 0 (TP) and owns the tier index and events."""

    # Attention DP: each rank's leader is local to it (connectors/kv_cache_connector.py @
    # 035ab91cad04, validate_attention_dp: no broadcast, no allgather in get_finished).
    supports_attention_dp = True

    def __init__(self, llm_args: Any) -> None:
        """Called once on rank 0, on a thread-pool thread concurrently with the worker's
        constructor; waits on nothing. Reads the DYN_KVBM_* settings (ConfigError names a bad
        variable), opens the completion hub, and has
        :func:`~kvbm_plugin.leader.event_path.assemble_event_path` build this rank's GPU-tier
        publisher and event sink and, when enabled, the in-process consolidator that receives
        every tier change."""
        super().__init__(llm_args)
        self._env = _llm_args.env_of(llm_args)
        # Several attention windows: per-group hooks (leader/layer_groups.py) or refused.
        _refuse_layer_groups(llm_args, self._env, has_layer_group_api())
        self._par = par = _llm_args.parallel_of(llm_args)
        self._block_size = _llm_args.block_size_of(llm_args)
        self._group = _llm_args.group_of(llm_args, self._env)
        self._tier_settings = load_tier_settings(self._env)
        self._dp_rank = par.dp_rank
        self._disk_claim: Any = None  # this engine's claim on DYN_KVBM_DISK_CACHE_DIR
        self._reqs: dict[int, _Request] = {}
        self._ops = OpTable()
        self._iteration = 0
        self._pending_loads: list[LoadOp] = []
        self._fences: list[int] = []  # terminated requests with loads in flight (next metadata)
        self._closed = False
        self._receiver: ZmqReportReceiver | None = None
        self.consolidator: Any = None
        self._tier_events: Any = None
        self._name_reader: Any = None  # reads TRT-LLM's own stream for names (no consolidator)
        self._stats = dict.fromkeys(LEADER_STATS, 0)
        self._naming = BlockNaming(self._block_size, self._stats)
        self._layer_pages = LayerGroupPages(self._group, self._block_size,
                                            _llm_args.configured_windows(llm_args), self._stats)
        self._log = RateLimitedLog(logger)
        # Every hook and the keeper's applies and idle ticks run under this lock
        # (leader.keeper).
        self._lock = threading.RLock()
        self._last_call = time.monotonic()
        self._keeper: LeaderKeeper | None = None
        # The handles of request objects that died (leader/lifetime.py), in death order.
        self._deaths: deque[Any] = deque()

        events_source = load_events_source(self._env)
        # TRT-LLM's own streaming publisher: no second GPU-tier stream; its own is consolidated.
        # DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT: output at the YAML's endpoint (Dynamo)
        trtllm_pub, self._env, moved = take_yaml_endpoint(
            llm_args, self._env, par.attention_dp, par.dp_size)
        self._naming.salt_blind = trtllm_pub is not None  # its stream carries no salt
        self._engine_forms = EngineForms()  # each upstream form's fields, made the core's
        # ...so V2 radix keys are computed, and scoped blocks' scopes handed to the consolidator
        self._naming.v2_stream = trtllm_pub is not None
        self._naming.scope_sink = self._engine_forms.scopes
        host_name = _llm_args.leader_host(self._env)
        config = load_consolidator_config(
            self._env, num_ranks=par.dp_size, attention_dp=par.attention_dp,
            gpu_streams=trtllm_publisher.trtllm_streams(trtllm_pub, self._dp_rank, host_name))
        self._gpu = GpuTierEvents(
            mode=events_source, trtllm_pub=trtllm_pub, config=config, par=par, host_name=host_name,
            block_size=self._block_size, naming=self._naming, stats=self._stats,
            fallback_serializer=_llm_args.event_serializer_of(llm_args), log=self._log)
        self._stream_names = StreamNames.for_rank(
            par, config, self._naming.names, "off" if trtllm_pub is not None else events_source)
        consolidate = config.enabled and should_enable_consolidator(llm_args, self._env)

        self._hub = open_hub(self._group)
        try:
            if self._tier_settings.disk_enabled and self._tier_settings.disk_cache_dir:
                # One engine per directory: another one's slot files would be overwritten.
                self._disk_claim = claim_directory(self._tier_settings.disk_cache_dir,
                                                   self._dp_rank)
            parts = assemble_event_path(
                config, consolidate=consolidate, dp_rank=self._dp_rank,
                block_size=self._block_size,
                tier_events=getattr(llm_args, "kvbm_plugin_tier_events", None),
                own_gpu_stream=trtllm_pub is None,
                engine_observer=self._gpu.trtllm_names.observe if trtllm_pub else None,
                engine_topic=trtllm_pub.topic if trtllm_pub else "",
                dp_size=par.dp_size,
                engine_forms=self._engine_forms if trtllm_pub else None)
            self._name_reader = parts.name_reader
            # on_flush (BlockNames.observe) is attached at the first request without
            # RequestData.block_hashes: where TRT-LLM hands the hashes over it is never needed,
            # and it costs the executor thread more than publishing (the sink decodes each
            # batch for it and it keys every stored block by its tokens).
            self.consolidator = parts.consolidator
            self._tier_events = parts.tier_events
            self._gpu.connect(parts.event_sink, parts.tier_events, self._stream_names)
            self._tiers = OffloadTiers(
                self._tier_settings, group=self._group, tp_size=par.tp_size,
                attention_dp=par.attention_dp, dp_rank=self._dp_rank,
                block_size=self._block_size, stats=self._stats, tier_events=self._tier_events,
                naming=self._naming, ops=self._ops, log=self._log)
            # The shared tier's client and directory (leader/shared_tier.py).
            self._shared = LeaderSharedTier(
                self._env, host_enabled=self._tier_settings.host_enabled, group=self._group,
                tp_size=par.tp_size, dp_rank=self._dp_rank, block_size=self._block_size,
                stats=self._stats, tier_events=self._tier_events, tiers=self._tiers,
                ops=self._ops, lock=self._lock,
                thread_safe_events=self._tier_events is not None
                and self._tier_events is self.consolidator)
            if self._shared.settings is not None:  # only a write-through waits for a name
                self._tiers.on_announced = self._shared.host_copy_announced
            self._completions = OpCompletions(
                hub=self._hub, ops=self._ops, reqs=self._reqs, tiers=self._tiers,
                shared=self._shared, index_of=self._index_of, forget=self._forget,
                stats=self._stats, log=self._log, tp_size=par.tp_size)
            self._offload = OffloadPlanner(
                block_size=self._block_size, tiers=self._tiers, shared=self._shared,
                pages=self._layer_pages, naming=self._naming, ops=self._ops, stats=self._stats,
                on_learning=self._gpu.learn_from_flushes)
            trtllm_publisher.log_gpu_source(logger, trtllm_pub, self._gpu.source_line(),
                                            consolidate)
            if moved:
                logger.info(moved)
            self._register_metrics()
            if par.tp_size > 1 and not _llm_args.in_process(llm_args):
                # Bound where the workers connect (DYN_KVBM_LEADER_ZMQ_HOST), not on every
                # interface: anyone who reaches the port can feed the leader reports.
                self._receiver = ZmqReportReceiver(
                    self._hub, f"tcp://{_llm_args.leader_host(self._env)}:"
                    f"{_llm_args.report_port(self._env, par)}")
        except BaseException:
            self.shutdown()
            raise
        self._keeper = LeaderKeeper(self._idle_tick, self._keeper_apply, self._lock,
                                    lambda: self._last_call, self.IDLE_PERIOD_S,
                                    f"kvbm-leader-keeper-r{self._dp_rank}",
                                    self._completions.sweep, SWEEP_PERIOD_S)
        self._hub.on_put = self._keeper.nudge  # reports are applied as they come in
        self._shared.on_agent_events = self._keeper.nudge  # as are the shared tier's changes

    @property
    def event_sink(self) -> Any:
        """This rank's GPU-tier event sink (None where this rank publishes no GPU stream)."""
        return self._gpu.sink

    @property
    def event_source(self) -> Any:
        """Where the GPU-tier events are read from (attached on the first iterations)."""
        return self._gpu.source

    @property
    def event_source_status(self) -> str:
        """Where GPU-tier events come from now, in words (logged at attach time)."""
        return self._gpu.status

    @property
    def shared_enabled(self) -> bool:
        """Whether the shared tier's agent runs (the leader offers and writes shared blocks)."""
        return self._shared.enabled

    # While TRT-LLM's loop blocks, reports and events are published within ~2x this (s).
    IDLE_PERIOD_S = 0.1

    def _idle_tick(self) -> None:
        """The idle keeper's work (its thread, under the lock): apply completed reports,
        withdraw the demotions made ahead that no metadata took, publish the GPU-tier events
        TRT-LLM produced (drain mode drains them, tap publishes what its readers took) and the
        tier changes; advertise held blocks named meanwhile."""
        self._reap_dead()  # before its saves' reports count
        self._apply_reports()
        if self._tiers.pending_demotes:  # made ahead after the last metadata: none comes
            self._tiers.withdraw_demotes()
        self._tiers.evict_ahead()
        self._sync_events(now=True)
        flush = getattr(self._tier_events, "flush", None)
        if flush is not None:
            flush()

    def _keeper_apply(self) -> bool:
        """The keeper's apply (its thread, under the lock, once reports were handed in): the
        requests TensorRT-LLM dropped are reaped first (their saves never committed: the
        device blocks may have been reused), then the reports applied as a hook applies them;
        then the shared tier's queued residency changes registered (where its target is not
        thread-safe: ``LeaderSharedTier.take_agent_events``), a full tier's next victims
        evicted (``OffloadTiers.evict_ahead``) and a full host tier's next victims demoted to
        disk ahead of need (``OffloadTiers.demote_ahead``). True when it applied reports.
        Not while names are learned from TensorRT-LLM's events: there the reports wait for
        ``build_connector_meta`` (or ``request_finished``), which reads those events first."""
        if self._closed or self._naming.learning:
            return False
        applied = not self._completions.idle()
        if applied:
            self._reap_dead()
            self._completions.apply()
        # (the shared tier's residency changes and a full tier's evictions: here rather than
        # in a hook on the executor thread)
        self._shared.take_agent_events()
        self._tiers.evict_ahead()
        self._tiers.demote_ahead()  # (what no metadata takes is withdrawn when idle)
        return applied

    def _register_metrics(self) -> None:
        """Expose the leader's, the sink's (with its publisher's) and the consolidator's
        counters, read at scrape time; start the endpoint when DYN_KVBM_METRICS is on."""
        metrics = get_metrics()
        rank = str(self._dp_rank)
        metrics.register_stats("leader", self.stats, dp_rank=rank)
        if self._gpu.sink is not None:
            metrics.register_stats("event_sink", self._gpu.sink.stats, dp_rank=rank)
        if self.consolidator is not None:
            metrics.register_stats("consolidator", self.consolidator.stats, dp_rank=rank)
        settings = load_metrics_settings(self._env)  # attention DP: + dp rank (one per process)
        metrics.serve(replace(settings, port=settings.port + self._dp_rank))

    # ------------------------------------------------------------------ TRT-LLM hooks

    @locked
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Called once per new context request on rank 0 during allocation (result broadcast).

        Returns ``(n, True)``: ``n`` tokens of consecutive full blocks after
        ``num_computed_tokens`` found in host/disk, loaded asynchronously (the request waits out
        of the batch until every rank's ``get_finished`` returns it). ``(0, False)`` when
        nothing matches or ``num_computed_tokens`` is not block-aligned. At least one prompt
        token is always left to compute. Matched blocks are pinned until loaded.
        """
        if not self._naming.learning and not self._completions.idle():
            # Where TRT-LLM's hashes are learned from its events, reports wait for the next
            # build_connector_meta, whose first step reads those events (this call runs inside
            # TRT-LLM's allocation and must not drain them).
            self._completions.apply()
        self._stats["match_calls"] += 1
        req_id = int(request.request_id)
        old = self._reqs.get(req_id)
        if old is not None:
            self._release_plan(old)
        # The C++ request carries the salt as cache_salt_id only; newer Python requests also
        # as cache_salt. Either way it scopes every key, as it scopes TRT-LLM's own.
        salt, scope = request_scopes(request)
        state = _Request(req_id, salt=salt, scope=scope,
                         name_inputs=self._naming.inputs_of(request, req_id),
                         handle=request_handle(request, req_id, self._deaths),
                         lora_root_pending=True)
        self._reqs[req_id] = state
        if getattr(request, "is_generation_only_request", False):
            # Its KV comes from a context server: nothing to load. Its state is kept all the
            # same: its blocks are offloaded later under its scope (adapter, multimodal
            # items), which only this object carries (RequestData names neither).
            return 0, False
        # A new list each call (the binding converts the C++ vector; TensorRT-LLM's
        # bindings.cpp, stored id 3184944): read, never kept or changed here.
        tokens = request.get_tokens(0)
        if type(tokens) is not list:
            tokens = list(tokens)
        bs = self._block_size
        if num_computed_tokens < 0 or num_computed_tokens % bs:
            return 0, False
        layout = self._tiers.layout or self._ensure_tiers()
        if not (layout.host_blocks or layout.disk_blocks):
            return 0, False
        tiers = self._tiers
        first = num_computed_tokens // bs
        last = (len(tokens) - 1) // bs  # full blocks that still leave one token to compute
        # (the prompt's full blocks but one when it fills its last block: only then a copy)
        # The prompt's blocks' digests and keys (the digests' first 8 bytes): hashed once, here;
        # build_connector_meta extends them, the shared tier names the blocks by the digests.
        state.digests = digests = []
        keys = block_keys(tokens if len(tokens) // bs == last else tokens[:last * bs], bs,
                          salt, digests=digests)
        state.keys = keys
        state.plan = tiers.match(keys, first, last)  # pinned until loaded
        self._shared.match(state, first + len(state.plan), last)
        n = len(state.plan) * bs
        if n == 0:
            return 0, False
        state.match_base = num_computed_tokens + n
        for _, tier, _ in state.plan:
            self._stats[MATCHED_STAT[tier]] += bs
        return n, True

    @locked
    def cancel_load(self, request: Any, start: int, end: int) -> None:
        """Called on rank 0 by TensorRT-LLM's KVCacheManagerV2 (current main) when the runtime
        will not consume tokens ``[start, end)`` of an offer: a tail it could not reserve
        pages for, or a head the device cache overtook while the request waited.

        Every matched block overlapping the range leaves the plan: its pin is released (so
        the tier may evict it again) and no load is issued for it. A load already handed to
        the workers in metadata cannot be taken back (it completes; the runtime recomputes
        those tokens), which is counted as ``cancels_too_late``. Executor thread, no I/O.
        """
        state = self._reqs.get(int(request.request_id))
        if state is None or end <= start:
            return
        unbind_range(state, start, end, self._block_size, self._ops, self._pending_loads,
                     self._unpin, self._par.tp_size, self._stats)

    @locked
    def commit_new_matched_tokens(self, request: Any, num_tokens: int,
                                  load_kv_async: bool) -> None:
        """The runtime's side of an offer (current main splits the query from this commit):
        honouring fewer tokens than offered cancels the unconsumed tail. Harmless where TRT-LLM
        never calls it on the scheduler (it then calls :meth:`cancel_load`)."""
        state = self._reqs.get(int(request.request_id))
        if state is None or not state.plan or state.match_base is None:
            return
        offered_end = state.match_base
        first = state.plan[0][0] * self._block_size
        if first + num_tokens < offered_end:
            self.cancel_load(request, first + max(0, int(num_tokens)), offered_end)

    @locked
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Called on rank 0 right after allocation with the request's device block ids. Binds
        each matched tier block to its device block; the load goes into the next metadata."""
        state = self._reqs.get(int(request.request_id))
        if state is None or not state.plan:
            return
        state.load = bind_loads(state, block_ids, self._ops, self._unpin,
                                self._layer_pages.load_pages)
        self._pending_loads.append(state.load)

    @locked
    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Called once per iteration on rank 0 after allocation. Applies completion reports,
        flushes the iteration's GPU-tier events, and returns the loads bound since the last call
        plus offloads (device block → tier slot) for every block that became full this
        iteration and is in no tier yet. Walks ``new_requests`` and ``cached_requests``."""
        self._reap_terminated(scheduled=frozenset(map(_request_id, chain(
            scheduler_output.new_requests, scheduler_output.cached_requests))))
        # (reaped before the reports: a terminated request's saves are never committed)
        self._sync_events()
        if not self._completions.idle():
            self._completions.apply()
        layout = self._tiers.layout or self._ensure_tiers()
        self._iteration += 1
        saves: list[SaveOp | SaveOpRun] = []
        first_tier = self._tiers.host if self._tiers.host is not None else self._tiers.disk
        for rd in scheduler_output.new_requests:  # before any of its blocks is stored
            remember_salt_text(rd)  # the salt as clients send it (wire.router_forms)
        for rd in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
            state = self._reqs.get(rd.request_id)
            if state is None:
                salt, scope = request_scopes(rd)
                state = self._reqs[rd.request_id] = _Request(
                    rd.request_id, salt=salt, scope=scope,
                    name_inputs=self._naming.inputs_of(rd, rd.request_id))
            elif state.salt is None and not state.reported:
                self._adopt_scope(state, rd)
            self._offload.absorb(state, rd, self._gpu.sink)
            if first_tier is not None and not state.finished:
                self._offload.schedule(state, first_tier, saves)
        self._gpu.flush(self._reqs.values())  # wakes the event pump: it drains, publishes
        # (the take_ calls only where something waits: most iterations have nothing)
        meta = make_meta(self._iteration, layout, tuple(self._pending_loads),
                         self._tiers.take_demotes() if self._tiers.pending_demotes else (),
                         tuple(saves), tuple(self._fences),
                         self._shared.take_saves() if self._shared.pending_saves else ())
        self._fences = []
        self._pending_loads = []
        return meta

    @locked
    def flush_events(self) -> None:
        """Publish this iteration's GPU-tier batch and hand queued tier events on.

        Callable when the engine is idle to push out the events of the last iteration (the
        demo, tests): drains the engine's event buffer and publishes before it returns
        (``build_connector_meta`` only wakes the event pump, which does the same on its
        thread). No I/O here beyond the publisher's hand-over.
        """
        self._gpu.flush(self._reqs.values(), now=True)

    def _sync_events(self, now: bool = False) -> None:
        """Learn the names TRT-LLM's GPU-tier events gave since the last call
        (:meth:`GpuTierEvents.sync`: drained and published here first where a tier block
        waits for such a name, or ``now``), announce the tier blocks named now, register the
        shared tier's queued residency changes. Outside TRT-LLM's allocation callback."""
        waiting = self._naming.unnamed.waiting  # (the dict itself: no call to ask it)
        self._gpu.sync(self._reqs.values(), now=now,
                       need_names=bool(waiting) or (self._naming.learning
                                                    and self._naming.awaiting_events))
        if waiting:
            self._tiers.announce_named()
        shared = self._shared
        if shared.agent is not None or shared.settings is not None:  # (else nothing to do)
            shared.sync()

    def update_state_after_alloc_by_layer_group(
            self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Called on rank 0 instead of ``update_state_after_alloc`` when the cache has several
        layer groups: entry ``[g][i]`` is block ``i``'s page in group ``g`` (-1: none). The
        loads bind each matched block to every group's page; a -1 page is never written."""
        if len(block_ids_by_layer_group) <= 1:
            self.update_state_after_alloc(
                request, list(block_ids_by_layer_group[0]) if block_ids_by_layer_group else [])
            return
        groups = self._layer_pages.groups_for(len(block_ids_by_layer_group))
        with self._lock:
            state = self._reqs.get(int(request.request_id))
            if state is not None:
                state.alloc_pages = [list(ids) for ids in block_ids_by_layer_group]
        self.update_state_after_alloc(request, list(block_ids_by_layer_group[groups.rep]))

    def request_finished_by_layer_group(
            self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Called on rank 0 instead of ``request_finished`` with several layer groups; the
        same contract (True while offloads read the request's pages)."""
        ids = cache_block_ids_by_layer_group
        rep = self._layer_pages.groups_for(len(ids)).rep if len(ids) > 1 else 0
        return self.request_finished(request, list(ids[rep]) if ids else [])

    @locked
    def publish_now(self) -> None:
        """The idle keeper's tick, at once: apply the completed reports, publish GPU-tier
        events and tier changes. For a caller that would otherwise wait for the keeper (the
        demo's router probe); any thread. Never looks for the KV cache manager."""
        self._idle_tick()

    @locked
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Called once on rank 0 when a request terminates (finished or aborted), result
        broadcast. True while offloads that read its device blocks are not yet reported by
        every rank: TRT-LLM then keeps the blocks until every worker's ``get_finished`` returns
        the id (workers count failed copies as finished)."""
        if self._naming.learning:
            self._sync_events()
        if not self._completions.idle():
            self._completions.apply()
        state = self._reqs.get(int(request.request_id))
        if state is None:
            return False
        if self._naming.v2_stream:  # the last generated blocks' names, before their release
            self._offload.finish(state, list(request.get_tokens(0)))
        state.finished = True
        if state.saves_inflight:
            return True
        self._forget(state)
        return False

    # ------------------------------------------------------------------ internals

    def _adopt_scope(self, state: _Request, rd: Any) -> None:
        """A request matched without a salt whose first report names one (a request object
        that lacked the field): key its blocks under the salt from now on, never unsalted
        (and name them under the salted rule, which the naming then awaits events for)."""
        if salt_of(rd) is None:
            return  # (most requests: no salt on either object; its other fields unread)
        salt, scope = request_scopes(rd)
        if salt is not None:
            state.salt = salt
            state.scope = scope
            state.keys = []  # rehashed under the salt by OffloadPlanner.absorb
            state.v2_keys = {}
            state.digests = []
            state.name_inputs = self._naming.inputs_of(rd, state.req_id)
            state.computed = []

    def _apply_reports(self) -> None:
        """Fold the workers' reports in (:meth:`OpCompletions.apply`), where there are any
        (the hooks ask ``idle`` themselves: one Python frame less each)."""
        if not self._completions.idle():
            self._completions.apply()

    def _reap_terminated(self, scheduled: frozenset[int] = frozenset()) -> None:
        """Forget the requests TRT-LLM terminated without calling ``request_finished`` (a
        cancel, an error: ``py_executor.py`` @ 0004396720054 calls it only for finished
        requests), seen by the request object's own state (``is_finished``) or its death.
        A request in this build's scheduler output (``scheduled``) is alive by definition.
        Once per build (executor thread); O(tracked). The deaths queued so far are covered by
        this pass (dropped: the queue stays bounded where the keeper does not drain it)."""
        self._deaths.clear()
        for state in list(self._reqs.values()):
            if state.finished or state.req_id in scheduled or not request_gone(state.handle):
                continue
            self._terminated(state)

    def _reap_dead(self) -> None:
        """Forget the requests whose object died since (the keeper's applies and idle ticks,
        under the lock: death only, never the object read; O(deaths))."""
        deaths, reqs = self._deaths, self._reqs
        while deaths:
            handle = deaths.popleft()
            state = reqs.get(handle.key)
            if state is not None and state.handle is handle and not state.finished:
                self._terminated(state)

    def _terminated(self, state: _Request) -> None:
        """TensorRT-LLM terminated ``state``'s request without a ``request_finished``: its
        pending loads are dropped or fenced, its saves in flight tainted (never committed:
        their device blocks may be reused), the request forgotten once nothing is in flight."""
        self._stats["requests_terminated_silently"] += 1
        state.finished = True
        state.handle = None
        if state.load is not None and state.load in self._pending_loads:
            unbind_all(state, self._ops, self._pending_loads, self._unpin)
        elif state.loads_inflight:
            self._fences.append(state.req_id)  # its blocks may be reused now
        for op_id in state.saves_inflight:
            op = self._ops.get(op_id)
            if op is not None:
                op.tainted = True
        if not state.saves_inflight and not state.loads_inflight:
            self._forget(state)
        else:
            self._release_plan(state)

    def _ensure_tiers(self) -> TierLayout:
        """The tiers' layout; sizes them on first use and then starts the shared tier's agent
        (rank 0's worker registered its pool and key layout by then)."""
        layout = self._tiers.layout
        if layout is None:
            layout = self._tiers.ensure()
            self._shared.start()
        return layout

    def _index_of(self, tier: str) -> Any:
        """The index holding a plan's ``tier`` blocks (their pins)."""
        if tier == TIER_SHARED:
            return self._shared.pins
        return self._tiers.index_of(tier)

    def _unpin(self, tier: str, entry: Any) -> None:
        """Release a plan's pin of ``entry`` (``tier``'s) where it still holds one."""
        index = self._index_of(tier)
        if index is not None and entry.pins > 0:
            index.unpin(entry)

    def _release_plan(self, state: _Request) -> None:
        """Unpin the request's matched blocks whose load was never bound."""
        if state.load is None:
            for _, tier, entry in state.plan:
                self._unpin(tier, entry)
        state.plan = []

    def _forget(self, state: _Request) -> None:
        self._release_plan(state)
        if not state.loads_inflight:
            self._reqs.pop(state.req_id, None)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        out["ops_inflight"] = len(self._ops)
        out["requests_tracked"] = len(self._reqs)
        tiers = self._tiers
        out["tier_stores_waiting_for_name"] = len(tiers.waiting_for_name)
        keeper = self._keeper
        out["idle_ticks"] = keeper.ticks if keeper is not None else 0
        # Reports applied by the keeper, off the executor thread; nudges that found a hook
        # running (it applied them itself).
        out["keeper_applies"] = keeper.applies if keeper is not None else 0
        out["keeper_busy"] = keeper.busy if keeper is not None else 0
        out["host_used"] = len(tiers.host) if tiers.host is not None else 0
        out["disk_used"] = len(tiers.disk) if tiers.disk is not None else 0
        out["reports_malformed"] = self._receiver.malformed if self._receiver is not None else 0
        out["tier_batches_lost"] = getattr(self._tier_events, "lost_batches", 0)
        out["trtllm_batches_unread"] = self._gpu.trtllm_names.dropped
        out.update(self._gpu.stats())
        out.update(self._engine_forms.stats())
        out.update(self._shared.stats())
        return out

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the report receiver, the sink (its publisher) and the consolidator; remove an
        owned temporary disk directory. Bounded by ``timeout`` per component; idempotent."""
        if self._closed:
            return
        self._closed = True
        hub = getattr(self, "_hub", None)  # None: the constructor failed before opening it
        if hub is not None:
            hub.on_put = None
        if self._keeper is not None:
            self._keeper.stop(timeout)
        metrics = get_metrics()
        for component in ("leader", "event_sink", "consolidator"):
            metrics.unregister_stats(component, dp_rank=str(self._dp_rank))
        if self._receiver is not None:
            self._receiver.close(timeout)
        if self._name_reader is not None:
            self._name_reader.stop(timeout)
        shared: LeaderSharedTier | None = getattr(self, "_shared", None)  # None: constructor failed
        if shared is not None:
            shared.close(timeout)
        self._gpu.close(timeout)  # the pump's thread: the last step runs here
        source, sink = self._gpu.source, self._gpu.sink
        if source is not None:
            source.poll()  # the last iteration's events
            source.detach()
        if sink is not None:
            flush = getattr(self._tier_events, "flush", None)
            if flush is not None:
                flush()
            sink.flush()
        elif self._tier_events is not None and hasattr(self._tier_events, "flush"):
            self._tier_events.flush()
        if self.consolidator is not None:
            self.consolidator.shutdown(timeout)
        if sink is not None:
            sink.shutdown(timeout)
        close_hub(self._group)
        forget_group_windows(self._group)
        if self._stream_names is not None:
            self._stream_names.close()
        if self._disk_claim is not None:
            self._disk_claim.release()
        tiers: OffloadTiers | None = getattr(self, "_tiers", None)
        if tiers is not None:
            tiers.close()

    # ------------------------------------------------------------------ tests and the demo

    @locked
    def resident_hashes(self, tier: str) -> set[int]:
        """Event hashes resident (advertised) in ``tier`` ("host"/"disk"): under the leader's
        lock, so that a batch of reports the idle keeper applies meanwhile is seen whole
        (its blocks are committed first and announced together after)."""
        return self._tiers.resident_hashes(tier)

    @locked
    def resident_shared_hashes(self) -> set[int]:
        """Event hashes the shared-tier directory holds resident (advertised as EXTERNAL)."""
        return self._shared.resident_hashes()
