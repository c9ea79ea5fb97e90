"""A simulated TensorRT-LLM executor that drives the real KvbmConnectorLeader/Worker.

It follows TRT-LLM's PyExecutor and KvCacheConnectorManager where they touch the connector:
``py_executor.py`` @ 0004396720054 (``_executor_loop`` and ``_executor_loop_overlap``, the
default), ``resource_manager.py`` (``add_sequence_batch``, the report after
``maybe_fit_token_budget``), ``connectors/kv_cache_connector.py`` @ 035ab91cad04 for the
manager. :meth:`SimulatedEngine.step` lists the order of one pass.

* bring-up: per rank a ``ThreadPoolExecutor(2)`` builds the worker (and, on rank 0, the leader)
  concurrently; ``register_forward_pass_callable``; ``register_kv_caches``. With
  ``processes=True`` ranks 1.. are child processes that report completions over ZMQ
  (``testing.processes``).
* idle: with nothing active and nothing queued the loop blocks in its request queue, so no
  connector call is made at all; completion reports are then applied by the leader's keeper.
* admission: capacity (guaranteed-no-evict) and the device prefix match, then every new
  request's ``get_num_new_matched_tokens`` before any ``update_state_after_alloc`` (with all
  prompt blocks: V1 allocates the whole prompt at the first chunk), the token-budget trim,
  the report (``build_scheduler_output``: ``external_loads`` cleared every build, requests that
  start an async load left out), then the building ``handle_metadata`` (only when a batch was
  prepared), ``take_scheduled_requests_pending_load``, ``start_load_kv``, the forward with
  ``wait_for_layer_load``/``save_kv_layer`` and ``wait_for_save``.
* termination: ``request_finished`` only for finished requests, from ``_send_kv_async``;
  cancels in ``_handle_canceled_requests`` free the blocks at once (also during an async load)
  without any connector call; GPU blocks are stored in ``update_resources`` once a prompt is
  computed (overlap: one pass later, after that pass's build) and at release (generated and a
  trailing partial block); ``get_finished`` every pass.
* the overlap scheduler: the tokens sampled in pass N reach the requests (and the connector's
  ``RequestData``) only after the forward of N+1; a request that sampled its last token in N
  is scheduled once more in N+1 and terminated after that forward.
* attention DP (``attention_dp`` > 1): this engine is one rank's own executor, with its own
  manager (``enable_attention_dp``), leader and worker; ``testing.adp.AttentionDpEngine`` runs
  every rank and gathers their KV events onto rank 0.
* KV events are C++-like objects (``testing.kv_events``), readable only after the pass's
  ``flush_iteration_events``; with ``trtllm_event_reader=True`` TRT-LLM's KV-event dispatch
  thread reads them concurrently, as ``LLM.get_kv_cache_events`` does. Block hashes are
  TRT-LLM's V1 hashes (``naming.names``) under the request's cache salt and LoRA task
  id (``submit(lora_task_id=...)``; task 0 is an adapter): an adapter's blocks are its own in
  the pool, and their serialized events name no adapter (upstream's serializer writes no
  ``lora_id``).

The GPU pool reuses prefixes, evicts LRU leaf blocks, and records TRT-LLM-shaped KV events
(unsigned hashes, partial blocks, removals). The forward writes ``f(position, layer, kv, head,
dim, token)`` into the pool (``testing.kvmodel``: K/V or MLA, FP32/16 or FP8 stored as int8), so
any onboarded block can be checked exactly: every terminated request is verified on every rank
(``stats().kv_mismatches``).

This module is the loop; the bring-up is ``testing/engine_bringup.py``, each request's GPU
blocks (the C++ block manager's side) ``testing/sim_blocks.py``, the request record
``testing/sim_request.py``.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import torch

from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.consolidator_config import LEADER_ZMQ_PUB_PORT
from kvbm_plugin.testing.connector_manager import SimKvCacheConnectorManager
from kvbm_plugin.testing.engine_bringup import bring_up, free_tcp_port
from kvbm_plugin.testing.engine_config import EngineConfig, EngineStats, RequestResult
from kvbm_plugin.testing.fake_trtllm import (
    LlmRequest,
    RequestData,
    cache_salt_id,
)
from kvbm_plugin.testing.gpu_pool import GpuPool
from kvbm_plugin.testing.kv_events import (
    KvEventDispatchReader,
    SimKVCacheManager,
)
from kvbm_plugin.testing.kvmodel import BatchItems
from kvbm_plugin.testing.processes import LocalRank, RemoteRank, shutdown_ranks
from kvbm_plugin.testing.sim_blocks import RequestBlocks
from kvbm_plugin.testing.sim_request import (
    CONTEXT,
    DONE,
    GENERATION,
    LOADING,
    SAVING,
    WAITING,
    SimRequest,
)
from kvbm_plugin.testing.trtllm_stream import SimStreamingKVCacheManager

# Request ids of attention-DP rank r start at 1 + r * this (TRT-LLM's ids are global).
REQUEST_ID_STRIDE = 1 << 40


class SimulatedEngine:
    """TRT-LLM's executor loop; ``tp_size`` ranks share one scheduler (rank 0's leader)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_kv_heads % cfg.tp_size:
            raise ValueError(f"num_kv_heads={cfg.num_kv_heads} is not divisible by "
                             f"tp_size={cfg.tp_size}")
        if cfg.processes and cfg.tp_size < 2:
            raise ValueError(f"processes=True needs tp_size > 1 (got tp_size={cfg.tp_size})")
        adp = cfg.attention_dp > 1
        if adp and (cfg.tp_size != 1 or not 0 <= cfg.dp_rank < cfg.attention_dp):
            raise ValueError(f"attention_dp={cfg.attention_dp} runs one rank per engine: "
                             f"tp_size must be 1 (got {cfg.tp_size}), dp_rank "
                             f"{cfg.dp_rank} below attention_dp")
        self.device = torch.device(cfg.device)
        self.block_size = bs = cfg.tokens_per_block
        self._group = f"sim-{uuid.uuid4().hex[:12]}"
        self._stats = EngineStats()
        self._reqs: dict[int, SimRequest] = {}
        self._order: list[int] = []  # FIFO of waiting request ids
        self._ids = itertools.count(1 + cfg.dp_rank * REQUEST_ID_STRIDE)  # unique over ranks
        self._aborts: set[int] = set()  # cancels not yet fetched by the loop
        self._canceled: set[int] = set()  # PyExecutor.canceled_req_ids
        self._live: dict[int, SimRequest] = {}  # requests not done, in submission order
        # overlap: the batch whose samples are not processed yet, as (request, its token
        # count after that batch's sampling, whether that sampling finished it)
        self._previous: list[tuple[SimRequest, int, bool]] = []
        self.pool = GpuPool(cfg.num_gpu_blocks, bs, cfg.max_seq_len)
        self._blocks = RequestBlocks(self.pool, bs)  # each request's GPU blocks
        self._closed = False
        self.event_reader: KvEventDispatchReader | None = None
        env = dict(cfg.env)
        if cfg.processes and not env.get(LEADER_ZMQ_PUB_PORT):
            env[LEADER_ZMQ_PUB_PORT] = str(free_tcp_port())
        self.env = env
        built = bring_up(cfg, self.pool, env, self._group, self.device)
        self.leader: KvbmConnectorLeader = built.leader
        self.ranks: list[LocalRank | RemoteRank] = built.ranks
        # PyExecutor keeps its KV cache manager here; the leader finds it through the frames of
        # build_connector_meta's caller, as it does in TensorRT-LLM.
        self.kv_cache_manager: SimKVCacheManager | SimStreamingKVCacheManager = \
            built.kv_cache_manager
        self.workers: list[KvbmConnectorWorker] = [
            r.worker for r in self.ranks if isinstance(r, LocalRank)]
        self.kv_pools: list[torch.Tensor] = [
            r.pool for r in self.ranks if isinstance(r, LocalRank)]
        try:
            self.kv_cache_connector_manager = SimKvCacheConnectorManager(
                self.leader, self.ranks, attention_dp_rank=cfg.dp_rank if adp else None)
        except BaseException:
            self.shutdown(5.0)
            raise
        if cfg.trtllm_event_reader:
            self.event_reader = KvEventDispatchReader(self, self.kv_cache_manager)

    # ------------------------------------------------------------------ public API

    def submit(self, prompt_tokens: list[int], max_new_tokens: int = 1, *,
               cache_salt: str | None = None, lora_task_id: int | None = None,
               multimodal: list[tuple[list[int], list[tuple[int, int]]]] | None = None) -> int:
        """Queue a request; returns its id. ``lora_task_id``: the request's LoRA adapter, as
        TensorRT-LLM's ``LoRARequest.lora_int_id`` (task id 0 is an adapter like any other);
        None for the base model. ``multimodal``: its items, each (hash as 8 int32 parts, its
        runs of prompt positions as (first position, token count)), as the C++ request's
        ``multimodal_hashes`` and positions (or, for items in several runs, run metadata)
        carry them."""
        if lora_task_id is not None and (type(lora_task_id) is not int
                                         or not 0 <= lora_task_id < 1 << 64):
            raise ValueError(f"lora_task_id={lora_task_id!r} is not None or a u64 integer")
        if len(prompt_tokens) < 1 or max_new_tokens < 1:
            raise ValueError("a request needs at least one prompt token and one new token")
        needed = -(-(len(prompt_tokens) + max_new_tokens) // self.block_size)
        if needed > self.config.num_gpu_blocks:
            # TRT-LLM rejects such a request up front too; queueing it would wait forever.
            raise ValueError(f"request of {len(prompt_tokens)} prompt + {max_new_tokens} new "
                             f"tokens needs {needed} blocks; the GPU pool has "
                             f"num_gpu_blocks={self.config.num_gpu_blocks}")
        req_id = next(self._ids)
        self._reqs[req_id] = SimRequest(req_id, list(prompt_tokens), max_new_tokens, cache_salt,
                                  lora_task_id, list(multimodal or ()),
                                  tokens=list(prompt_tokens), host_len=len(prompt_tokens))
        self._order.append(req_id)
        self._live[req_id] = self._reqs[req_id]
        self._stats.requests_submitted += 1
        return req_id

    def abort(self, req_id: int) -> None:
        """Abort a request at the next iteration boundary (as TRT-LLM's cancel does)."""
        self._aborts.add(req_id)

    def run_until_idle(self, *, max_iterations: int = 1_000_000,
                       timeout_s: float = 60.0) -> None:
        """Step until TRT-LLM's loop would block for the next request (no active request, an
        empty queue), then wait until every transfer is reported and applied by the leader;
        raises TimeoutError naming what is still pending.

        While blocked, TRT-LLM makes no connector call at all; completion reports that arrive
        then are applied by the leader's own idle keeper (see the leader), as in a real
        deployment. A request whose offloads are still saving keeps its GPU blocks until a
        later iteration's ``get_finished`` (the next request's), as upstream."""
        deadline = time.monotonic() + timeout_s
        for _ in range(max_iterations):
            if not self.active():
                break
            if self.step() == 0:
                time.sleep(0.0005)  # nothing to compute: waiting for transfer threads
            if time.monotonic() > deadline:
                break
        while time.monotonic() <= deadline:
            if self.idle():
                return
            time.sleep(0.001)  # the leader's keeper thread applies the reports
        pending = {r.id: r.state for r in self._reqs.values() if r.state != DONE}
        assert self.leader is not None
        raise TimeoutError(f"engine not idle: requests {pending}, leader "
                           f"{self.leader.stats()}, ranks {[r.stats() for r in self.ranks]}")

    def active(self) -> bool:
        """Whether TRT-LLM's loop runs another pass: an active request (scheduled, loading) or
        a queued one; otherwise it blocks in the request queue."""
        return bool(self._order) or any(r.state in (CONTEXT, GENERATION, LOADING)
                                         for r in self._live.values())

    def idle(self) -> bool:
        """Blocked for the next request, every transfer terminal and applied by the leader."""
        assert self.leader is not None
        return (not self.active() and all(r.idle() for r in self.ranks)
                and self.leader.stats()["ops_inflight"] == 0)

    def state(self, req_id: int) -> str:
        """The request's state (cheaper than :meth:`result`)."""
        return self._reqs[req_id].state

    def result(self, req_id: int) -> RequestResult:
        r = self._reqs[req_id]
        return RequestResult(r.id, r.state, list(r.tokens), r.n_device, r.host_hit, r.disk_hit,
                             r.mismatches)

    def stats(self) -> EngineStats:
        s = EngineStats(**vars(self._stats))
        rank_stats = [r.stats() for r in self.ranks]
        s.bytes_offloaded = sum(st["bytes_offloaded"] for st in rank_stats)
        s.bytes_onboarded = sum(st["bytes_onboarded"] for st in rank_stats)
        return s

    def resident_blocks(self) -> dict[str, dict[int, set[int]]]:
        """The truth per medium and dp rank, as far as any reader can know it: full blocks of
        the GPU pool as TensorRT-LLM's flushed events describe it, advertised host and disk
        blocks (unsigned u64 hashes). :meth:`unflushed_gpu_blocks` is the difference to the
        pool itself."""
        assert self.leader is not None
        r = self.config.dp_rank
        return {"GPU": {r: set(self.pool.readable_full)},
                "CPU": {r: self.leader.resident_hashes("host")},
                "DISK": {r: self.leader.resident_hashes("disk")}}

    def unflushed_gpu_blocks(self) -> tuple[set[int], set[int]]:
        """Full blocks stored in the GPU pool since TensorRT-LLM's last flush, and those removed
        since (still readable as stored): its next pass's ``flush_iteration_events`` makes them
        readable. Non-empty once the engine stopped stepping only when ``get_finished``
        released a request after the last pass's flush (upstream's order)."""
        pool, readable = self.pool.resident_full_hashes(), self.pool.readable_full
        return pool - readable, readable - pool

    def get_latest_kv_cache_events(self) -> list[Any]:
        """``PyExecutor.get_latest_kv_cache_events``: drains the KV cache manager's readable
        events (C++-like objects). TRT-LLM's dispatch thread calls it."""
        return self.kv_cache_manager.get_latest_events(0)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self.event_reader is not None:
            self.event_reader.stop(timeout)
        shutdown_ranks(self.ranks, timeout)  # every rank before the leader
        if self.leader is not None:
            self.leader.shutdown(timeout)
        if isinstance(self.kv_cache_manager, SimStreamingKVCacheManager):
            self.kv_cache_manager.shutdown(timeout)

    def __enter__(self) -> SimulatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop

    def step(self, *, dummy: bool = False) -> int:
        """One pass of TRT-LLM's executor loop; returns the tokens the forward computed.
        ``dummy``: attention DP, another rank has work (:meth:`_dummy_pass` when this one has
        none).

        ``_executor_loop`` (``overlap_scheduler=False``) and ``_executor_loop_overlap`` (the
        default) of ``py_executor.py`` @ 0004396720054, where they touch the connector:

        1. nothing active and nothing queued: the loop blocks in the request queue, so no
           connector call is made at all (returns 0 here);
        2. cancel ids are collected at fetch; scheduling; ``prepare_resources`` only when a
           batch was scheduled (``can_queue``): every new request's
           ``get_num_new_matched_tokens`` (inside ``add_sequence_batch``), then every
           ``update_state_after_alloc``, then the token-budget trim, then the connector report;
        3. ``handle_metadata`` (builds only when a report was made), then, with a batch,
           ``take_scheduled_requests_pending_load``, ``handle_metadata`` again (a no-op) and
           ``start_load_kv``; the forward with the layer hooks and ``wait_for_save``;
        4. plain loop, for this batch: ``_update_requests``; ``_send_kv_async``
           (``request_finished`` for the finished requests only); ``_handle_canceled_requests``
           (blocks freed at once, also during an async load); ``_handle_responses``
           (termination frees the blocks: ``releaseBlocks`` stores every block, generated and
           a trailing partial one included); ``update_resources`` (``store_context_blocks``
           for prompts done); ``flush_iteration_events``. Overlap loop: the same for the
           PREVIOUS batch, ``_update_requests`` + ``_send_kv_async`` after this forward and
           the rest in ``_process_previous_batch`` after this batch's sampling, so a prompt's
           blocks are stored one pass later, after that pass's build;
        5. every pass: ``get_finished`` (``_kv_connector_terminate_requests``).
        """
        if not self.active():
            return self._dummy_pass() if dummy else 0
        self._stats.iterations += 1
        self._canceled.update(self._aborts)  # _handle_special_queue_items
        self._aborts.clear()
        batch, new = self._schedule()
        can_queue = bool(batch)
        manager = self.kv_cache_connector_manager
        if can_queue:
            batch = self._prepare_resources(batch, new)
        manager.handle_metadata()
        computed = 0
        ran: list[tuple[SimRequest, int, bool]] = []
        if can_queue:
            loading = manager.take_scheduled_requests_pending_load([r.id for r, _ in batch])
            batch = [(r, n) for r, n in batch if r.id not in loading]
            manager.handle_metadata()  # _kv_connector_start_batch: nothing left to build
            items: BatchItems = [(r.computed, r.tokens[r.computed:r.computed + n],
                                  list(r.blocks)) for r, n in batch]
            for rank in reversed(self.ranks):  # other processes first: ranks run concurrently
                rank.start_iteration(items)
            for rank in self.ranks:
                rank.finish_iteration()
            can_queue = bool(batch)
            if can_queue:
                self._stats.forward_passes += 1
                computed = sum(n for _, n in batch)
        if self.config.overlap_scheduler:
            previous = self._previous
            if previous:
                self._update_requests(previous)
                self._send_kv_async(previous)
            if can_queue:
                ran = self._sample(batch)
            if previous:
                self._process_batch(previous)
            self._previous = ran if can_queue else []
        elif can_queue:
            ran = self._sample(batch)
            self._update_requests(ran)
            self._send_kv_async(ran)
            self._process_batch(ran)
        self._kv_connector_terminate_requests()
        return computed

    def _dummy_pass(self) -> int:
        """An attention-DP rank without work while another has some: TRT-LLM pads it with a
        dummy request (``py_executor.py`` ``_pad_attention_dp_dummy_request``) and runs the
        pass. The connector manager skips the dummy (``kv_cache_connector.py`` @
        035ab91cad04), so the build gets an empty report and binds empty metadata; the pass
        still flushes the KV events and calls ``get_finished``."""
        self._stats.iterations += 1
        manager = self.kv_cache_connector_manager
        manager.build_scheduler_output([])
        manager.handle_metadata()
        for rank in reversed(self.ranks):
            rank.start_iteration([])
        for rank in self.ranks:
            rank.finish_iteration()
        self._process_batch([])
        self._kv_connector_terminate_requests()
        return 0

    def _process_batch(self, processed: list[tuple[SimRequest, int, bool]]) -> None:
        """``_handle_canceled_requests``, ``_handle_responses``, ``update_resources`` and
        ``_add_kv_cache_events`` for a processed batch."""
        self._handle_canceled_requests()
        for r, _, _ in processed:
            if r.state in (CONTEXT, GENERATION, LOADING) and (r.host_finished or r.aborted):
                self._free(r)
        self._update_resources(processed)
        self.kv_cache_manager.flush_iteration_events()

    def _schedule(self) -> tuple[list[tuple[SimRequest, int]], list[SimRequest]]:
        """Running requests first, then admissions (guaranteed-no-evict: the whole sequence's
        blocks, minus a device prefix match, must be free); returns the batch with each
        request's scheduled tokens and the newly admitted requests. No connector call."""
        cfg = self.config
        budget = cfg.max_num_tokens
        batch: list[tuple[SimRequest, int]] = []
        new: list[SimRequest] = []
        for r in self._live.values():
            if len(batch) >= cfg.max_batch_size or budget <= 0:
                break
            if r.state == GENERATION:
                batch.append((r, 1))
                budget -= 1
            elif r.state == CONTEXT:
                n = min(len(r.prompt) - r.computed, budget)
                batch.append((r, n))
                budget -= n
        while self._order and len(batch) < cfg.max_batch_size and budget > 0:
            r = self._reqs[self._order[0]]
            if not self._blocks.reserve(r):
                break
            self._order.pop(0)
            new.append(r)
            n = min(len(r.prompt) - r.computed, budget)  # trimmed after the connector match
            batch.append((r, n))
            budget -= n
        return batch, new

    def _prepare_resources(self, batch: list[tuple[SimRequest, int]],
                           new: list[SimRequest]) -> list[tuple[SimRequest, int]]:
        """``KVCacheManager.prepare_resources`` + ``ResourceManager.prepare_resources``:
        ``add_sequence_batch`` (every new request's connector query, then the allocation of
        its whole prompt), then ``update_state_after_alloc`` per new request, a block slot per
        generated token, the token-budget trim and the connector report."""
        manager = self.kv_cache_connector_manager
        assert self.leader is not None
        matched: dict[int, tuple[int, bool]] = {}
        for r in new:  # inside C++ add_sequence_batch: every query first
            # The C++ request the connector sees carries the salt as its id only.
            r.llm_request = LlmRequest(r.id, list(r.tokens), cache_salt_id=(
                None if r.salt is None else cache_salt_id(r.salt)), lora_task_id=r.lora,
                multimodal=r.mm)
            r.llm_request.context_current_position = r.computed
            before = self.leader.stats()
            n_conn = manager.get_num_new_matched_tokens(r.llm_request, r.computed)
            if r.computed + n_conn >= len(r.prompt):
                raise RuntimeError(f"connector matched the whole prompt of request {r.id}")
            after = self.leader.stats()
            r.host_hit = after["matched_host_tokens"] - before["matched_host_tokens"]
            r.disk_hit = after["matched_disk_tokens"] - before["matched_disk_tokens"]
            matched[r.id] = (n_conn, manager.is_loading(r.id))
            r.n_loaded = n_conn
            r.computed += n_conn
            r.llm_request.context_current_position = r.computed
            self._blocks.ensure(r, len(r.prompt))
        for r in new:  # after the C++ batch: the Python loop
            assert r.llm_request is not None
            manager.update_state_after_alloc(r.llm_request, list(r.blocks))
            self._stats.prompt_tokens += len(r.prompt)
            self._stats.gpu_hit_tokens += r.n_device
            self._stats.host_hit_tokens += r.host_hit
            self._stats.disk_hit_tokens += r.disk_hit
            n_conn, load_async = matched[r.id]
            r.state = LOADING if n_conn and load_async else CONTEXT
        for r, n in batch:
            if r.state == GENERATION:
                self._blocks.ensure(r, r.computed + n)
        # maybe_fit_token_budget: the chunks scheduled before the match shrink to what is left
        batch = [(r, min(n, len(r.prompt) - r.computed) if r.state in (CONTEXT, LOADING)
                  else n) for r, n in batch]
        bs = self.block_size
        entries: list[tuple[int, RequestData]] = []
        for r, n in batch:
            visible = r.tokens[:r.host_len]
            hashes = self._blocks.hashes(r, len(visible) // bs) \
                if self.config.provide_block_hashes else []
            # context: context_current_position; generation: len(tokens) - 1 (upstream)
            position = r.computed if r.state in (CONTEXT, LOADING) else r.host_len - 1
            entries.append((r.id, RequestData(
                r.id, visible[r.reported_tokens:], r.blocks[r.reported_blocks:], position, n,
                hashes, cache_salt=r.salt)))
            if r.id not in manager.pending_load_ids():
                r.reported_tokens, r.reported_blocks = len(visible), len(r.blocks)
        manager.build_scheduler_output(entries)
        return batch

    def _sample(self, batch: list[tuple[SimRequest, int]]) -> list[tuple[SimRequest, int, bool]]:
        """After the forward (device side): positions computed, a token sampled where a
        sequence ended (``_update_request_states``: context → generation). The host sees the
        token when the batch is processed; nothing is stored for reuse here."""
        out: list[tuple[SimRequest, int, bool]] = []
        for r, n in batch:
            if r.state not in (CONTEXT, GENERATION):
                # finished meanwhile (overlap: _send_kv_async of the previous batch ran)
                out.append((r, len(r.tokens), False))
                continue
            if r.state == CONTEXT:
                self._stats.computed_prefill_tokens += n
            r.computed += n
            finished_now = False
            if r.computed >= len(r.tokens):  # end of context, or a decode step
                if not r.device_done:  # the overlap loop's extra step samples nothing kept
                    last = r.tokens[-1]
                    r.tokens.append((last * 31 + len(r.tokens) * 7 + 3)
                                    % self.config.vocab_size)
                    r.generated += 1
                    r.device_done = finished_now = r.generated >= r.max_new
                r.state = GENERATION
            out.append((r, len(r.tokens), finished_now))
        return out

    def _update_requests(self, sampled: list[tuple[SimRequest, int, bool]]) -> None:
        """``_update_requests``: the tokens sampled in that batch reach the request objects;
        a request whose last token arrived is finished (``is_finished``)."""
        for r, length, finished in sampled:
            if r.state not in (CONTEXT, GENERATION):
                continue  # terminated meanwhile
            r.host_len = max(r.host_len, length)
            if finished:
                r.host_finished = True
                if r.llm_request is not None:
                    r.llm_request.is_finished = True

    def _send_kv_async(self, sampled: list[tuple[SimRequest, int, bool]]) -> None:
        """``_save_kv_to_connector_async``: ``request_finished`` for the batch's finished
        requests (never for a cancelled one), with the request's cache block ids; True keeps
        the blocks until ``get_finished`` returns the id everywhere."""
        for r, _, _ in sampled:
            if not r.host_finished or r.aborted or r.state not in (CONTEXT, GENERATION):
                continue
            r.mismatches = self._verify(r)
            self._stats.kv_mismatches += r.mismatches
            self._stats.requests_finished += 1
            assert r.llm_request is not None
            if self.kv_cache_connector_manager.request_finished(r.llm_request,
                                                                list(r.blocks)):
                r.state = SAVING  # leaves active_requests (DISAGG_CONTEXT_TRANS_IN_PROGRESS)

    def _handle_canceled_requests(self) -> None:
        """``_handle_canceled_requests``: a cancelled request is finished at once (no
        transceiver: nothing is waited for, not even an async load) and terminated by the
        same pass's ``_handle_responses``; a queued one leaves the queue."""
        for req_id in sorted(self._canceled):
            r = self._reqs.get(req_id)
            if r is None or r.state in (DONE, SAVING):
                continue
            r.aborted = True
            self._stats.requests_aborted += 1
            if r.llm_request is not None:
                r.llm_request.is_finished = True
            if r.state == WAITING:
                self._order.remove(req_id)
                r.state = DONE
                del self._live[req_id]
            else:
                self._free(r)
        self._canceled.clear()

    def _update_resources(self, processed: list[tuple[SimRequest, int, bool]]) -> None:
        """``KVCacheManager.update_resources``: ``store_context_blocks`` for each request of
        the batch whose prompt is computed (the full blocks of the prompt, one STORE)."""
        for r, _, _ in processed:
            if r.context_stored or r.state == DONE or r.computed < len(r.prompt):
                continue
            self._blocks.store_prompt(r)

    def _free(self, r: SimRequest) -> None:
        """``free_resources`` → C++ ``releaseBlocks``: every block with KV is stored for reuse
        (generated ones and a trailing partial block included; nothing of a request that never
        computed past an async load), then released last block first."""
        self._blocks.release(r)
        r.state = DONE
        self._live.pop(r.id, None)
        r.llm_request = None  # TRT-LLM drops the request object (the leader sees it die)
        self.kv_cache_connector_manager.forget(r.id)

    def _kv_connector_terminate_requests(self) -> None:
        """``get_finished`` on every rank; act on ids every rank returned: a saved request is
        terminated, a loaded one scheduled from now on. Then (``load_errors``, revisions with
        it: ``worker/load_errors.py``) ``handle_load_errors`` over the live requests: each
        one holding a block whose load failed redoes its connector-loaded tokens (its context
        restarts at its device match) before it can compute (ranks report failures first)."""
        manager = self.kv_cache_connector_manager
        done_saving, done_loading = manager.get_finished()
        for req_id in done_saving:
            r = self._reqs[req_id]
            if r.state == SAVING:
                self._free(r)
        for req_id in sorted(done_loading):
            r = self._reqs[req_id]
            if r.state == LOADING:
                r.state = CONTEXT
        if self.config.load_errors:
            live = [r.llm_request for r in self._live.values() if r.llm_request is not None]
            for request in manager.handle_load_errors(live, self):
                r = self._reqs[request.request_id]
                if r.state in (LOADING, CONTEXT) and r.computed > r.n_device:
                    self._stats.recomputed_requests += 1
                    r.computed, r.n_loaded = r.n_device, 0

    def get_cache_indices(self, request: Any) -> list[int]:
        return list(self._live[request.request_id].blocks)  # KeyError once freed (upstream)

    def _verify(self, r: SimRequest) -> int:
        """Blocks of ``r`` (summed over ranks) whose KV differs from what the forward wrote."""
        return sum(rank.mismatches(r.computed, r.tokens, r.blocks) for rank in self.ranks)

    # ------------------------------------------------------------------ test helpers

    def block_ids(self, req_id: int) -> list[int]:
        return list(self._reqs[req_id].blocks)
