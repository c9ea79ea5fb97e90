"""Reading what the connector needs from TensorRT-LLM's ``llm_args`` (duck-typed, torch-free).

Test hooks (attributes a real ``TorchLlmArgs`` never has, so production reads ``os.environ``
and the MPI mapping): ``kvbm_plugin_env`` (a mapping used instead of ``os.environ``),
``kvbm_plugin_group`` (names one engine instance, so several simulated engines can live in one
process), ``kvbm_plugin_inprocess`` (every rank's worker lives in this process: completion
reports need no socket) and ``kvbm_plugin_event_serializer`` (converts a simulated engine's
event objects to dicts where TensorRT-LLM's ``KVCacheEventSerializer`` is not importable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbm_plugin.consolidator_config import (
    LEADER_ZMQ_HOST,
    LEADER_ZMQ_PUB_PORT,
    ConfigError,
    parse_port,
)


@dataclass(frozen=True)
class Parallel:
    """Where this process stands. Under attention DP (``mapping.enable_attention_dp``) every
    rank is its own group of one: its leader schedules its own requests and waits for its own
    worker's reports only (``connectors/kv_cache_connector.py`` @ 035ab91cad04: no broadcast,
    no allgather in ``get_finished``; "each request has one local worker"), while TensorRT-LLM's
    mapping still reports ``tp_size`` = the number of attention-DP ranks."""

    rank: int  # this process's global rank
    tp_size: int  # ranks that hold a shard of every block (all must report an op)
    dp_rank: int  # attention-DP rank stamped on events (0 without attention DP)
    dp_size: int = 1  # attention-DP ranks (1 without attention DP)

    @property
    def attention_dp(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_rank(self) -> int:
        """This rank's place in its group (what its completion reports carry)."""
        return 0 if self.attention_dp else self.rank


def env_of(llm_args: Any) -> Mapping[str, str]:
    env = getattr(llm_args, "kvbm_plugin_env", None)
    return os.environ if env is None else env


def block_size_of(llm_args: Any) -> int:
    kv_cache_config = getattr(llm_args, "kv_cache_config", None)
    tokens = getattr(kv_cache_config, "tokens_per_block", None)
    if not isinstance(tokens, int) or tokens <= 0:
        raise ConfigError(f"llm_args.kv_cache_config.tokens_per_block={tokens!r} must be a "
                          "positive integer")
    return tokens


def parallel_of(llm_args: Any) -> Parallel:
    """Rank and sizes from ``llm_args.parallel_config.to_mapping()`` (TRT-LLM's Mapping)."""
    mapping = None
    parallel_config = getattr(llm_args, "parallel_config", None)
    if parallel_config is not None and hasattr(parallel_config, "to_mapping"):
        mapping = parallel_config.to_mapping()
    if mapping is not None:
        rank = int(getattr(mapping, "rank", 0))
        tp = int(getattr(mapping, "tp_size", getattr(mapping, "world_size", 1)))
        adp = bool(getattr(mapping, "enable_attention_dp", False))
    else:
        name = next((n for n in ("OMPI_COMM_WORLD_RANK", "PMI_RANK") if n in os.environ), None)
        value = "0" if name is None else os.environ[name]
        try:
            rank = int(value)
        except ValueError:
            raise ConfigError(f"{name}={value!r} is not an integer rank") from None
        tp = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
        adp = False
    if tp < 1 or not rank >= 0:
        raise ConfigError(f"invalid parallel mapping: rank={rank}, tp_size={tp}")
    if adp and tp > 1:
        # dp_size = tp_size under attention DP, and the TP rank is the DP rank (py_executor.py
        # @ 0004396720054, _agreed_need_adjustment); attention is not sharded within a rank.
        if rank >= tp:
            raise ConfigError(f"invalid attention-DP mapping: rank={rank}, tp_size={tp}")
        return Parallel(rank=rank, tp_size=1, dp_rank=rank, dp_size=tp)
    return Parallel(rank=rank, tp_size=tp, dp_rank=0)


