"""A simulated TensorRT-LLM executor that drives the real KvbmConnectorLeader/Worker.

It follows TRT-LLM's PyExecutor + KvCacheConnectorManager order (research notes §1.6):

* bring-up: on each rank a ``ThreadPoolExecutor(2)`` builds the worker (and, on rank 0, the
  leader) concurrently; ``register_forward_pass_callable``; ``register_kv_caches``.
* per iteration: capacity scheduling (guaranteed-no-evict), for each new request a device
  prefix match, ``get_num_new_matched_tokens`` on rank 0 (result used by every rank),
  allocation, ``update_state_after_alloc`` on rank 0; async-loading requests leave the batch;
  ``build_connector_meta`` on rank 0, pickled and bound on every rank; ``start_load_kv``; the
  forward pass with ``wait_for_layer_load``/``save_kv_layer`` around each layer and the
  forward-pass callable at the end; ``wait_for_save``; ``request_finished`` on termination;
  ``get_finished`` on every rank, acting on an id once every rank has returned it.

The GPU pool reuses prefixes, evicts LRU leaf blocks, and emits TRT-LLM-shaped buffered KV
events (unsigned hashes, partial blocks, removals) into ``leader.event_sink``. The forward
writes ``f(position, layer, kv, head, dim, token)`` into the pool, so any onboarded block can be
checked exactly: every terminated request is verified (``stats().kv_mismatches``).
"""

from __future__ import annotations

import itertools
import pickle
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
from kvbm_plugin.testing.fake_trtllm import (
    KvCacheConfig,
    LlmArgs,
    LlmRequest,
    ParallelConfig,
    RequestData,
    SchedulerOutput,
    cache_salt_id,
    trtllm_block_hash,
)

_MOD = 251  # values stay exact integers in bf16/fp16/fp32


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


@dataclass
class EngineStats:
    iterations: int = 0
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
    tokens: list[int] = field(default_factory=list)
    state: str = WAITING
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    n_device: int = 0
    n_loaded: int = 0
    host_hit: int = 0
    disk_hit: int = 0
    generated: int = 0
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


