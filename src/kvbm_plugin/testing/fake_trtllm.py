"""Stand-ins for the TensorRT-LLM objects the connector sees, with TRT-LLM's field meanings.

Only what the connector reads is modelled: ``LlmRequest`` (the C++ request as nanobind exposes
it to ``get_num_new_matched_tokens``), ``RequestData``/``SchedulerOutput`` (the classic
dataclasses plus the current fields ``block_hashes``, ``priorities``, ``cache_salt``), and the
parts of ``TorchLlmArgs`` the leader and worker read.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import Any

from kvbm_plugin._salt import cache_salt_id

_U64 = (1 << 64) - 1


def trtllm_block_hash(parent: int | None, tokens: list[int],
                      salt: str | int | None = None) -> int:
    """An unsigned 64-bit chained block hash, like TRT-LLM's ``v1_block_key`` (not equal to
    it): depends on the parent hash, the token count, the tokens and the cache salt. As in
    TRT-LLM's ``hash_v1_block_key`` the salt enters as its id (``cache_salt_id``; a string
    salt is converted first) and only into the first block; later blocks inherit it through
    the parent hash."""
    h = hashlib.sha256()
    h.update(struct.pack("<QI", 0 if parent is None else parent & _U64, len(tokens)))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if salt is not None and parent is None:
        sid = cache_salt_id(salt) if isinstance(salt, str) else int(salt) & _U64
        h.update(struct.pack("<Q", sid))
    return int.from_bytes(h.digest()[:8], "little")


@dataclass
class RequestData:
    """TRT-LLM's per-request delta in a SchedulerOutput."""

    request_id: int
    new_tokens: list[int]  # tokens appended since the previous report (all prompt tokens first)
    new_block_ids: list[int]  # device blocks appended since the previous report
    computed_position: int  # tokens with valid KV before this iteration (first report excludes
    # tokens the connector loaded)
    num_scheduled_tokens: int  # tokens computed by the upcoming forward pass
    block_hashes: list[int] = field(default_factory=list)  # cumulative full-block hash chain
    priorities: list[int] | None = None
    cache_salt: str | None = None  # current main; older revisions have no salt here


@dataclass
class SchedulerOutput:
    new_requests: list[RequestData] = field(default_factory=list)  # first time scheduled
    cached_requests: list[RequestData] = field(default_factory=list)  # seen before
    attention_dp_rank: int | None = None


class LlmRequest:
    """What the C++ LlmRequest exposes to the scheduler hooks.

    The nanobind request carries the salt as ``cache_salt_id`` (an int) only; the Python
    request of newer revisions also has the string ``cache_salt``. Either may be given here, as
    the request under test is shaped.
    """

    def __init__(self, request_id: int, tokens: list[int], cache_salt: str | None = None, *,
                 cache_salt_id: int | None = None, lora_task_id: int | None = None) -> None:
        self.request_id = request_id
        self._tokens = tokens
        if cache_salt is not None:
            self.cache_salt = cache_salt
        self.cache_salt_id = cache_salt_id
        self.lora_task_id = lora_task_id
        self.is_generation_only_request = False
        self.context_current_position = 0

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)


@dataclass
class KvCacheConfig:
    tokens_per_block: int
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = False


@dataclass
class Mapping:
    rank: int
    tp_size: int
    world_size: int
    enable_attention_dp: bool = False


@dataclass
class ParallelConfig:
    rank: int
    tp_size: int

    def to_mapping(self) -> Mapping:
        return Mapping(self.rank, self.tp_size, self.tp_size)


@dataclass
class KvCacheConnectorConfig:
    connector_module: str = "kvbm_plugin"
    connector_scheduler_class: str = "KvbmConnectorLeader"
    connector_worker_class: str = "KvbmConnectorWorker"


@dataclass
class LlmArgs:
    """The slice of ``TorchLlmArgs`` the connector reads, plus the plugin's test hooks."""

    kv_cache_config: KvCacheConfig
    parallel_config: ParallelConfig
    kv_connector_config: KvCacheConnectorConfig = field(default_factory=KvCacheConnectorConfig)
    tensor_parallel_size: int = 1
    kvbm_plugin_env: MappingABC[str, str] | None = None
    kvbm_plugin_group: str | None = None
    kvbm_plugin_inprocess: bool = True
    kvbm_plugin_tier_events: Any = None