def group_of(llm_args: Any, env: Mapping[str, str]) -> str:
    """Names the leader/worker group: the leader port (one leader per port per host), and
    under attention DP the dp rank (each rank is a group of its own)."""
    group = getattr(llm_args, "kvbm_plugin_group", None)
    if group:
        return str(group)
    par = parallel_of(llm_args)
    return f"port{leader_port(env)}" + (f"-dp{par.dp_rank}" if par.attention_dp else "")


def leader_port(env: Mapping[str, str]) -> int:
    value = env.get(LEADER_ZMQ_PUB_PORT) or "56001"
    return parse_port(LEADER_ZMQ_PUB_PORT, value)


# Attention DP, buffered path: TensorRT-LLM's C++ event manager gathers each rank's KV events
# onto rank 0 (kvCacheEventManager.cpp, exchangeAttentionDpThread, every
# attention_dp_events_gather_period_ms); a second reader of a rank's queue would race it.
GATHERED_TO_RANK_0 = ("attention-DP rank {}: TensorRT-LLM gathers this rank's KV events onto "
                      "rank 0, whose leader publishes them on this rank's endpoint")
# The V2 hooks run on the rank that owns the blocks, before any gather: rank 0's leader sees
# its own rank's events only.
V2_UNDER_ATTENTION_DP = ("kvbm_plugin: KVCacheManagerV2 under attention DP: only dp rank 0's "
                         "GPU-tier events are published (the V2 hooks of the other ranks are "
                         "not gathered onto rank 0); every rank's offload tiers are published")


def report_port(env: Mapping[str, str], par: Parallel) -> int:
    """Where a group's workers in other processes send completion reports: the leader port,
    + dp rank under attention DP (``consolidator_config.dp_rank_sockets``)."""
    return leader_port(env) + par.dp_rank


def leader_host(env: Mapping[str, str]) -> str:
    return (env.get(LEADER_ZMQ_HOST) or "127.0.0.1").strip()


def in_process(llm_args: Any) -> bool:
    return bool(getattr(llm_args, "kvbm_plugin_inprocess", False))


def event_serializer_of(llm_args: Any) -> Any:
    """The test hook ``kvbm_plugin_event_serializer`` (a callable list-of-events → list of
    dicts), or None."""
    return getattr(llm_args, "kvbm_plugin_event_serializer", None)


def disk_identity(llm_args: Any, block_size: int, tp_size: int) -> str:
    """What disk block bytes mean beyond dtype and shape, written into and checked in every
    disk file's header: the model (``BaseLlmArgs.model``, TensorRT-LLM
    ``tensorrt_llm/llmapi/llm_args.py``), tokens per block, the TP size and, for a model of
    several attention windows, the windows (a slot holds every layer group's page)."""
    return (f"model={getattr(llm_args, 'model', '')};tokens_per_block={block_size};"
            f"tp={tp_size}{disk_identity_suffix(llm_args)}")


# Models with several KV layer groups (leader/layer_groups.py) read their windows here.
def configured_windows(llm_args: Any) -> tuple[int, ...]:
    """The distinct attention windows of ``kv_cache_config.max_attention_window`` in order of
    first appearance (one layer group each, as KVCacheManagerV2 allocates them); () for one."""
    windows = getattr(getattr(llm_args, "kv_cache_config", None), "max_attention_window", None)
    if not isinstance(windows, (list, tuple)):
        return ()
    distinct: list[int] = []
    for w in windows:
        if type(w) is not int or w <= 0:
            raise ConfigError(f"kv_cache_config.max_attention_window={list(windows)!r}: "
                              f"{w!r} is not a positive integer")
        if w not in distinct:
            distinct.append(w)
    return tuple(distinct) if len(distinct) > 1 else ()


def disk_identity_suffix(llm_args: Any) -> str:
    """What a disk file of a several-group model records beyond the flat identity: its
    windows (a file written under another layout fails the header check)."""
    windows = configured_windows(llm_args)
    return f";windows={','.join(map(str, windows))}" if windows else ""
