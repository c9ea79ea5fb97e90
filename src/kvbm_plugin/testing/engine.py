"""A simulated TensorRT-LLM executor that drives the real KvbmConnectorLeader/Worker.

It follows TRT-LLM's PyExecutor and KvCacheConnectorManager, where they touch the connector
(NVIDIA/TensorRT-LLM, ``tensorrt_llm/_torch/pyexecutor/``: ``py_executor.py``@9521caf4 for the
overlap loop being the default (``disable_overlap_scheduler``), ``get_latest_kv_cache_events``
and the per-iteration ``flush_iteration_events``; the connector call sites in
``_executor_loop`` / ``_executor_loop_overlap`` / ``_kv_connector_start_batch`` /
``_kv_connector_terminate_requests`` and ``resource_manager.py``'s
``KVCacheManager.prepare_resources`` as of cf44a1cc; ``kv_cache_connector.py``@00fdcbff5ad8 for
the manager):

* bring-up: per rank a ``ThreadPoolExecutor(2)`` builds the worker (and, on rank 0, the leader)
  concurrently; ``register_forward_pass_callable``; ``register_kv_caches``. With
  ``processes=True`` ranks 1.. are child processes that report completions over ZMQ
  (``testing.processes``).
* per iteration: capacity scheduling (guaranteed-no-evict); for a new request a device prefix
  match, ``get_num_new_matched_tokens`` through the connector manager, allocation of the WHOLE
  prompt (V1 ``add_sequence(prompt_len)`` on the first context chunk) and
  ``update_state_after_alloc`` with all prompt blocks; chunked prefill then computes the prompt
  over several iterations; generation requests get one block slot per token (``add_token``).
  ``build_scheduler_output`` (``testing.connector_manager``: ``external_loads`` cleared every
  build, async-loading requests skipped), then ``_kv_connector_start_batch``:
  ``handle_metadata`` → ``_run_on_leader(lambda: build_connector_meta(...))``, bound on every
  rank, ``start_load_kv``; the forward with ``wait_for_layer_load``/``save_kv_layer`` around each
  layer and the forward-pass callable; ``wait_for_save``; sampling; termination
  (``request_finished``); ``flush_iteration_events``; ``get_finished`` on every rank, acting on
  an id once every rank returned it.
* the overlap scheduler (``overlap_scheduler=True``, TRT-LLM's default): the tokens sampled in
  iteration N reach the requests (and so the connector's ``RequestData``) only after the forward
  of N+1; a request that sampled its last token in N is scheduled once more in N+1 and
  terminated after that forward; a last iteration without a forward processes the final batch
  (one more ``get_finished`` call than forward passes).
* KV events are C++-like objects (``testing.kv_events``), readable only after the iteration's
  ``flush_iteration_events``; with ``trtllm_event_reader=True`` TRT-LLM's KV-event dispatch
  thread reads them concurrently, as ``LLM.get_kv_cache_events`` does.

The GPU pool reuses prefixes, evicts LRU leaf blocks, and records TRT-LLM-shaped KV events
(unsigned hashes, partial blocks, removals). The forward writes ``f(position, layer, kv, head,
dim, token)`` into the pool (``testing.kvmodel``: K/V or MLA, FP32/16 or FP8 stored as int8), so
any onboarded block can be checked exactly: every terminated request is verified on every rank
(``stats().kv_mismatches``).
"""

from __future__ import annotations

import itertools
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.consolidator_config import LEADER_ZMQ_PUB_PORT
from kvbm_plugin.testing.connector_manager import SimKvCacheConnectorManager
from kvbm_plugin.testing.fake_trtllm import (
    KvCacheConfig,
    KVCacheEventSerializer,
    LlmArgs,
    LlmRequest,
    ParallelConfig,
    RequestData,
    cache_salt_id,
    trtllm_block_hash,
)
from kvbm_plugin.testing.kv_events import (
    DEFAULT_EVENT_BUFFER_MAX_SIZE,
    KvEventDispatchReader,
    SimKVCacheManager,
)
from kvbm_plugin.testing.kvmodel import BatchItems, KvModel, model_kwargs
from kvbm_plugin.testing.processes import LocalRank, RemoteRank