class SimulatedEngine:
    """TRT-LLM's executor loop in one process; ``tp_size`` ranks share one scheduler."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        if cfg.num_kv_heads % cfg.tp_size:
            raise ValueError(f"num_kv_heads={cfg.num_kv_heads} is not divisible by "
                             f"tp_size={cfg.tp_size}")
        self.device = torch.device(cfg.device)
        self.block_size = bs = cfg.tokens_per_block
        self.heads_per_rank = cfg.num_kv_heads // cfg.tp_size
        self._group = f"sim-{uuid.uuid4().hex[:12]}"
        self._stats = EngineStats()
        self._reqs: dict[int, _Req] = {}
        self._order: list[int] = []  # FIFO of waiting request ids
        self._ids = itertools.count(1)
        self._aborts: set[int] = set()
        self._local_saved: list[set[int]] = [set() for _ in range(cfg.tp_size)]
        self._local_loaded: list[set[int]] = [set() for _ in range(cfg.tp_size)]
        self._new_saving: list[int] = []
        self._new_loading: list[int] = []
        self._outstanding = 0  # reserved blocks not yet allocated
        self.pool = _GpuPool(cfg.num_gpu_blocks, bs, cfg.max_seq_len)
        # PyExecutor keeps its KV cache manager here; the leader finds it through the frames of
        # build_connector_meta's caller, as it does in TensorRT-LLM.
        self.kv_cache_manager = self.pool
        self._closed = False

        def args(rank: int) -> LlmArgs:
            return LlmArgs(KvCacheConfig(bs), ParallelConfig(rank, cfg.tp_size),
                           tensor_parallel_size=cfg.tp_size, kvbm_plugin_env=dict(cfg.env),
                           kvbm_plugin_group=self._group, kvbm_plugin_inprocess=True,
                           kvbm_plugin_tier_events=cfg.tier_events)

        # Bring-up exactly as py_executor_creator: per rank, worker and (rank 0) leader are
        # constructed concurrently on a 2-thread pool.
        self.workers: list[KvbmConnectorWorker] = []
        self.leader: KvbmConnectorLeader
        pools = [ThreadPoolExecutor(max_workers=2) for _ in range(cfg.tp_size)]
        try:
            worker_futures = [pools[r].submit(KvbmConnectorWorker, args(r))
                              for r in range(cfg.tp_size)]
            leader_future = pools[0].submit(KvbmConnectorLeader, args(0))
            self.workers = [f.result(timeout=60) for f in worker_futures]
            self.leader = leader_future.result(timeout=60)
        finally:
            for p in pools:
                p.shutdown(wait=False)
        self._callables = [w.register_forward_pass_callable() for w in self.workers]
        hd = self.heads_per_rank * cfg.head_dim
        self.kv_pools: list[torch.Tensor] = []
        self._hd_base: list[torch.Tensor] = []
        for rank, worker in enumerate(self.workers):
            kv = torch.zeros((cfg.num_gpu_blocks, cfg.num_layers, 2, bs * hd), dtype=cfg.dtype,
                             device=self.device)
            self.kv_pools.append(kv)
            heads = torch.arange(self.heads_per_rank, device=self.device) + rank * \
                self.heads_per_rank
            dims = torch.arange(cfg.head_dim, device=self.device)
            self._hd_base.append((heads[:, None] * 3 + dims[None, :]).reshape(-1))
            worker.register_kv_caches(kv)

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
                                  tokens=list(prompt_tokens))
        self._order.append(req_id)
        self._stats.requests_submitted += 1
        return req_id

    def abort(self, req_id: int) -> None:
        """Abort a request at the next iteration boundary (as TRT-LLM's cancel does)."""
        self._aborts.add(req_id)

    def run_until_idle(self, *, max_iterations: int = 1_000_000,
                       timeout_s: float = 60.0) -> None:
        """Step until every request is done and every transfer is reported; raises
        TimeoutError naming what is still pending."""
        deadline = time.monotonic() + timeout_s
        for _ in range(max_iterations):
            if self.idle():
                return
            if self.step() == 0:
                time.sleep(0.0005)  # nothing to compute: waiting for transfer threads
            if time.monotonic() > deadline:
                break
        pending = {r.id: r.state for r in self._reqs.values() if r.state != DONE}
        raise TimeoutError(f"engine not idle: requests {pending}, leader "
                           f"{self.leader.stats()}, workers {[w.stats() for w in self.workers]}")

    def idle(self) -> bool:
        return (not self._has_work() and all(w.idle() for w in self.workers)
                and self.leader.stats()["ops_inflight"] == 0)

    def result(self, req_id: int) -> RequestResult:
        r = self._reqs[req_id]
        return RequestResult(r.id, r.state, list(r.tokens), r.n_device, r.host_hit, r.disk_hit,
                             r.mismatches)

    def stats(self) -> EngineStats:
        s = EngineStats(**vars(self._stats))
        s.bytes_offloaded = sum(w.stats()["bytes_offloaded"] for w in self.workers)
        s.bytes_onboarded = sum(w.stats()["bytes_onboarded"] for w in self.workers)
        return s

    def resident_blocks(self) -> dict[str, dict[int, set[int]]]:
        """The truth per medium and dp rank: full blocks in the GPU pool, advertised host and
        disk blocks (unsigned u64 hashes)."""
        return {"GPU": {0: self.pool.resident_full_hashes()},
                "CPU": {0: self.leader.resident_hashes("host")},
                "DISK": {0: self.leader.resident_hashes("disk")}}

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            w.shutdown(timeout)
        self.leader.shutdown(timeout)

    def __enter__(self) -> SimulatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop

    def _has_work(self) -> bool:
        return any(r.state != DONE for r in self._reqs.values())

    def step(self) -> int:
        """One executor iteration; returns the number of tokens the forward pass computed."""
        cfg, bs = self.config, self.block_size
        self._stats.iterations += 1
        self._process_aborts()
        budget = cfg.max_num_tokens
        batch: list[tuple[_Req, int]] = []
        for r in self._reqs.values():  # running requests first
            if len(batch) >= cfg.max_batch_size or budget <= 0:
                break
            if r.state == GENERATION:
                batch.append((r, 1))
                budget -= 1
            elif r.state == CONTEXT:
                n = min(len(r.tokens) - r.computed, budget)
                batch.append((r, n))
                budget -= n
        while self._order and len(batch) < cfg.max_batch_size and budget > 0:
            r = self._reqs[self._order[0]]
            if not self._admit(r, budget):
                break
            self._order.pop(0)
            if r.state == CONTEXT:
                n = min(len(r.tokens) - r.computed, budget)
                batch.append((r, n))
                budget -= n
        for r, n in batch:
            self._ensure_blocks(r, r.computed + n)
        output = SchedulerOutput()
        for r, n in batch:
            hashes = self._hashes(r, len(r.tokens) // bs) if cfg.provide_block_hashes else []
            if r.reported_tokens == 0:
                rd = RequestData(r.id, list(r.tokens), list(r.blocks),
                                 r.computed - r.n_loaded, n, hashes, cache_salt=r.salt)
                output.new_requests.append(rd)
            else:
                rd = RequestData(r.id, r.tokens[r.reported_tokens:],
                                 r.blocks[r.reported_blocks:], r.computed, n, hashes,
                                 cache_salt=r.salt)
                output.cached_requests.append(rd)
            r.reported_tokens, r.reported_blocks = len(r.tokens), len(r.blocks)
        meta = pickle.dumps(self.leader.build_connector_meta(output))
        streams = [self._stream() for _ in self.workers]
        for w in self.workers:
            w.bind_connector_meta(pickle.loads(meta))
        for w, s in zip(self.workers, streams, strict=False):
            w.start_load_kv(s)
        for rank, w in enumerate(self.workers):
            self._forward(rank, w, streams[rank], batch)
        for w, s in zip(self.workers, streams, strict=False):
            w.wait_for_save(s)
        for r, n in batch:
            self._advance(r, n)
        self._get_finished()
        return sum(n for _, n in batch)

    def _stream(self) -> Any:
        return torch.cuda.current_stream() if self.device.type == "cuda" else None

    def _hashes(self, r: _Req, n_blocks: int) -> list[int]:
        out: list[int] = []
        parent = None
        for i in range(n_blocks):
            parent = trtllm_block_hash(parent, r.tokens[i * self.block_size:(i + 1) *
                                                        self.block_size], r.salt)
            out.append(parent)
        return out

    def _admit(self, r: _Req, budget: int) -> bool:
        """Guaranteed-no-evict admission, device prefix match, connector match, allocation."""
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
        before = self.leader.stats()
        n_conn, load_async = self.leader.get_num_new_matched_tokens(r.llm_request, r.computed)
        if n_conn == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if r.computed + n_conn >= len(r.prompt):
            raise RuntimeError(f"connector matched the whole prompt of request {r.id}")
        after = self.leader.stats()
        r.host_hit = after["matched_host_tokens"] - before["matched_host_tokens"]
        r.disk_hit = after["matched_disk_tokens"] - before["matched_disk_tokens"]
        r.n_loaded = n_conn
        r.computed += n_conn
        r.llm_request.context_current_position = r.computed
        self._ensure_blocks(r, min(len(r.prompt), r.computed + max(1, budget)))
        self.leader.update_state_after_alloc(r.llm_request, list(r.blocks))
        self._stats.prompt_tokens += len(r.prompt)
        self._stats.gpu_hit_tokens += r.n_device
        self._stats.host_hit_tokens += r.host_hit
        self._stats.disk_hit_tokens += r.disk_hit
        if n_conn and load_async:
            r.state = LOADING
            self._new_loading.append(r.id)
        else:
            r.state = CONTEXT
        return True

    def _ensure_blocks(self, r: _Req, tokens: int) -> None:
        while len(r.blocks) * self.block_size < tokens:
            r.blocks.append(self.pool.alloc())
            if r.reserved > 0:
                r.reserved -= 1
                self._outstanding -= 1

    def _values(self, rank: int, layer: int, positions: torch.Tensor,
                tokens: torch.Tensor) -> torch.Tensor:
        """f(position, layer, kv, head, dim, token) for n tokens: [n, 2, heads*dim]."""
        base = (positions * 7 + layer * 13 + tokens * 11)[:, None, None]
        kv = torch.arange(2, device=self.device)[None, :, None] * 5
        return ((base + kv + self._hd_base[rank][None, None, :]) % _MOD).to(self.config.dtype)

    def _forward(self, rank: int, worker: KvbmConnectorWorker, stream: Any,
                 batch: list[tuple[_Req, int]]) -> None:
        bs = self.block_size
        kv_pool = self.kv_pools[rank]
        hd = self.heads_per_rank * self.config.head_dim
        for layer in range(self.config.num_layers):
            worker.wait_for_layer_load(layer, stream)
            for r, n in batch:
                pos = torch.arange(r.computed, r.computed + n, device=self.device)
                tok = torch.tensor(r.tokens[r.computed:r.computed + n], device=self.device)
                vals = self._values(rank, layer, pos, tok)
                for i in range(n):
                    p = r.computed + i
                    off = (p % bs) * hd
                    kv_pool[r.blocks[p // bs], layer, :, off:off + hd] = vals[i]
            worker.save_kv_layer(layer, stream)
        self._callables[rank]()

    def _advance(self, r: _Req, n: int) -> None:
        bs = self.block_size
        if r.state == CONTEXT:
            self._stats.computed_prefill_tokens += n
        r.computed += n
        # Blocks that became full are stored for reuse (stored events).
        full = r.computed // bs
        if full > r.stored_blocks:
            hashes = self._hashes(r, full)
            self.pool.store_blocks(r.blocks, [(hashes[i], r.tokens[i * bs:(i + 1) * bs])
                                              for i in range(full)], r.stored_blocks,
                                   r.salt)
        r.stored_blocks = max(r.stored_blocks, full)
        if r.computed >= len(r.tokens):  # end of context, or a decode step: sample a token
            last = r.tokens[-1]
            r.tokens.append((last * 31 + len(r.tokens) * 7 + 3) % self.config.vocab_size)
            r.generated += 1
            r.state = GENERATION
            if r.generated >= r.max_new:
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
        saving = self.leader.request_finished(r.llm_request, list(r.blocks))
        if not r.aborted:
            self._stats.requests_finished += 1
        if saving:
            r.state = SAVING
            self._new_saving.append(r.id)
        else:
            self._free(r)

    def _free(self, r: _Req) -> None:
        for b in reversed(r.blocks):  # last block first, as TRT-LLM's releaseBlocks
            self.pool.release(b)
        self._outstanding -= r.reserved
        r.reserved = 0
        r.state = DONE

    def _get_finished(self) -> None:
        saving, loading = self._new_saving, self._new_loading
        self._new_saving, self._new_loading = [], []
        for rank, w in enumerate(self.workers):
            saved, loaded = w.get_finished(list(saving), list(loading))
            self._local_saved[rank].update(saved)
            self._local_loaded[rank].update(loaded)
        done_saving = set.intersection(*self._local_saved)
        done_loading = set.intersection(*self._local_loaded)
        for s in self._local_saved:
            s.difference_update(done_saving)
        for s in self._local_loaded:
            s.difference_update(done_loading)
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
        """Blocks of ``r`` (every rank) whose KV differs from what the forward wrote."""
        bs = self.block_size
        hd = self.heads_per_rank * self.config.head_dim
        bad = 0
        for rank, kv_pool in enumerate(self.kv_pools):
            for i in range(-(-r.computed // bs)):
                n = min(bs, r.computed - i * bs)
                pos = torch.arange(i * bs, i * bs + n, device=self.device)
                tok = torch.tensor(r.tokens[i * bs:i * bs + n], device=self.device)
                for layer in range(self.config.num_layers):
                    want = self._values(rank, layer, pos, tok).permute(1, 0, 2).reshape(2, -1)
                    got = kv_pool[r.blocks[i], layer, :, :n * hd]
                    if not torch.equal(got, want):
                        bad += 1
                        break
        return bad

    # ------------------------------------------------------------------ test helpers

    def block_ids(self, req_id: int) -> list[int]:
        return list(self._reqs[req_id].blocks)
