"""The simulated executor's bring-up: the connector's leader and workers, the ranks and the KV
cache manager, built in TensorRT-LLM's order.

Called once by :class:`kvbm_plugin.testing.engine.SimulatedEngine`'s constructor, on the
thread constructing it (a test's, the demo's main thread, a rank process's). As
``py_executor_creator`` does, per rank the worker and (rank 0) the leader are constructed
concurrently on a 2-thread pool; with ``processes=True`` ranks 1.. are child processes
(``testing.processes``) started first. Upstream builds the KV cache manager after the
connector, binding at executor start (after model load): the stand-in binds when built, so it
is built first unless the leader moves TensorRT-LLM's publisher
(``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT``). Whatever was built is shut down if a later
step fails.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.consolidator_config import TRTLLM_MOVED_ENDPOINT
from kvbm_plugin.testing.engine_config import EngineConfig
from kvbm_plugin.testing.fake_trtllm import (
    KvCacheConfig,
    KVCacheEventSerializer,
    LlmArgs,
    ParallelConfig,
)
from kvbm_plugin.testing.gpu_pool import GpuPool
from kvbm_plugin.testing.kv_events import SimKVCacheManager
from kvbm_plugin.testing.kvmodel import KvModel, model_kwargs
from kvbm_plugin.testing.processes import LocalRank, RemoteRank
from kvbm_plugin.testing.trtllm_stream import SimStreamingKVCacheManager, kv_cache_manager_for


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class BroughtUp:
    """What :func:`bring_up` built: the leader (rank 0), every rank (local ones first) and the
    KV cache manager PyExecutor keeps."""

    leader: KvbmConnectorLeader
    ranks: list[LocalRank | RemoteRank]
    kv_cache_manager: SimKVCacheManager | SimStreamingKVCacheManager


def bring_up(cfg: EngineConfig, gpu_pool: GpuPool, env: dict[str, str], group: str,
             device: torch.device) -> BroughtUp:
    """Build the leader, the ranks and the KV cache manager of one simulated engine (see the
    module docstring); ``env``: the plugin's variables every rank gets, ``group``: the
    in-process rendezvous name of this engine's ranks."""
    adp = cfg.attention_dp > 1
    bs = cfg.tokens_per_block
    manager_kw = {"event_buffer_max_size": cfg.event_buffer_max_size, "block_size": bs,
                  "dp_rank": cfg.dp_rank, "dp_size": cfg.attention_dp}

    def args(rank: int) -> LlmArgs:
        parallel = (ParallelConfig(cfg.dp_rank, cfg.attention_dp, enable_attention_dp=True)
                    if adp else ParallelConfig(rank, cfg.tp_size))
        return LlmArgs(KvCacheConfig(bs, kv_events_config=cfg.kv_events_config), parallel,
                       tensor_parallel_size=parallel.tp_size, kvbm_plugin_env=dict(env),
                       kvbm_plugin_group=group,
                       kvbm_plugin_inprocess=not cfg.processes,
                       kvbm_plugin_tier_events=cfg.tier_events if rank == 0 else None,
                       kvbm_plugin_event_serializer=KVCacheEventSerializer.serialize)

    # Upstream builds the KV cache manager after the connector, binding at executor start
    # (after model load): the stand-in binds when built, so first unless the leader moves it.
    leader_args, moves = args(0), bool((env.get(TRTLLM_MOVED_ENDPOINT) or "").strip())
    kv_cache_manager: SimKVCacheManager | SimStreamingKVCacheManager = None if moves \
        else kv_cache_manager_for(gpu_pool, leader_args.kv_cache_config, **manager_kw)
    ranks: list[LocalRank | RemoteRank] = []
    remote: list[RemoteRank] = []
    leader: KvbmConnectorLeader | None = None
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
            leader_future = pools[0].submit(KvbmConnectorLeader, leader_args)
            workers = [f.result(timeout=60) for f in worker_futures]
            leader = leader_future.result(timeout=60)
        finally:
            for p in pools:
                p.shutdown(wait=False)
        if moves:
            kv_cache_manager = kv_cache_manager_for(
                gpu_pool, leader_args.kv_cache_config, **manager_kw)
        for r, worker in zip(local_ranks, workers, strict=True):
            model = KvModel(**model_kwargs(cfg, r))
            pool = torch.zeros(model.pool_shape(cfg.num_gpu_blocks),
                               dtype=model.storage_dtype, device=device)
            ranks.append(LocalRank(r, worker, model, pool))
        for rank in remote:
            rank.wait_ready()
        ranks.extend(remote)
    except BaseException:
        for rank in remote:
            rank.shutdown(5.0)
        for rank in ranks:
            if isinstance(rank, LocalRank):
                rank.shutdown(5.0)
        if leader is not None:
            leader.shutdown(5.0)
        if isinstance(kv_cache_manager, SimStreamingKVCacheManager):
            kv_cache_manager.shutdown(5.0)
        raise
    return BroughtUp(leader, ranks, kv_cache_manager)