@dataclass
class EngineConfig:
    """Shape of the simulated model and engine."""

    num_layers: int = 2
    num_kv_heads: int = 4  # total; each TP rank holds num_kv_heads // tp_size
    head_dim: int = 4
    tokens_per_block: int = 4
    num_gpu_blocks: int = 64
    tp_size: int = 1
    max_num_tokens: int = 256  # token budget per iteration; longer prompts are chunked
    max_batch_size: int = 8
    device: str = "cpu"  # "cuda" puts the pools on the GPU
    dtype: torch.dtype = torch.float32
    env: Mapping[str, str] = field(default_factory=dict)  # DYN_KVBM_* for the connector
    provide_block_hashes: bool = True  # RequestData.block_hashes (TRT-LLM >= ~1.3)
    max_seq_len: int = 4096  # the attention window reported in KV events
    tier_events: Any = None  # optional recorder for the leader's tier registrations
    vocab_size: int = 1000
    # TRT-LLM's default executor loop; False runs the plain loop (_executor_loop).
    overlap_scheduler: bool = True
    # Run TRT-LLM's KV-event dispatch thread (what LLM.get_kv_cache_events reads).
    trtllm_event_reader: bool = False
    event_buffer_max_size: int = DEFAULT_EVENT_BUFFER_MAX_SIZE  # kv_cache_config's
    # Ranks 1.. in child processes, completion reports over ZMQ (needs tp_size > 1).
    processes: bool = False
    kv_factor: int = 2  # 1: MLA (one latent per token)
    kv_cache_dtype: str = "auto"  # "fp8": FP8 values in an int8-stored pool


@dataclass
class EngineStats:
    iterations: int = 0
    forward_passes: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    computed_prefill_tokens: int = 0  # prompt tokens the forward pass computed
    gpu_hit_tokens: int = 0  # prompt tokens reused from the GPU pool
    host_hit_tokens: int = 0  # prompt tokens onboarded from the host tier
    disk_hit_tokens: int = 0  # prompt tokens onboarded from the disk tier
    bytes_offloaded: int = 0  # summed over ranks
    bytes_onboarded: int = 0
    kv_mismatches: int = 0  # blocks whose KV differed from the forward's values


@dataclass
class RequestResult:
    request_id: int
    state: str
    tokens: list[int]
    gpu_hit_tokens: int
    host_hit_tokens: int
    disk_hit_tokens: int
    kv_mismatches: int


WAITING, LOADING, CONTEXT, GENERATION, SAVING, DONE = (
    "waiting", "loading", "context", "generation", "saving", "done")


@dataclass
class _Req:
    id: int
    prompt: list[int]
    max_new: int
    salt: str | None
    tokens: list[int] = field(default_factory=list)  # every token the device has
    host_len: int = 0  # tokens the request object shows (lags by one with overlap)
    state: str = WAITING
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    n_device: int = 0
    n_loaded: int = 0
    host_hit: int = 0
    disk_hit: int = 0
    generated: int = 0
    device_done: bool = False  # the last token is sampled (the host may not know yet)
    aborted: bool = False
    reported_tokens: int = 0
    reported_blocks: int = 0
    reserved: int = 0
    stored_blocks: int = 0  # full blocks stored for reuse in the GPU pool
    mismatches: int = 0
    llm_request: LlmRequest | None = None


