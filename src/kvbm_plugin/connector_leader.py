"""KvbmConnectorLeader: TensorRT-LLM's connector scheduler; decides what moves where.

Runs on rank 0 only (TRT-LLM builds the scheduler there), or under attention DP on every rank
(its own requests, tiers, consolidator and worker), on the executor thread, except the
constructor (a thread-pool thread, concurrently with the worker's). Per iteration TRT-LLM calls:

* ``get_num_new_matched_tokens(request, n)``: once per new request, during allocation; result
  broadcast to every rank. Host/disk hits beyond ``n``, then shared-tier hits
  (connector/shared_book.py); pins them.
* ``update_state_after_alloc(request, block_ids)``: rank 0 only; binds the hits to device blocks.
* ``build_connector_meta(scheduler_output)``: once per iteration; the returned
  :class:`~kvbm_plugin.connector.meta.ConnectorMetadata` is pickled to every rank. Also flushes
  the GPU-tier event sink (one batch per iteration) and applies workers' completion reports.
* ``request_finished(request, block_ids)``: once per terminated request (finished or aborted).

Tier bookkeeping (:class:`~kvbm_plugin.tiers.base.TierIndex`) lives here only; workers learn slots
from the metadata. A tier STORE is registered only after every rank reported the op that wrote
the bytes (see connector/meta.py: the get_finished intersection rule, applied per op); a REMOVE is
registered when the leader evicts a block, before the metadata that reuses its slot exists.
Never imports torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from typing import Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector import native_events as _native
from kvbm_plugin.connector.assembly import TierEventPublisher as TierEventPublisher  # re-exported
from kvbm_plugin.connector.assembly import assemble_event_path
from kvbm_plugin.connector.dynamo_streaming import take_yaml_endpoint
from kvbm_plugin.connector.gpu_feed import GpuEventFeed
from kvbm_plugin.connector.keeper import IdleKeeper, locked
from kvbm_plugin.connector.layer_groups import (
    LayerGroupScheduling,
    configured_windows,
    forget_group_windows,
)
from kvbm_plugin.connector.layer_groups import refuse_unsupported as _refuse_layer_groups
from kvbm_plugin.connector.lifetime import request_gone, request_handle
from kvbm_plugin.connector.meta import (
    DISK,
    ERR_CORRUPT,
    HOST,
    SHARED,
    ConnectorMetadata,
    DemoteOp,
    LoadCopy,
    LoadOp,
    SaveOp,
    TierLayout,
    ZmqReportReceiver,
    close_hub,
    open_hub,
)
from kvbm_plugin.connector.metrics import get_metrics
from kvbm_plugin.connector.requests import Op as _Op
from kvbm_plugin.connector.requests import RequestState as _Request
from kvbm_plugin.connector.shared_book import MATCHED_STAT, TIER_SHARED, SharedBook
from kvbm_plugin.connector.tier_book import TierBookkeeping
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
from kvbm_plugin.naming.names import BlockNaming, StreamNames, name_inputs
from kvbm_plugin.tiers.base import (
    TIER_DISK,
    TIER_HOST,
    TierEntry,
    TierIndex,
    block_keys,
)
from kvbm_plugin.tiers.disk import claim_directory
from kvbm_plugin.wire.identity import lora_of, remember_salt_text, request_scope, salt_of

logger = logging.getLogger(__name__)
_TIER_CODE = {TIER_HOST: HOST, TIER_DISK: DISK, TIER_SHARED: SHARED}


class KvbmConnectorLeader(TierBookkeeping, GpuEventFeed, SharedBook,  # type: ignore[misc]
                          LayerGroupScheduling, KvCacheConnectorScheduler):  # type: ignore[valid-type]
    """Scheduler-side connector; runs on rank 0 (TP) and owns the tier index and events."""

    # Attention DP: each rank's leader is local to it (connectors/kv_cache_connector.py @
    # 035ab91cad04, validate_attention_dp: no broadcast, no allgather in get_finished).
    supports_attention_dp = True

    def __init__(self, llm_args: Any) -> None:
        """Called once on rank 0, on a thread-pool thread concurrently with the worker's
        constructor; waits on nothing. Reads the DYN_KVBM_* settings (ConfigError names a bad
        variable), opens the completion hub, and has
        :func:`~kvbm_plugin.connector.assembly.assemble_event_path` build this rank's GPU-tier
        publisher and event sink and, when enabled, the in-process consolidator that receives
        every tier change."""
        super().__init__(llm_args)
        self._env = _llm_args.env_of(llm_args)
        # Several attention windows: per-group hooks (connector/layer_groups.py) or refused.
        _refuse_layer_groups(llm_args, self._env, has_layer_group_api())
        self._configured_windows = configured_windows(llm_args)
        self._par = _llm_args.parallel_of(llm_args)
        self._block_size = _llm_args.block_size_of(llm_args)
        self._group = _llm_args.group_of(llm_args, self._env)
        self._tier_settings = load_tier_settings(self._env)
        self._dp_rank = self._par.dp_rank
        self._host: TierIndex | None = None
        self._disk: TierIndex | None = None
        self._layout: TierLayout | None = None
        self._disk_dir: str | None = None
        self._own_disk_dir = False
        self._disk_claim: Any = None  # this engine's claim on DYN_KVBM_DISK_CACHE_DIR
        self._reqs: dict[int, _Request] = {}
        self._ops: dict[int, _Op] = {}
        self._next_op = 1
        self._iteration = 0
        self._pending_loads: list[LoadOp] = []
        self._pending_demotes: list[DemoteOp] = []
        self._fences: list[int] = []  # terminated requests with loads in flight (next metadata)
        self._closed = False
        self._receiver: ZmqReportReceiver | None = None
        self.consolidator: Any = None
        self.event_sink: Any = None
        # Where the GPU-tier events come from (attached on the first iterations, see
        # _attach_event_source); None until found.
        self.event_source: Any = None
        self._event_source_problem = "not attached yet"
        self._attach_attempts = 0
        self._tier_events: Any = None
        self._name_reader: Any = None  # reads TRT-LLM's own stream for names (no consolidator)
        self._fallback_serializer = _llm_args.event_serializer_of(llm_args)
        self._stats = dict.fromkeys((
            "matched_host_tokens", "matched_disk_tokens", "match_calls", "saves_scheduled",
            "saves_committed", "saves_failed", "demotes_scheduled", "demotes_committed",
            "demotes_failed", "loads_failed", "corrupt_blocks", "stale_disk_blocks",
            "tier_full_skips", "host_evictions", "disk_evictions", "reports_rejected",
            "cancelled_tokens", "cancels_too_late", "parent_resaves", "orphan_saves_skipped",
            "chain_demotes", "demotes_skipped", "cascade_drops", "orphan_commits_dropped",
            "requests_terminated_silently",
            "saves_discarded_terminated", "gpu_source_silent_iterations", "window_skips"), 0)
        self._self_check_iterations = 0  # connector.gpu_feed._self_check
        self._naming = BlockNaming(self._block_size, self._stats)
        self._init_shared()  # the shared tier's client and directory (connector/shared_book.py)
        self._log = RateLimitedLog(logger)
        # Every hook and the idle keeper's tick run under this lock (connector.keeper).
        self._lock = threading.RLock()
        self._last_call = time.monotonic()
        self._keeper: IdleKeeper | None = None

        par = self._par
        self._events_source = load_events_source(self._env)
        # TRT-LLM's own streaming publisher: no second GPU-tier stream; its own is consolidated.
        # DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT: output at the YAML's endpoint (Dynamo)
        self._native, self._env, moved = take_yaml_endpoint(
            llm_args, self._env, self._par.attention_dp, self._par.dp_size)
        self._naming.salt_blind = self._native is not None  # its stream carries no salt
        self._native_feed = _native.NativeNameFeed()  # its stored blocks: the tiers' names
        self._native_forms = EngineForms()  # each upstream form's fields, made the core's
        # ...so V2 radix keys are computed, and scoped blocks' scopes handed to the consolidator
        self._naming.v2_stream = self._native is not None
        self._naming.scope_sink = self._native_forms.scopes
        self._host_name = _llm_args.leader_host(self._env)
        self._config = config = load_consolidator_config(
            self._env, num_ranks=par.dp_size, attention_dp=par.attention_dp,
            gpu_streams=_native.native_streams(self._native, self._dp_rank, self._host_name))
        if par.attention_dp and par.dp_rank:  # no sink, never read: see assemble_event_path
            self._event_source_problem = _llm_args.GATHERED_TO_RANK_0.format(par.dp_rank)
        self._stream_names = StreamNames.for_rank(
            par, config, self._naming.names,
            "off" if self._native is not None else self._events_source)
        if self._native is not None or self._events_source == "off":
            self._attach_attempts = self._MAX_ATTACH_ATTEMPTS  # never look for the manager
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
                own_gpu_stream=self._native is None,
                engine_observer=self._native_feed.observe if self._native else None,
                engine_topic=self._native.topic if self._native else "",
                dp_size=par.dp_size,
                engine_forms=self._native_forms if self._native else None)
            self._name_reader = parts.name_reader
            self.event_sink = parts.event_sink
            # on_flush (BlockNames.observe) is attached at the first request without
            # RequestData.block_hashes: where TRT-LLM hands the hashes over it is never needed,
            # and it costs the executor thread more than publishing (the sink decodes each
            # batch for it and it keys every stored block by its tokens).
            self.consolidator = parts.consolidator
            self._tier_events = parts.tier_events
            _native.log_gpu_source(logger, self._native, self._source_line(), consolidate)
            if moved:
                logger.info(moved)
            self._register_metrics()
            if self._par.tp_size > 1 and not _llm_args.in_process(llm_args):
                # Bound where the workers connect (DYN_KVBM_LEADER_ZMQ_HOST), not on every
                # interface: anyone who reaches the port can feed the leader reports.
                self._receiver = ZmqReportReceiver(
                    self._hub, f"tcp://{_llm_args.leader_host(self._env)}:"
                    f"{_llm_args.report_port(self._env, par)}")
        except BaseException:
            self.shutdown()
            raise
        self._keeper = IdleKeeper(self._idle_tick, self._lock, lambda: self._last_call,
                                  self.IDLE_PERIOD_S, f"kvbm-leader-keeper-r{self._dp_rank}")

    # While TRT-LLM's loop blocks, reports and events are published within ~2x this (s).
    IDLE_PERIOD_S = 0.1

    def _idle_tick(self) -> None:
        """The idle keeper's work (its thread, under the lock): apply completed reports,
        publish the GPU-tier events TRT-LLM produced (drain mode drains them, tap publishes
        what its readers took) and the tier changes; advertise unnamed tier blocks named since."""
        self._reap_terminated(executor_thread=False)  # before its saves' reports count
        self._apply_reports()
        self._sync_gpu_events()
        flush = getattr(self._tier_events, "flush", None)
        if flush is not None:
            flush()

    def _register_metrics(self) -> None:
        """Expose the leader's, the sink's (with its publisher's) and the consolidator's
        counters, read at scrape time; start the endpoint when DYN_KVBM_METRICS is on."""
        metrics = get_metrics()
        rank = str(self._dp_rank)
        metrics.register_stats("leader", self.stats, dp_rank=rank)
        if self.event_sink is not None:
            metrics.register_stats("event_sink", self.event_sink.stats, dp_rank=rank)
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
        if not self._naming.learning:
            # Where TRT-LLM's hashes are learned from its events, reports wait for the next
            # build_connector_meta, whose first step reads those events (this call runs inside
            # TRT-LLM's allocation and must not drain them).
            self._apply_reports()
        self._stats["match_calls"] += 1
        req_id = int(request.request_id)
        old = self._reqs.get(req_id)
        if old is not None:
            self._release_plan(old)
        if getattr(request, "is_generation_only_request", False):
            return 0, False
        tokens = list(request.get_tokens(0))
        # The C++ request carries the salt as cache_salt_id only; newer Python requests also
        # as cache_salt. Either way it scopes every key, as it scopes TRT-LLM's own.
        salt = request_scope(request)
        state = _Request(req_id, salt=salt, scope=(lora_of(request), salt_of(request)),
                         name_inputs=name_inputs(request), handle=request_handle(request),
                         lora_root_pending=True)
        self._reqs[req_id] = state
        bs = self._block_size
        if num_computed_tokens < 0 or num_computed_tokens % bs:
            return 0, False
        layout = self._ensure_tiers()
        if not (layout.host_blocks or layout.disk_blocks):
            return 0, False
        first = num_computed_tokens // bs
        last = (len(tokens) - 1) // bs  # full blocks that still leave one token to compute
        keys = block_keys(tokens[:last * bs], bs, salt)
        # The prompt's blocks: build_connector_meta extends these instead of hashing them again.
        state.keys = keys
        for i in range(first, last):
            hit = self._lookup(keys[i])
            if hit is None:
                break
            tier, entry = hit
            (self._host if tier == TIER_HOST else self._disk).pin(entry)  # type: ignore[union-attr]
            state.plan.append((i, tier, entry))
        self._shared_match(state, tokens, first + len(state.plan), last)
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
        bs = self._block_size

        def dropped(index: int) -> bool:
            return index * bs < end and (index + 1) * bs > start

        if state.load is not None:
            if state.load not in self._pending_loads:
                if any(dropped(i) for i, _, _ in state.plan):
                    self._stats["cancels_too_late"] += 1
                return
            keep_ops = set()
            for index, tier, entry in state.plan:
                copy_op = next((c.op_id for c in state.load.copies if c.key == entry.key), None)
                if not dropped(index):
                    if copy_op is not None:
                        keep_ops.add(copy_op)
                    continue
                if copy_op is not None:  # its pin is released when the op would have been
                    self._ops.pop(copy_op, None)
                    state.loads_inflight.discard(copy_op)
                    index_ = self._index_of(tier)
                    if index_ is not None and entry.pins > 0:
                        index_.unpin(entry)
            load = LoadOp(state.req_id, tuple(c for c in state.load.copies
                                               if c.op_id in keep_ops))
            self._pending_loads[self._pending_loads.index(state.load)] = load
            state.load = load
        else:
            for index, tier, entry in state.plan:
                if dropped(index):
                    index_ = self._index_of(tier)
                    if index_ is not None and entry.pins > 0:
                        index_.unpin(entry)
        kept = [item for item in state.plan if not dropped(item[0])]
        self._stats["cancelled_tokens"] += (len(state.plan) - len(kept)) * bs
        state.plan = kept
        # The first report subtracts only what the runtime counted as loaded.
        state.match_base = (kept[-1][0] + 1) * bs if kept else None

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
        copies: list[LoadCopy] = []
        for index, tier, entry in state.plan:
            if index >= len(block_ids) or block_ids[index] < 0:
                # TRT-LLM did not allocate it: cannot load; unpin (the request still gets a
                # LoadOp so its id finishes).
                self._index_of(tier).unpin(entry)
                continue
            op_id = self._new_op("load", tier, entry.key, state.req_id, entry)
            state.loads_inflight.add(op_id)
            copies.append(LoadCopy(op_id, _TIER_CODE[tier], entry.slot, entry.key,
                                   int(block_ids[index]),
                                   entry.digest if tier == TIER_SHARED else None,
                                   self._load_pages(state, index)))
        state.load = LoadOp(state.req_id, tuple(copies))
        self._pending_loads.append(state.load)

    @locked
    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Called once per iteration on rank 0 after allocation. Applies completion reports,
        flushes the iteration's GPU-tier events, and returns the loads bound since the last call
        plus offloads (device block → tier slot) for every block that became full this
        iteration and is in no tier yet. Walks ``new_requests`` and ``cached_requests``."""
        self._reap_terminated(scheduled=frozenset(
            rd.request_id for rd in (*scheduler_output.new_requests,
                                     *scheduler_output.cached_requests)))
        # (reaped before the reports: a terminated request's saves are never committed)
        self._sync_gpu_events()
        self._apply_reports()
        layout = self._ensure_tiers()
        self._iteration += 1
        saves: list[SaveOp] = []
        first_tier = self._host if self._host is not None else self._disk
        for rd in scheduler_output.new_requests:  # before any of its blocks is stored
            remember_salt_text(rd)  # the salt as clients send it (wire.router_forms)
        for rd in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
            state = self._reqs.get(rd.request_id)
            if state is None:
                state = self._reqs[rd.request_id] = _Request(
                    rd.request_id, salt=request_scope(rd), scope=(lora_of(rd), salt_of(rd)),
                    name_inputs=name_inputs(rd))
            elif state.salt is None and not state.reported:
                self._adopt_scope(state, rd)
            self._absorb(state, rd)
            if first_tier is not None and not state.finished:
                self._schedule_saves(state, first_tier, saves)
        self.flush_events()
        meta = ConnectorMetadata(self._iteration, layout, tuple(self._pending_loads),
                                 tuple(self._pending_demotes), tuple(saves),
                                 tuple(self._fences), tuple(self._pending_shared_saves))
        self._fences = []
        self._pending_shared_saves = []
        self._pending_loads = []
        self._pending_demotes = []
        return meta

    # Iterations to look for the engine's KV cache manager before giving up (it is there from
    # the first iteration in every TRT-LLM version; the margin covers unusual call stacks).
    _MAX_ATTACH_ATTEMPTS = 8

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
            self._sync_gpu_events()
        self._apply_reports()
        state = self._reqs.get(int(request.request_id))
        if state is None:
            return False
        state.finished = True
        if state.saves_inflight:
            return True
        self._forget(state)
        return False

    # ------------------------------------------------------------------ internals

    def _absorb(self, state: _Request, rd: Any) -> None:
        """Fold one RequestData delta into the request's state."""
        state.tokens.extend(rd.new_tokens)
        self._absorb_block_ids(state, rd)  # flat, or every layer group's pages
        hashes = getattr(rd, "block_hashes", None)
        if hashes:
            state.event_hashes = list(hashes)  # cumulative chain for the full blocks
        elif not self._naming.learning and len(state.tokens) >= self._block_size:
            # No block_hashes: learn TRT-LLM's names from its events (for requests whose hash
            # cannot be computed, and as the cross-check of those computed).
            self._naming.learning = True
            if self.event_sink is not None:  # else: self._stream_names observes
                self.event_sink.on_flush = self._naming.names.observe
        valid = rd.computed_position + rd.num_scheduled_tokens
        if not state.reported and state.match_base is not None:
            # The first report subtracts connector-loaded tokens from computed_position.
            valid = max(valid, state.match_base + rd.num_scheduled_tokens)
        failed = state.load_failed_at
        if not state.reported and failed is not None \
                and rd.computed_position > failed * self._block_size:
            state.offload_stop = failed  # computed on a block its failed load left unfilled
        if not state.reported:
            state.prompt_tokens = len(state.tokens)  # all prompt tokens come first
        state.reported = True
        state.valid_tokens = max(state.valid_tokens, min(valid, len(state.tokens)))
        self._naming.name_root(state, self.event_sink)  # the sink's LoRA names
        bs = self._block_size
        if len(state.keys) < len(state.tokens) // bs:
            state.keys.extend(block_keys(state.tokens, bs, state.salt, start=len(state.keys),
                                         parent=state.keys[-1] if state.keys else None))
        self._naming.v2_extend(state)  # TensorRT-LLM's own stream: its names, computed

    @staticmethod
    def _adopt_scope(state: _Request, rd: Any) -> None:
        """A request matched without a salt whose first report names one (a request object
        that lacked the field): key its blocks under the salt from now on, never unsalted."""
        salt = request_scope(rd)
        if salt is not None:
            state.salt = salt
            state.scope = (lora_of(rd), salt_of(rd))
            state.keys = []  # rehashed under the salt by _absorb
            state.v2_keys = []
            state.digests = []
            state.name_inputs = name_inputs(rd)
            state.computed = []

    def _event_hash(self, state: _Request, index: int) -> int:
        """The hash the tier events name block ``index`` by: TRT-LLM's (see
        :mod:`kvbm_plugin.naming.names`); the plugin's content key only as a placeholder
        while TRT-LLM's is not known (such a block's STORE waits in ``UnnamedStores``)."""
        h = self._naming.hash_of(state, index)
        return state.keys[index] if h is None else h

    # -------------------------------------------------- TRT-LLM's block hashes, learned

    def _schedule_saves(self, state: _Request, index: TierIndex, saves: list[SaveOp]) -> None:
        """Offload the request's newly full blocks into ``index`` (the first tier), in chain
        order. A tier holds prefix-closed chains only: a block is offloaded only while its
        parent is in the same tier (pending or resident) or is offloaded in this same job, so
        a parent that left the tier since it was passed is offloaded again first, from its
        device block (the request still holds it)."""
        bs = self._block_size
        limit = min(state.valid_tokens // bs, len(state.block_ids), len(state.keys))
        if state.offload_stop is not None:
            limit = min(limit, state.offload_stop)
        while state.offload_next < limit:
            i = state.offload_next
            key = state.keys[i]
            present = index.get(key)
            if present is not None:
                if present.resident:
                    index.lookup(key)  # refresh LRU: in use again
                    if index is self._host:  # not in the shared tier yet: write it through
                        self._shared_follow(state, i, present, -1, -1)
                state.offload_next += 1
                continue
            parent_key = state.keys[i - 1] if i else None
            if parent_key is not None and parent_key not in index:
                if self._can_resave(state, index, i - 1):
                    state.offload_next = i - 1  # the parent was evicted as a leaf meanwhile
                    self._stats["parent_resaves"] += 1
                else:
                    # No device copy of the parent to offload: this block would be an orphan.
                    self._stats["orphan_saves_skipped"] += 1
                    state.offload_next += 1
                continue
            block = self._save_block(state, i)  # -1: some layer group has no live page
            if block < 0:
                state.offload_next += 1
                continue
            parent = self._event_hash(state, i - 1) if i else None
            entry = self._reserve(index, key, self._event_hash(state, i), parent,
                                  state.tokens[i * bs:(i + 1) * bs], parent_key, state.scope)
            if entry is None:
                self._stats["tier_full_skips"] += 1
                return  # retry from this block next iteration
            op_id = self._new_op("save", index.name, key, state.req_id, entry)
            state.saves_inflight.add(op_id)
            saves.append(SaveOp(op_id, state.req_id, int(block),
                                HOST if index.name == TIER_HOST else DISK, entry.slot, key,
                                self._save_pages(state, i)))
            if index is self._host:  # write-through to the shared tier, when there is one
                self._shared_follow(state, i, entry, op_id, int(block))
            self._stats["saves_scheduled"] += 1
            state.offload_next += 1

    def _new_op(self, kind: str, tier: str, key: int, req_id: int | None,
                entry: TierEntry | None = None) -> int:
        op_id = self._next_op
        self._next_op += 1
        self._ops[op_id] = _Op(kind, tier, key, req_id, entry)
        return op_id

    def _apply_reports(self) -> None:
        """Fold workers' reports in; an op is final once every rank reported it."""
        final: list[tuple[int, _Op]] = []
        tp_size = self._par.tp_size
        for report in self._hub.drain():
            op = self._ops.get(report.op_id)
            if op is None or not 0 <= report.rank < tp_size:
                # A rank outside the group must not count towards "every rank reported" (the
                # block would be advertised before its bytes are on every rank); an unknown op
                # id is a late duplicate or a report meant for another leader.
                self._stats["reports_rejected"] += 1
                self._log.log(logging.WARNING, "report", "kvbm_plugin: completion report for "
                              "op %d from rank %d ignored (%s; tp_size %d)", report.op_id,
                              report.rank, "unknown op" if op is None else "rank out of range",
                              tp_size)
                continue
            op.reports[report.rank] = report
            if len(op.reports) >= self._par.tp_size:
                del self._ops[report.op_id]
                final.append((report.op_id, op))
        # Op ids grow along each chain, so parents are registered before children.
        for op_id, op in sorted(final, key=lambda item: item[0]):
            self._finalize(op_id, op)

    def _finalize(self, op_id: int, op: _Op) -> None:
        ok = all(r.ok for r in op.reports.values())
        index = self._index_of(op.tier)
        state = self._reqs.get(op.req_id) if op.req_id is not None else None
        if op.kind == "shared_save":
            self._shared_save_done(op_id, op, ok)
        elif op.kind in ("save", "demote"):
            kind = op.kind + "s"
            # Still the entry this op wrote (not forgotten meanwhile with an ancestor, nor
            # replaced by a later reservation of the same block in another slot).
            if op.tainted:
                ok = False
                self._stats["saves_discarded_terminated"] += 1
                if index is not None and op.entry is not None \
                        and index.get(op.key) is op.entry:
                    self._drop(index, op.entry)
            elif index is not None and op.entry is not None and index.get(op.key) is op.entry:
                parent = index.get(op.entry.parent_key) \
                    if op.entry.parent_key is not None else None
                if ok and (op.entry.parent_key is None
                           or (parent is not None and parent.resident)):
                    # Ops finish in id order along a chain, so the parent is resident already
                    # and the tier's STOREs are prefix-closed too.
                    signatures = {r.rank: r.signature for r in op.reports.values()
                                  if r.signature is not None}
                    entry = index.commit(op.key, signatures)
                    self._announce_or_wait(index, entry)
                else:
                    # Never advertised: no REMOVE for it; descendants written after it go too.
                    if ok:
                        ok = False  # written, but its parent is not resident: unusable
                        self._stats["orphan_commits_dropped"] += 1
                    self._drop(index, op.entry)
            self._stats[f"{kind}_committed" if ok else f"{kind}_failed"] += 1
            if state is not None:
                state.saves_inflight.discard(op_id)
        else:  # load: unpin; a corrupt source block is forgotten (with its descendants)
            entry = op.entry
            if entry is not None and entry.pins > 0:
                index.unpin(entry)  # type: ignore[union-attr]
            if entry is not None and index is not None and index.get(op.key) is not entry:
                entry = None  # forgotten meanwhile
            if not ok:
                self._stats["loads_failed"] += 1
                if state is not None:
                    self._load_failed(state, op.entry)
                if op.tier == TIER_SHARED:
                    self._stats["shared_loads_failed"] += 1
                if any(r.error == ERR_CORRUPT for r in op.reports.values()):
                    self._stats["corrupt_blocks"] += 1
                    if entry is not None and index is not None:
                        self._drop(index, entry)
            if state is not None:
                state.loads_inflight.discard(op_id)
        if state is not None and state.finished and not state.saves_inflight \
                and not state.loads_inflight:
            self._forget(state)

    def _load_failed(self, state: _Request, entry: Any) -> None:
        """A load of ``state`` failed. Where TensorRT-LLM recomputes it (load errors) the first
        report's position is the truth, so the tokens the load promised are forgotten. Where it
        does not, the request computes on the unfilled block, and nothing of it from that block
        on may be offloaded: a well-formed tier copy of wrong KV would pass every later check.
        Told apart at the first report (:meth:`_absorb`); already reported: stop at once."""
        state.match_base = None
        index = next((i for i, _, e in state.plan if e is entry), None)
        if index is None:
            return
        if state.reported:
            stop = state.offload_stop
            state.offload_stop = index if stop is None else min(index, stop)
        elif state.load_failed_at is None or index < state.load_failed_at:
            state.load_failed_at = index

    def _reap_terminated(self, executor_thread: bool = True,
                         scheduled: frozenset[int] = frozenset()) -> None:
        """Forget the requests TRT-LLM terminated without calling ``request_finished`` (a
        cancel, an error: ``py_executor.py`` @ 0004396720054 calls it only for finished
        requests), seen by the request object's own state (``is_finished``) or its death.
        A request in this build's scheduler output (``scheduled``) is alive by definition.
        Once per build (executor thread) and per idle tick (death only); O(tracked)."""
        for state in list(self._reqs.values()):
            if state.finished or state.req_id in scheduled or not request_gone(state.handle,
                                                  executor_thread=executor_thread):
                continue
            self._stats["requests_terminated_silently"] += 1
            state.finished = True
            state.handle = None
            if state.load is not None and state.load in self._pending_loads:
                # Bound, never sent: no copy goes out (the id still finishes on every rank).
                for op_id in list(state.loads_inflight):
                    op = self._ops.pop(op_id, None)
                    index = self._index_of(op.tier) if op is not None else None
                    if op is not None and op.entry is not None and op.entry.pins > 0 \
                            and index is not None:
                        index.unpin(op.entry)
                state.loads_inflight.clear()
                i = self._pending_loads.index(state.load)
                self._pending_loads[i] = state.load = LoadOp(state.req_id, ())
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

    def _forget(self, state: _Request) -> None:
        self._release_plan(state)
        if not state.loads_inflight:
            self._reqs.pop(state.req_id, None)

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, int]:
        out = dict(self._stats)
        out["ops_inflight"] = len(self._ops)
        out["requests_tracked"] = len(self._reqs)
        out["tier_stores_waiting_for_name"] = len(self._naming.unnamed)
        out["idle_ticks"] = self._keeper.ticks if self._keeper is not None else 0
        out["host_used"] = len(self._host) if self._host is not None else 0
        out["disk_used"] = len(self._disk) if self._disk is not None else 0
        out["reports_malformed"] = self._receiver.malformed if self._receiver is not None else 0
        out["tier_batches_lost"] = getattr(self._tier_events, "lost_batches", 0)
        out["native_batches_unread"] = self._native_feed.dropped
        out.update(self._native_forms.stats())
        out.update(self._shared_stats())
        return out

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the report receiver, the sink (its publisher) and the consolidator; remove an
        owned temporary disk directory. Bounded by ``timeout`` per component; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._keeper.stop(timeout)
        metrics = get_metrics()
        for component in ("leader", "event_sink", "consolidator"):
            metrics.unregister_stats(component, dp_rank=str(self._dp_rank))
        if self._receiver is not None:
            self._receiver.close(timeout)
        if self._name_reader is not None:
            self._name_reader.stop(timeout)
        self._shared_close(timeout)
        if self.event_source is not None:
            self.event_source.poll()  # the last iteration's events
            self.event_source.detach()
        if self.event_sink is not None:
            flush = getattr(self._tier_events, "flush", None)
            if flush is not None:
                flush()
            self.event_sink.flush()
        elif self._tier_events is not None and hasattr(self._tier_events, "flush"):
            self._tier_events.flush()
        if self.consolidator is not None:
            self.consolidator.shutdown(timeout)
        if self.event_sink is not None:
            self.event_sink.shutdown(timeout)
        close_hub(self._group)
        forget_group_windows(self._group)
        if self._stream_names is not None:
            self._stream_names.close()
        if self._disk_claim is not None:
            self._disk_claim.release()
        if self._own_disk_dir and self._disk_dir and os.path.isdir(self._disk_dir):
            shutil.rmtree(self._disk_dir, ignore_errors=True)
