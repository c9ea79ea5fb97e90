"""A simulated TensorRT-LLM executor for a sliding-window model (VSWA: two KV layer groups, a
sliding one and a full-attention one, with different page sizes), driving the connector
through TensorRT-LLM's per-group calls.

Follows, call for call, the connector manager of ``tensorrt_llm/_torch/pyexecutor/connectors/
kv_cache_connector.py`` @ 035ab91cad04 (stored id 68382362537) under KVCacheManagerV2 with
several layer groups, and the plain executor loop (``_executor_loop`` of ``py_executor.py`` @
0004396720054) where it touches the connector:

1. bring-up: every rank's worker gets ``register_kv_cache_layout(layout)`` (never
   ``register_kv_caches``: ``KvCacheConnectorWorker.register_kv_cache_layout``'s default
   cannot describe several groups);
2. per new request, ``get_num_new_matched_tokens(request, 0)`` (no device prefix reuse here:
   ``enable_block_reuse=False``), then the allocation, then
   ``update_state_after_alloc_by_layer_group(request, ids_by_group)``; a sliding group's list
   keeps every ordinal, -1 where its window has passed (``BAD_PAGE_INDEX``);
3. ``build_scheduler_output``: one ``RequestData`` per scheduled request, ``new_block_ids``
   empty and ``new_block_ids_by_layer_group`` each group's newly seen entries
   (``KvCacheConnectorSchedulerOutputRequest.update_and_build_data``: ``indices[len(seen):]``,
   so an entry that turns -1 later is never reported again); ``handle_metadata``;
   ``take_scheduled_requests_pending_load``; ``start_load_kv``; the forward with the layer
   hooks; ``wait_for_save``;
4. a finished request: ``request_finished(req, [], ids_by_group)``, which calls the
   scheduler's ``request_finished_by_layer_group``; True keeps its pages until every rank's
   ``get_finished`` returns it;
5. every pass: ``get_finished``; at the next allocation a sliding group frees the pages its
   window passed (a page then goes to whichever request allocates next).

What it checks, per request: every group's KV bytes (after a load and at the end) equal what
the forward writes (:attr:`VswaStats.kv_mismatches`); no metadata op addresses a page that is
not a live page of its request (:attr:`VswaStats.dead_page_touches`); no sliding-group save
outside the window of the tokens computed by then (:attr:`VswaStats.window_violations`).

Ranks live in this process (TP: ``tp_size`` workers, each its heads' share; attention DP:
one engine per rank, each its own leader). One thread drives it.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbm_plugin.connector.meta import ConnectorMetadata, save_ops
from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.leader.layer_groups import LayerGroups
from kvbm_plugin.testing.connector_manager import SimKvCacheConnectorManager
from kvbm_plugin.testing.fake_layout import (
    KvCacheBufferRef,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)
from kvbm_plugin.testing.fake_trtllm import (
    KvCacheConfig,
    LlmArgs,
    LlmRequest,
    ParallelConfig,
    RequestData,
    trtllm_block_chain,
)

_MOD = 251
SLIDING, FULL = 0, 1  # layer group ids (V2 numbers life cycles; the full one need not be 0)


@dataclass
class VswaConfig:
    """Shape of the simulated sliding-window model and engine."""

    tokens_per_block: int = 4
    window: int = 16  # the sliding group's attention window, tokens
    max_seq_len: int = 4096  # the full group's window (max_attention_window entry)
    sliding_layers: int = 2  # the groups differ in layers, so in bytes per page; 0: no
    # sliding group, one full-attention group on the flat calls (the benchmarks' baseline)
    full_layers: int = 1
    num_kv_heads: int = 2  # total; each TP rank holds num_kv_heads // tp_size
    head_dim: int = 4
    num_pages: int = 64  # per group
    tp_size: int = 1
    attention_dp: int = 1  # attention-DP ranks; this engine is dp_rank's own executor
    dp_rank: int = 0
    max_batch_size: int = 8
    device: str = "cpu"  # "cuda": the page pools on the GPU (pinned host tier, side stream)
    env: Mapping[str, str] = field(default_factory=dict)  # DYN_KVBM_* for the connector
    tier_events: Any = None  # the leader's tier-event recorder (kvbm_plugin_tier_events)

    @property
    def windows(self) -> list[int]:
        """``kv_cache_config.max_attention_window``: one entry per layer, cyclic."""
        return [self.window] * self.sliding_layers + [self.max_seq_len] * self.full_layers

    @property
    def grouped(self) -> bool:
        return self.sliding_layers > 0


@dataclass
class VswaStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    loaded_tokens: int = 0  # prompt tokens onboarded by the connector
    kv_mismatches: int = 0  # (group, block) pages whose bytes differ from the forward's
    pages_checked: int = 0
    dead_page_touches: int = 0  # op pages that were no live page of their request
    window_violations: int = 0  # sliding-group saves outside the computed window
    sliding_saves: int = 0
    full_saves: int = 0


@dataclass
class _Req:
    id: int
    tokens: list[int]
    prompt_len: int
    max_new: int
    salt: str | None
    pages: list[list[int]] = field(default_factory=lambda: [[], []])  # by group, -1: none
    seen: list[int] = field(default_factory=lambda: [0, 0])  # entries reported per group
    reported_tokens: int = 0
    computed: int = 0
    loaded: int = 0
    generated: int = 0
    state: str = "waiting"  # waiting, loading, running, saving, done
    llm: LlmRequest | None = None


class _Rank:
    """One TP rank: its worker and its two page pools (its share of the heads)."""

    def __init__(self, rank: int, worker: KvbmConnectorWorker, cfg: VswaConfig) -> None:
        self.rank, self.worker, self.cfg = rank, worker, cfg
        heads = cfg.num_kv_heads // cfg.tp_size
        self.hd = heads * cfg.head_dim
        bs = cfg.tokens_per_block
        head_ids = torch.arange(heads) + rank * heads
        self._hd_base = (head_ids[:, None] * 3 + torch.arange(cfg.head_dim)[None, :]).reshape(-1)
        self.layers = {SLIDING: list(range(cfg.sliding_layers)),
                       FULL: list(range(cfg.sliding_layers,
                                        cfg.sliding_layers + cfg.full_layers))}
        self.device = dev = torch.device(cfg.device)
        self._hd_base = self._hd_base.to(dev)
        self.pools = {g: torch.zeros(cfg.num_pages, len(ls), 2, bs * self.hd, device=dev)
                      for g, ls in self.layers.items() if ls}
        groups = []
        for g, window in ((SLIDING, cfg.window), (FULL, None)) if cfg.grouped else ((FULL, None),):
            buffers = tuple(KvCacheBufferRef(layer, role) for layer in self.layers[g]
                            for role in ("key", "value"))
            groups.append(KvCacheLayerGroupLayout(g if cfg.grouped else 0, tuple(self.layers[g]),
                                                  window,
                                                  (KvCacheRegion.over(self.pools[g], buffers),)))
        self.layout = KvCacheLayout(bs, tuple(groups), torch.float32)

    def values(self, layer: int, start: int, tokens: list[int]) -> torch.Tensor:
        dev = self.device
        pos = torch.arange(start, start + len(tokens), device=dev)
        base = (pos * 7 + layer * 13 + torch.tensor(tokens, device=dev) * 11)[:, None, None]
        kv = torch.arange(2, device=dev)[None, :, None] * 5
        return ((base + kv + self._hd_base[None, None, :]) % _MOD).to(torch.float32)

    def write(self, r: _Req, start: int, n: int) -> None:
        """The forward: KV of tokens ``[start, start + n)`` into each group's live pages."""
        bs, hd = self.cfg.tokens_per_block, self.hd
        toks = r.tokens[start:start + n]
        for g in self.pools:
            for li, layer in enumerate(self.layers[g]):
                vals = self.values(layer, start, toks)
                for i in range(n):
                    p = start + i
                    page = r.pages[g][p // bs]
                    if page >= 0:
                        off = (p % bs) * hd
                        self.pools[g][page, li, :, off:off + hd] = vals[i]

    def mismatches(self, r: _Req, upto: int) -> tuple[int, int]:
        """(pages checked, pages differing) over every group's live pages below ``upto``."""
        bs, hd = self.cfg.tokens_per_block, self.hd
        checked = bad = 0
        for g in self.pools:
            layers = self.layers[g]
            for i, page in enumerate(r.pages[g]):
                n = min(bs, upto - i * bs)
                if page < 0 or n <= 0:
                    continue
                checked += 1
                for li, layer in enumerate(layers):
                    want = self.values(layer, i * bs, r.tokens[i * bs:i * bs + n])
                    got = self.pools[g][page, li, :, :n * hd]
                    if not torch.equal(got, want.permute(1, 0, 2).reshape(2, -1)):
                        bad += 1
                        break
        return checked, bad

    # the manager's rank interface (testing.connector_manager)
    def bind(self, meta_bytes: bytes) -> None:
        self.worker.bind_connector_meta(pickle.loads(meta_bytes))

    def start_get_finished(self, saving: list[int], loading: list[int]) -> None:
        self._finished = self.worker.get_finished(saving, loading)

    def finish_get_finished(self) -> tuple[list[int], list[int]]:
        return self._finished

    def load_errors(self) -> list[int]:
        return []


class VswaEngine:
    """The executor loop of one engine (one attention-DP rank, or the whole TP group)."""

    def __init__(self, config: VswaConfig | None = None) -> None:
        self.config = cfg = config or VswaConfig()
        if cfg.num_kv_heads % cfg.tp_size:
            raise ValueError(f"num_kv_heads={cfg.num_kv_heads} is not divisible by "
                             f"tp_size={cfg.tp_size}")
        adp = cfg.attention_dp > 1
        self.stats = VswaStats()
        self._group = f"vswa-{uuid.uuid4().hex[:12]}"
        self._ids = iter(range(1 + cfg.dp_rank * (1 << 40), 1 << 62))
        self._reqs: dict[int, _Req] = {}
        # The lowest page first: a copy through a -1 index lands on the last page (upstream's
        # strided view resolves -1 there), free and zero until the pool is nearly full.
        self._free = {g: list(range(cfg.num_pages - 1, -1, -1)) for g in (SLIDING, FULL)}
        self._owner: dict[tuple[int, int], tuple[int, int]] = {}  # (group, page) -> (req, i)
        self.groups = LayerGroups((cfg.window, None), cfg.tokens_per_block)  # (for callers)

        def args(rank: int) -> LlmArgs:
            parallel = (ParallelConfig(cfg.dp_rank, cfg.attention_dp, enable_attention_dp=True)
                        if adp else ParallelConfig(rank, cfg.tp_size))
            return LlmArgs(KvCacheConfig(cfg.tokens_per_block, enable_block_reuse=False,
                                         max_attention_window=cfg.windows), parallel,
                           tensor_parallel_size=parallel.tp_size, kvbm_plugin_env=dict(cfg.env),
                           kvbm_plugin_group=self._group,
                           kvbm_plugin_tier_events=cfg.tier_events if rank == 0 else None)

        self.ranks: list[_Rank] = []
        self.leader: KvbmConnectorLeader | None = None
        try:
            for r in range(1 if adp else cfg.tp_size):
                rank = _Rank(r, KvbmConnectorWorker(args(r)), cfg)
                self.ranks.append(rank)
                rank.worker.register_kv_cache_layout(rank.layout)
            self.leader = KvbmConnectorLeader(args(0))
            self.manager = SimKvCacheConnectorManager(
                self.leader, self.ranks, attention_dp_rank=cfg.dp_rank if adp else None)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ public API

    def submit(self, prompt: list[int], max_new: int = 1, *, cache_salt: str | None = None
               ) -> int:
        if not prompt or max_new < 1:
            raise ValueError("a request needs at least one prompt token and one new token")
        req_id = next(self._ids)
        self._reqs[req_id] = _Req(req_id, list(prompt), len(prompt), max_new, cache_salt)
        return req_id

    def run_until_idle(self, max_iterations: int = 10_000) -> None:
        for _ in range(max_iterations):
            if not self.active():
                return
            self.step()
        raise RuntimeError(f"not idle after {max_iterations} iterations")

    def active(self) -> bool:
        return any(r.state != "done" for r in self._reqs.values())

    def loaded_tokens(self, req_id: int) -> int:
        return self._reqs[req_id].loaded

    def tokens(self, req_id: int) -> list[int]:
        """The request's tokens: its prompt and what it generated."""
        return list(self._reqs[req_id].tokens)

    def shutdown(self) -> None:
        for rank in self.ranks:
            rank.worker.shutdown(10.0)
        if self.leader is not None:
            self.leader.shutdown(5.0)
            self.leader = None

    def __enter__(self) -> VswaEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop

    def step(self) -> None:
        """One pass of the plain executor loop (see the module docstring)."""
        cfg, bs, manager = self.config, self.config.tokens_per_block, self.manager
        self._release_passed_windows()
        batch: list[tuple[_Req, int]] = []
        for r in self._reqs.values():
            if r.state == "running":
                batch.append((r, len(r.tokens) - r.computed))
        new: list[_Req] = []
        for r in self._reqs.values():
            need = -(-(len(r.tokens) + r.max_new) // bs)
            if r.state != "waiting" or len(batch) + len(new) >= cfg.max_batch_size \
                    or min(len(f) for f in self._free.values()) < need:
                continue
            r.llm = LlmRequest(r.id, list(r.tokens), r.salt)
            n = manager.get_num_new_matched_tokens(r.llm, 0)
            r.computed = r.loaded = n
            self.stats.prompt_tokens += r.prompt_len
            self.stats.loaded_tokens += n
            self._allocate(r, len(r.tokens))
            new.append(r)
        for r in new:
            assert r.llm is not None
            if cfg.grouped:
                manager.update_state_after_alloc_by_layer_group(r.llm,
                                                                [list(p) for p in r.pages])
            else:  # one group: the flat form (upstream's base default folds it back there)
                manager.update_state_after_alloc(r.llm, list(r.pages[FULL]))
            loading = manager.is_loading(r.id)
            r.state = "loading" if loading else "running"
            batch.append((r, len(r.tokens) - r.computed))
        for r, _ in batch:
            self._allocate(r, len(r.tokens))
        entries = []
        for r, n in batch:
            new_ids = [r.pages[g][r.seen[g]:] for g in (SLIDING, FULL)]
            entries.append((r.id, RequestData(
                r.id, r.tokens[r.reported_tokens:], [] if cfg.grouped else new_ids[FULL],
                r.computed, n, trtllm_block_chain(r.tokens, bs, r.salt), cache_salt=r.salt,
                new_block_ids_by_layer_group=new_ids if cfg.grouped else [])))
            if r.id not in manager.pending_load_ids():
                r.seen = [len(p) for p in r.pages]
                r.reported_tokens = len(r.tokens)
            if r.state == "loading":
                r.computed = 0  # the position the request object shows until the load ends
        manager.build_scheduler_output(entries)
        manager.handle_metadata()
        loading_ids = manager.take_scheduled_requests_pending_load([r.id for r, _ in batch])
        batch = [(r, n) for r, n in batch if r.id not in loading_ids and r.state == "running"]
        self._check_ops(batch)
        for rank in self.ranks:
            self._forward(rank, batch)
        for r, n in batch:
            r.computed += n
            last = r.tokens[-1]
            r.tokens.append((last * 31 + len(r.tokens) * 7 + 3) % 1000)
            r.generated += 1
            if r.generated >= r.max_new:
                self._finish(r)
        done_saving, done_loading = manager.get_finished()
        for req_id in done_saving:
            self._free_request(self._reqs[req_id])
        for req_id in sorted(done_loading):
            r = self._reqs[req_id]
            if r.state == "loading":
                r.state, r.computed = "running", r.loaded
                self._verify(r, r.loaded)  # the onboarded blocks, every group
        self._check_free_pages()

    # ------------------------------------------------------------------ internals

    def _attended(self, i: int, query: int) -> bool:
        """Whether a sliding-window query at token position ``query`` attends to some key of
        block ``i`` (keys ``query - window + 1 .. query``). Written here from the attention
        rule, not the leader's :meth:`LayerGroups.in_window`: the pages this engine frees and
        the saves it checks must not move with the code under test."""
        return (i + 1) * self.config.tokens_per_block - 1 >= query - self.config.window + 1

    def _allocate(self, r: _Req, tokens: int) -> None:
        """Pages for every block up to ``tokens``: the full group always; the sliding group
        only where the block is within the window of the request's computed position."""
        bs = self.config.tokens_per_block
        while len(r.pages[FULL]) * bs < tokens:
            i = len(r.pages[FULL])
            for g in (SLIDING, FULL):
                live = g == FULL or (self.config.grouped and self._attended(i, r.computed))
                page = self._free[g].pop() if live else -1
                if page >= 0:
                    self._owner[(g, page)] = (r.id, i)
                r.pages[g].append(page)

    def _release_passed_windows(self) -> None:
        """V2 at allocation: a sliding group frees the pages no query of the coming pass
        attends to (the first one, at the computed position, reaches back furthest)."""
        for r in self._reqs.values():
            if r.state != "running":  # a saving request holds its pages until get_finished
                continue
            for i, page in enumerate(r.pages[SLIDING]):
                if page >= 0 and not self._attended(i, r.computed):
                    r.pages[SLIDING][i] = -1
                    self._release(SLIDING, page)

    def _release(self, group: int, page: int) -> None:
        del self._owner[(group, page)]
        for rank in self.ranks:
            rank.pools[group][page] = 0
        self._free[group].append(page)

    def _forward(self, rank: _Rank, batch: list[tuple[_Req, int]]) -> None:
        """One rank's part, in TensorRT-LLM's order: ``start_load_kv``; per layer
        ``wait_for_layer_load``, the layer, ``save_kv_layer``; ``wait_for_save``."""
        worker = rank.worker
        worker.start_load_kv(None)
        if not batch:
            return
        layers = sorted(rank.layers[SLIDING] + rank.layers[FULL])
        for layer in layers:
            worker.wait_for_layer_load(layer, None)
            if layer == layers[-1]:
                for r, n in batch:
                    rank.write(r, r.computed, n)
            worker.save_kv_layer(layer, None)
        worker.wait_for_save(None)

    def _check_ops(self, batch: list[tuple[_Req, int]]) -> None:
        """Every page the bound metadata names is a live page of its request; a sliding
        page is saved only within the window of the tokens computed after this forward."""
        meta = self.ranks[0].worker.get_connector_meta()
        if not isinstance(meta, ConnectorMetadata):
            return
        after = {r.id: r.computed + n for r, n in batch}
        for op in save_ops(meta.saves):
            for g, page in enumerate(op.pages):
                if page < 0:
                    continue
                owner = self._owner.get((g, page))
                if owner is None or owner[0] != op.req_id:
                    self.stats.dead_page_touches += 1
                    continue
                if g == SLIDING:
                    self.stats.sliding_saves += 1
                    computed = after.get(op.req_id, self._reqs[op.req_id].computed)
                    if not self._attended(owner[1], computed - 1):  # the last one computed
                        self.stats.window_violations += 1
                else:
                    self.stats.full_saves += 1
        for load in meta.loads:
            for copy in load.copies:
                for g, page in enumerate(copy.pages):
                    owner = self._owner.get((g, page)) if page >= 0 else None
                    if page >= 0 and (owner is None or owner[0] != load.req_id):
                        self.stats.dead_page_touches += 1

    def _check_free_pages(self) -> None:
        """A free page stays zero (zeroed when freed): a copy into a page its request does
        not hold (a -1 index, a released page) shows here, and is counted."""
        for rank in self.ranks:
            for g, pool in rank.pools.items():
                free = self._free[g]
                dirty = pool[free].flatten(1).abs().sum(1).nonzero().flatten().tolist()
                if dirty:
                    self.stats.dead_page_touches += len(dirty)
                    pool[[free[i] for i in dirty]] = 0

    def _verify(self, r: _Req, upto: int) -> None:
        for rank in self.ranks:
            checked, bad = rank.mismatches(r, upto)
            self.stats.pages_checked += checked
            self.stats.kv_mismatches += bad

    def _finish(self, r: _Req) -> None:
        self._verify(r, r.computed)
        self.stats.requests_finished += 1
        assert r.llm is not None
        r.llm.is_finished = True
        finished = (self.manager.request_finished(r.llm, [], [list(p) for p in r.pages])
                    if self.config.grouped
                    else self.manager.request_finished(r.llm, list(r.pages[FULL])))
        if finished:
            r.state = "saving"
        else:
            self._free_request(r)

    def _free_request(self, r: _Req) -> None:
        for g, pages in enumerate(r.pages):
            for page in pages:
                if page >= 0:
                    self._release(g, page)
        r.pages = [[], []]
        r.state = "done"
        r.llm = None
        self.manager.forget(r.id)