class _GpuPool:
    """Block allocation with prefix reuse and leaf-first LRU eviction; records TRT-LLM KV events.

    Follows TensorRT-LLM's ``WindowBlockManager`` (cpp/tensorrt_llm/batch_manager/
    kvCacheManager.cpp and evictionPolicy.cpp, read at revision 002ba6a7cc5e):

    * Stored blocks form a radix tree (``parent_of``/``children``). ``storeBlocks`` walks the
      tree from the root along the sequence's block keys; a block whose key is already cached is
      traversed (not stored twice) and the first missing one and everything after it are
      inserted under the last match, in one ``stored`` event: a block is stored only under a
      cached parent.
    * A request that reuses a cached block only claims it (takes it out of the free queue); its
      cached children stay cached and nothing is emitted.
    * A sequence's blocks are released last block first, so within one release the leaf enters
      the LRU free queue before its parent, and the queue's front is a leaf.
    * ``getFreeBlock`` takes the queue's front and frees all its cached descendants first
      (``freeChildren``, post-order: children before parents), emitting a removal for each and
      then for the block itself; consecutive removals coalesce into one ``removed`` event.
    The GPU-tier stream is therefore prefix-closed: a parent is never removed while a
    descendant stays stored.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.block_size = block_size
        self.window = window
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, None] = OrderedDict()  # refcount 0, reusable, LRU first
        self.refs: dict[int, int] = {}
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.parent_of: dict[int, int | None] = {}
        self.children: dict[int, set[int]] = {}  # stored block -> its stored children
        self.full: set[int] = set()  # blocks stored with a full block of tokens
        self.events: list[dict[str, Any]] = []
        self._event_id = itertools.count()
        self._emit({"type": "created", "num_blocks_per_cache_level": [num_blocks, 0]})

    def _emit(self, data: dict[str, Any]) -> None:
        self.events.append({"event_id": next(self._event_id), "window_size": self.window,
                            "data": data})

    def get_latest_events(self, timeout_ms: int = 0) -> list[dict[str, Any]]:
        """Drain the buffered events, like TRT-LLM's ``KVCacheManager.get_latest_events``
        (already serialized to dicts)."""
        out, self.events = self.events, []
        return out

    def match(self, hashes: list[int]) -> list[int]:
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None or b not in self.full:
                break
            out.append(b)
        return out

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def acquire(self, block: int) -> None:
        """Claim a cached block for reuse (upstream ``claimBlock``): children stay cached."""
        self.refs[block] = self.refs.get(block, 0) + 1
        self.cached.pop(block, None)

    def alloc(self) -> int:
        if not self.free:
            victim = next(iter(self.cached))  # LRU front; a leaf unless children are in use
            self._free_subtree(victim)
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def _free_subtree(self, root: int) -> None:
        """Upstream ``freeChildren``: unstore ``root`` and its descendants, children first,
        in one coalesced ``removed`` event. Unused blocks return to the free list; a block
        still in use (a request holds it) stays allocated as a private, unstored block."""
        order: list[int] = []
        stack = [(root, False)]
        while stack:
            block, expanded = stack.pop()
            if expanded:
                order.append(block)
                continue
            stack.append((block, True))
            stack.extend((child, False) for child in self.children.get(block, ()))
        removed: list[int] = []
        for block in order:
            removed.append(self.hash_of.pop(block))
            del self.by_hash[removed[-1]]
            parent = self.parent_of.pop(block, None)
            if parent is not None:
                siblings = self.children[parent]
                siblings.discard(block)
                if not siblings:
                    del self.children[parent]
            self.children.pop(block, None)
            self.full.discard(block)
            if block in self.cached:
                del self.cached[block]
                self.free.append(block)
        if self.events and self.events[-1]["data"]["type"] == "removed":
            self.events[-1]["data"]["block_hashes"].extend(removed)  # upstream coalescing
        else:
            self._emit({"type": "removed", "block_hashes": removed})

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            if block in self.hash_of:
                self.cached[block] = None
            else:
                self.free.append(block)

    def store_blocks(self, blocks: list[int], keys: list[tuple[int, list[int]]],
                     first: int = 0, cache_salt: str | None = None) -> None:
        """Upstream ``storeBlocks`` for a sequence's blocks ``blocks[i]`` with block keys
        ``keys[i] = (hash, tokens)`` (the last may be partial), of which ``first..`` are new.

        The walk starts at the deepest ``first`` whose parent is still cached (usually
        ``first`` itself: the parent was stored in an earlier iteration); cached keys are
        traversed and the rest inserted under the last match, as one ``stored`` event. A
        salted block's event carries ``cache_salt`` per block, as newer TRT-LLM's do.
        """
        n = min(len(blocks), len(keys))
        while first > 0 and keys[first - 1][0] not in self.by_hash:
            first -= 1  # the parent left the tree: it is stored again, from this sequence
        parent: int | None = self.by_hash[keys[first - 1][0]] if first else None
        first_parent = parent
        stored: list[dict[str, Any]] = []
        for i in range(first, n):
            h, tokens = keys[i]
            cached = self.by_hash.get(h)
            if cached is not None and not stored:
                parent = first_parent = cached  # traverse the cached prefix
                continue
            block = blocks[i]
            if cached is not None or block in self.hash_of:
                break  # cannot happen for one sequence's own chain; never store twice
            self.by_hash[h] = block
            self.hash_of[block] = h
            self.parent_of[block] = parent
            if parent is not None:
                self.children.setdefault(parent, set()).add(block)
            if len(tokens) == self.block_size:
                self.full.add(block)
            stored.append({
                "type": "stored_block", "block_hash": h,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                           for t in tokens],
                "cache_level": 0, "priority": 35})
            if cache_salt is not None:
                stored[-1]["cache_salt"] = cache_salt
            parent = block
        if stored:
            self._emit({"type": "stored", "blocks": stored, "parent_hash":
                        None if first_parent is None else self.hash_of[first_parent]})

    def resident_full_hashes(self) -> set[int]:
        return {self.hash_of[b] for b in self.full}




def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimulatedEngine:
    """TRT-LLM's executor loop; ``tp_size`` ranks share one scheduler (rank 0's leader)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_kv_heads % cfg.tp_size:
            raise ValueError(f"num_kv_heads={cfg.num_kv_heads} is not divisible by "
                             f"tp_size={cfg.tp_size}")
        if cfg.processes and cfg.tp_size < 2:
            raise ValueError(f"processes=True needs tp_size > 1 (got tp_size={cfg.tp_size})")
        self.device = torch.device(cfg.device)
        self.block_size = bs = cfg.tokens_per_block
        self._group = f"sim-{uuid.uuid4().hex[:12]}"
        self._stats = EngineStats()
        self._reqs: dict[int, _Req] = {}
        self._order: list[int] = []  # FIFO of waiting request ids
        self._ids = itertools.count(1)
        self._aborts: set[int] = set()
        # overlap: the batch whose samples are not processed yet, as (request, its token
        # count after that batch's sampling, whether that sampling finished it)
        self._previous: list[tuple[_Req, int, bool]] = []
        self._outstanding = 0  # reserved blocks not yet allocated
        self.pool = _GpuPool(cfg.num_gpu_blocks, bs, cfg.max_seq_len)
        # PyExecutor keeps its KV cache manager here; the leader finds it through the frames of
        # build_connector_meta's caller, as it does in TensorRT-LLM.
        self.kv_cache_manager = SimKVCacheManager(self.pool, cfg.event_buffer_max_size)
        self._closed = False
        self.event_reader: KvEventDispatchReader | None = None
        env = dict(cfg.env)
        if cfg.processes and not env.get(LEADER_ZMQ_PUB_PORT):
            env[LEADER_ZMQ_PUB_PORT] = str(_free_tcp_port())
        self.env = env

        def args(rank: int) -> LlmArgs:
            return LlmArgs(KvCacheConfig(bs), ParallelConfig(rank, cfg.tp_size),
                           tensor_parallel_size=cfg.tp_size, kvbm_plugin_env=dict(env),
                           kvbm_plugin_group=self._group,
                           kvbm_plugin_inprocess=not cfg.processes,
                           kvbm_plugin_tier_events=cfg.tier_events if rank == 0 else None,
                           kvbm_plugin_event_serializer=KVCacheEventSerializer.serialize)

        self.ranks: list[LocalRank | RemoteRank] = []
        remote: list[RemoteRank] = []
        self.leader: KvbmConnectorLeader | None = None  # type: ignore[assignment]
        try:
            local_ranks = range(cfg.tp_size)
            if cfg.processes:
                # Children first: their start-up (a fresh interpreter) overlaps ours.
                local_ranks = range(1)
                remote = [RemoteRank(r, args(r), model_kwargs(cfg, r), cfg.num_gpu_blocks)
                          for r in range(1, cfg.tp_size)]
            # Bring-up exactly as py_executor_creator: per rank, worker and (rank 0) leader
            # are constructed concurrently on a 2-thread pool.
            pools = [ThreadPoolExecutor(max_workers=2) for _ in local_ranks]
            try:
                worker_futures = [pools[r].submit(KvbmConnectorWorker, args(r))
                                  for r in local_ranks]
                leader_future = pools[0].submit(KvbmConnectorLeader, args(0))
                workers = [f.result(timeout=60) for f in worker_futures]
                self.leader = leader_future.result(timeout=60)
            finally:
                for p in pools:
                    p.shutdown(wait=False)
            for r, worker in zip(local_ranks, workers, strict=True):
                model = KvModel(**model_kwargs(cfg, r))
                pool = torch.zeros(model.pool_shape(cfg.num_gpu_blocks),
                                   dtype=model.storage_dtype, device=self.device)
                self.ranks.append(LocalRank(r, worker, model, pool))
            for rank in remote:
                rank.wait_ready()
            self.ranks.extend(remote)
        except BaseException:
            for rank in remote:
                rank.shutdown(5.0)
            for rank in self.ranks:
                if isinstance(rank, LocalRank):
                    rank.shutdown(5.0)
            if self.leader is not None:
                self.leader.shutdown(5.0)
            raise
        self.workers: list[KvbmConnectorWorker] = [
            r.worker for r in self.ranks if isinstance(r, LocalRank)]
        self.kv_pools: list[torch.Tensor] = [
            r.pool for r in self.ranks if isinstance(r, LocalRank)]
        self.kv_cache_connector_manager = SimKvCacheConnectorManager(self.leader, self.ranks)
        if cfg.trtllm_event_reader:
            self.event_reader = KvEventDispatchReader(self, self.kv_cache_manager)

    # ------------------------------------------------------------------ public API

    def submit(self, prompt_tokens: list[int], max_new_tokens: int = 1, *,
               cache_salt: str | None = None) -> int:
        """Queue a request; returns its id."""
        if len(prompt_tokens) < 1 or max_new_tokens < 1:
            raise ValueError("a request needs at least one prompt token and one new token")
        needed = -(-(len(prompt_tokens) + max_new_tokens) // self.block_size)
        if needed > self.config.num_gpu_blocks:
            # TRT-LLM rejects such a request up front too; queueing it would wait forever.
            raise ValueError(f"request of {len(prompt_tokens)} prompt + {max_new_tokens} new "
                             f"tokens needs {needed} blocks; the GPU pool has "
                             f"num_gpu_blocks={self.config.num_gpu_blocks}")
        req_id = next(self._ids)
        self._reqs[req_id] = _Req(req_id, list(prompt_tokens), max_new_tokens, cache_salt,
                                  tokens=list(prompt_tokens), host_len=len(prompt_tokens))
        self._order.append(req_id)
        self._stats.requests_submitted += 1
        return req_id

    def abort(self, req_id: int) -> None:
        """Abort a request at the next iteration boundary (as TRT-LLM's cancel does)."""
        self._aborts.add(req_id)

    def run_until_idle(self, *, max_iterations: int = 1_000_000,
                       timeout_s: float = 60.0) -> None:
        """Step until every request is done and every transfer is reported; raises
        TimeoutError naming what is still pending.

        TRT-LLM makes no connector call while nothing is scheduled, so completion reports that
        arrive after the last batch would wait for the next request's iteration; a step with
        no request left runs :meth:`settle`, which stands for that iteration."""
        deadline = time.monotonic() + timeout_s
        for _ in range(max_iterations):
            if self.idle():
                return
            if self.step() == 0:
                time.sleep(0.0005)  # nothing to compute: waiting for transfer threads
            if time.monotonic() > deadline:
                break
        pending = {r.id: r.state for r in self._reqs.values() if r.state != DONE}
        assert self.leader is not None
        raise TimeoutError(f"engine not idle: requests {pending}, leader "
                           f"{self.leader.stats()}, ranks {[r.stats() for r in self.ranks]}")

    def settle(self) -> None:
        """The connector calls of an iteration with nothing to compute (what the next
        request's iteration does first): the leader applies the workers' reports and publishes
        the events flushed so far; every rank binds the metadata and starts its loads."""
        self._kv_connector_start_batch()
        for rank in self.ranks:
            rank.start_iteration([])
        for rank in self.ranks:
            rank.finish_iteration()

    def idle(self) -> bool:
        assert self.leader is not None
        return (not self._has_work() and all(r.idle() for r in self.ranks)
                and self.leader.stats()["ops_inflight"] == 0)

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
        """The truth per medium and dp rank: full blocks in the GPU pool, advertised host and
        disk blocks (unsigned u64 hashes)."""
        assert self.leader is not None
        return {"GPU": {0: self.pool.resident_full_hashes()},
                "CPU": {0: self.leader.resident_hashes("host")},
                "DISK": {0: self.leader.resident_hashes("disk")}}

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
        for rank in self.ranks:
            rank.shutdown(timeout)
        if self.leader is not None:
            self.leader.shutdown(timeout)

    def __enter__(self) -> SimulatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop

    def _has_work(self) -> bool:
        return bool(self._previous) or any(r.state != DONE for r in self._reqs.values())

    def step(self) -> int:
        """One executor iteration; returns the number of tokens the forward pass computed.

        The plain loop (``_executor_loop``) processes the batch it just ran; the overlap loop
        (``_executor_loop_overlap``) processes the previous iteration's batch after this
        iteration's forward. With no request left it only runs :meth:`settle`."""
        if not self._has_work() and not self._aborts:
            self.settle()
            return 0
        self._stats.iterations += 1
        self._process_aborts()
        batch, admitted = self._schedule()
        computed = 0
        ran: list[tuple[_Req, int, bool]] = []
        if batch or admitted:  # can_queue: the scheduled batch includes loading requests
            self._prepare_resources(batch)
            self._kv_connector_start_batch()
            items: BatchItems = [(r.computed, r.tokens[r.computed:r.computed + n],
                                  list(r.blocks)) for r, n in batch]
            for rank in reversed(self.ranks):  # other processes first: ranks run concurrently
                rank.start_iteration(items)
            for rank in self.ranks:
                rank.finish_iteration()
            if batch:
                self._stats.forward_passes += 1
                computed = sum(n for _, n in batch)
                ran = self._sample(batch)
        if self.config.overlap_scheduler:
            processed, self._previous = self._previous, ran
        else:
            processed = ran
        if processed:
            self._process_batch(processed)
        # Upstream flushes only in iterations that update resources; an iteration that only
        # admitted loading requests would carry its events (evictions) into the next one. Here
        # every iteration flushes, so an iteration's events are final once it returned.
        self.kv_cache_manager.flush_iteration_events()
        self._kv_connector_terminate_requests()
        return computed

    def _kv_connector_start_batch(self) -> None:
        """``PyExecutor._kv_connector_start_batch``: async-loading requests are already out of
        the batch; ``handle_metadata`` (build on rank 0, bind on every rank); each rank's
        ``start_load_kv`` runs as the first step of its iteration."""
        self.kv_cache_connector_manager.handle_metadata()

    def _schedule(self) -> tuple[list[tuple[_Req, int]], bool]:
        """Running requests first, then admissions; returns the batch to compute and whether
        any request was admitted (an admitted request that loads asynchronously is scheduled
        but leaves the batch before the forward)."""
        cfg = self.config
        budget = cfg.max_num_tokens
        batch: list[tuple[_Req, int]] = []
        admitted = False
        for r in self._reqs.values():
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
            if not self._admit(r):
                break
            self._order.pop(0)
            admitted = True
            if r.state == CONTEXT:
                n = min(len(r.prompt) - r.computed, budget)
                batch.append((r, n))
                budget -= n
        return batch, admitted

    def _prepare_resources(self, batch: list[tuple[_Req, int]]) -> None:
        """``KVCacheManager.prepare_resources``: a block slot per generated token, then
        ``build_scheduler_output`` from what the request objects show."""
        bs = self.block_size
        for r, n in batch:
            self._ensure_blocks(r, r.computed + n)
        entries: list[tuple[int, RequestData]] = []
        for r, n in batch:
            visible = r.tokens[:r.host_len]
            hashes = self._hashes(r, len(visible) // bs) if self.config.provide_block_hashes \
                else []
            # context: context_current_position; generation: len(tokens) - 1 (upstream)
            position = r.computed if r.state == CONTEXT else r.host_len - 1
            entries.append((r.id, RequestData(
                r.id, visible[r.reported_tokens:], r.blocks[r.reported_blocks:], position, n,
                hashes, cache_salt=r.salt)))
            r.reported_tokens, r.reported_blocks = len(visible), len(r.blocks)
        self.kv_cache_connector_manager.build_scheduler_output(entries)

    def _hashes(self, r: _Req, n_blocks: int) -> list[int]:
        out: list[int] = []
        parent = None
        for i in range(n_blocks):
            parent = trtllm_block_hash(parent, r.tokens[i * self.block_size:(i + 1) *
                                                        self.block_size], r.salt)
            out.append(parent)
        return out

    def _admit(self, r: _Req) -> bool:
        """Guaranteed-no-evict admission, device prefix match, connector match, allocation of
        the whole prompt (``add_sequence``), ``update_state_after_alloc`` (rank 0)."""
        bs = self.block_size
        total = -(-(len(r.prompt) + r.max_new) // bs)
        hashes = self._hashes(r, (len(r.prompt) - 1) // bs)
        matched = self.pool.match(hashes)
        need = total - len(matched)
        avail = self.pool.available() - sum(1 for b in matched if b in self.pool.cached) \
            - self._outstanding
        if avail < need:
            return False
        for b in matched:
            self.pool.acquire(b)
        r.blocks = list(matched)
        r.n_device = r.computed = len(matched) * bs
        r.reserved = need
        self._outstanding += need
        # The C++ request the connector sees carries the salt as its id only.
        r.llm_request = LlmRequest(r.id, list(r.tokens), cache_salt_id=(
            None if r.salt is None else cache_salt_id(r.salt)))
        r.llm_request.context_current_position = r.computed
        assert self.leader is not None
        manager = self.kv_cache_connector_manager
        before = self.leader.stats()
        n_conn = manager.get_num_new_matched_tokens(r.llm_request, r.computed)
        load_async = manager.is_loading(r.id)
        if r.computed + n_conn >= len(r.prompt):
            raise RuntimeError(f"connector matched the whole prompt of request {r.id}")
        after = self.leader.stats()
        r.host_hit = after["matched_host_tokens"] - before["matched_host_tokens"]
        r.disk_hit = after["matched_disk_tokens"] - before["matched_disk_tokens"]
        r.n_loaded = n_conn
        r.computed += n_conn
        r.llm_request.context_current_position = r.computed
        self._ensure_blocks(r, len(r.prompt))
        manager.update_state_after_alloc(r.llm_request, list(r.blocks))
        self._stats.prompt_tokens += len(r.prompt)
        self._stats.gpu_hit_tokens += r.n_device
        self._stats.host_hit_tokens += r.host_hit
        self._stats.disk_hit_tokens += r.disk_hit
        r.state = LOADING if n_conn and load_async else CONTEXT
        return True

    def _ensure_blocks(self, r: _Req, tokens: int) -> None:
        while len(r.blocks) * self.block_size < tokens:
            r.blocks.append(self.pool.alloc())
            if r.reserved > 0:
                r.reserved -= 1
                self._outstanding -= 1

    def _sample(self, batch: list[tuple[_Req, int]]) -> list[tuple[_Req, int, bool]]:
        """After the forward (device side): positions computed, full blocks stored for reuse,
        a token sampled where a sequence ended (``_update_request_states``: context →
        generation). The host sees the token when the batch is processed."""
        bs = self.block_size
        out: list[tuple[_Req, int, bool]] = []
        for r, n in batch:
            if r.state == CONTEXT:
                self._stats.computed_prefill_tokens += n
            r.computed += n
            full = r.computed // bs
            if full > r.stored_blocks:
                hashes = self._hashes(r, full)
                self.pool.store_blocks(r.blocks, [(hashes[i], r.tokens[i * bs:(i + 1) * bs])
                                                  for i in range(full)], r.stored_blocks,
                                       r.salt)
            r.stored_blocks = max(r.stored_blocks, full)
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

    def _process_batch(self, sampled: list[tuple[_Req, int, bool]]) -> None:
        """``_update_requests`` + ``_handle_responses``: the tokens sampled in that batch reach
        the request objects; requests that batch finished terminate."""
        for r, length, finished in sampled:
            if r.state not in (CONTEXT, GENERATION):
                continue  # aborted meanwhile
            r.host_len = max(r.host_len, length)
            if finished:
                self._terminate(r)

    def _process_aborts(self) -> None:
        for req_id in sorted(self._aborts):
            r = self._reqs.get(req_id)
            if r is None or r.state in (DONE, SAVING):
                self._aborts.discard(req_id)
                continue
            if r.state == LOADING:
                r.aborted = True  # terminated once its load is reported everywhere
                continue
            self._aborts.discard(req_id)
            r.aborted = True
            self._stats.requests_aborted += 1
            if r.state == WAITING:
                self._order.remove(req_id)
                r.state = DONE
            else:
                self._terminate(r)

    def _terminate(self, r: _Req) -> None:
        bs = self.block_size
        r.mismatches = self._verify(r)
        self._stats.kv_mismatches += r.mismatches
        if r.computed % bs and r.computed // bs < len(r.blocks):
            # TRT-LLM stores the last partial block for reuse too (partial event).
            i = r.computed // bs
            hashes = self._hashes(r, i)
            tokens = r.tokens[i * bs:r.computed]
            partial = trtllm_block_hash(hashes[-1] if hashes else None, tokens, r.salt)
            keys = [(hashes[j], r.tokens[j * bs:(j + 1) * bs]) for j in range(i)]
            self.pool.store_blocks(r.blocks, [*keys, (partial, tokens)], i, r.salt)
        assert r.llm_request is not None
        saving = self.kv_cache_connector_manager.request_finished(r.llm_request,
                                                                  list(r.blocks))
        if not r.aborted:
            self._stats.requests_finished += 1
        if saving:
            r.state = SAVING
        else:
            self._free(r)

    def _free(self, r: _Req) -> None:
        for b in reversed(r.blocks):  # last block first, as TRT-LLM's releaseBlocks
            self.pool.release(b)
        self._outstanding -= r.reserved
        r.reserved = 0
        r.state = DONE
        self.kv_cache_connector_manager.forget(r.id)

    def _kv_connector_terminate_requests(self) -> None:
        """``get_finished`` on every rank; act on ids every rank returned."""
        done_saving, done_loading = self.kv_cache_connector_manager.get_finished()
        for req_id in done_saving:
            self._free(self._reqs[req_id])
        for req_id in sorted(done_loading):
            r = self._reqs[req_id]
            if r.aborted:
                self._aborts.discard(req_id)
                self._stats.requests_aborted += 1
                self._terminate(r)
            else:
                r.state = CONTEXT

    def _verify(self, r: _Req) -> int:
        """Blocks of ``r`` (summed over ranks) whose KV differs from what the forward wrote."""
        return sum(rank.mismatches(r.computed, r.tokens, r.blocks) for rank in self.ranks)

    # ------------------------------------------------------------------ test helpers

    def block_ids(self, req_id: int) -> list[int]:
        return list(self._reqs[req_id].blocks)
