"""Stand-ins for the TensorRT-LLM objects the connector sees, with TRT-LLM's field meanings.

Only what the connector reads is modelled: ``LlmRequest`` (the C++ request as nanobind exposes
it to ``get_num_new_matched_tokens``), ``RequestData``/``SchedulerOutput`` (the classic
dataclasses plus the current fields ``block_hashes``, ``priorities``, ``cache_salt``), and the
parts of ``TorchLlmArgs`` the leader and worker read.
"""

from __future__ import annotations

from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import Any

from kvbm_plugin.naming.names import v1_block_hash
from kvbm_plugin.wire.identity import cache_salt_id

_U64 = (1 << 64) - 1


def trtllm_block_hash(parent: int | None, tokens: list[int],
                      salt: str | int | None = None, lora_task_id: int | None = None,
                      mm_keys: list[tuple[bytes, int]] | tuple[()] = ()) -> int:
    """TRT-LLM's V1 block hash (``BlockKeyHasher``, see ``naming.names``) of a block
    of ``tokens`` under ``parent``. The salt enters as the C++ ``cacheSaltID`` of the
    revisions whose request carries ``cache_salt_id`` (a string salt is converted with
    ``cache_salt_id`` first), into the first block only; the LoRA task id into every block;
    ``mm_keys`` (digest, offset): the multimodal items overlapping the block
    (``naming.names.mm_block_keys``)."""
    sid = None if salt is None else (cache_salt_id(salt) if isinstance(salt, str)
                                     else int(salt) & _U64)
    return v1_block_hash(tokens, parent, salt=sid, lora_task_id=lora_task_id, mm_keys=mm_keys)



def trtllm_block_chain(tokens: list[int], block_size: int, salt: str | int | None = None,
                       lora_task_id: int | None = None) -> list[int]:
    """:func:`trtllm_block_hash` of every full block of ``tokens``, each under the one before."""
    out: list[int] = []
    parent = None
    for i in range(len(tokens) // block_size):
        parent = trtllm_block_hash(parent, tokens[i * block_size:(i + 1) * block_size], salt,
                                   lora_task_id)
        out.append(parent)
    return out

@dataclass
class RequestData:
    """TRT-LLM's per-request delta in a SchedulerOutput."""

    request_id: int
    new_tokens: list[int]  # tokens appended since the previous report (all prompt tokens first)
    new_block_ids: list[int]  # device blocks appended since the previous report
    computed_position: int  # tokens with valid KV before this iteration; the manager
    # subtracts tokens the connector matched only in the build right after the match, so a
    # request whose load was asynchronous first appears with its full position
    num_scheduled_tokens: int  # tokens computed by the upcoming forward pass
    block_hashes: list[int] = field(default_factory=list)  # cumulative full-block hash chain
    priorities: list[int] | None = None
    cache_salt: str | None = None  # current main; older revisions have no salt here
    # Several KV layer groups (connectors/kv_cache_connector.py @ 035ab91cad04): new page
    # indices per group, by group id, -1 (BAD_PAGE_INDEX) in place where a block has no page
    # in that group; empty when the flat ``new_block_ids`` describes the cache (one group).
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)


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
                 cache_salt_id: int | None = None, lora_task_id: int | None = None,
                 multimodal: list[tuple[list[int], list[tuple[int, int]]]] | None = None,
                 ) -> None:
        self.request_id = request_id
        self._tokens = tokens
        if cache_salt is not None:
            self.cache_salt = cache_salt
        self.cache_salt_id = cache_salt_id
        self.lora_task_id = lora_task_id
        # The C++ request's multimodal fields (None for a text-only request): per item its
        # hash as 8 int32 parts, its first prompt position and its token count; where an
        # item's tokens come in several runs, the run metadata of the newest revisions too
        # (``MultimodalInput``: item i owns runs [cu_offsets[i], cu_offsets[i + 1])).
        items = multimodal or []
        self.multimodal_hashes = [list(h) for h, _ in items] or None
        self.multimodal_positions = [runs[0][0] for _, runs in items] or None
        self.multimodal_lengths = [sum(n for _, n in runs) for _, runs in items] or None
        self.multimodal_item_run_cu_offsets = self.multimodal_run_positions = \
            self.multimodal_run_lengths = None
        if any(len(runs) > 1 for _, runs in items):
            offsets = [0]
            for _, runs in items:
                offsets.append(offsets[-1] + len(runs))
            self.multimodal_item_run_cu_offsets = offsets
            self.multimodal_run_positions = [p for _, runs in items for p, _ in runs]
            self.multimodal_run_lengths = [n for _, runs in items for _, n in runs]
        self.is_generation_only_request = False
        self.is_finished = False  # set by the executor when the request finished or was cancelled
        self.context_current_position = 0

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)


@dataclass
class KVEventsConfig:
    """``tensorrt_llm.llmapi.KVEventsConfig``: TensorRT-LLM's own streaming publisher, with
    upstream's defaults (llm-api reference page KVEventsConfig; PR #17023)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


@dataclass
class KvCacheConfig:
    tokens_per_block: int
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = False
    kv_events_config: Any = None  # KVEventsConfig: TRT-LLM's own streaming publisher
    max_attention_window: list[int] | None = None  # several windows: VSWA
    use_kv_cache_manager_v2: bool | str = "auto"  # VSWA needs V2 (per-group pages)


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
    enable_attention_dp: bool = False  # tp_size is then the number of attention-DP ranks

    def to_mapping(self) -> Mapping:
        return Mapping(self.rank, self.tp_size, self.tp_size, self.enable_attention_dp)


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
    kvbm_plugin_event_serializer: Any = None


# --------------------------------------------------------------------------- KV cache events
# Stand-ins for the C++ event objects that ``KVCacheManager.get_latest_events`` returns on the
# buffered path (bindings of ``tensorrt_llm::executor::KVCacheEvent`` and its data types). The
# class names matter: TensorRT-LLM's ``KVCacheEventSerializer`` picks the conversion by
# ``type(event.data).__name__`` (tensorrt_llm/_utils.py, NVIDIA/TensorRT-LLM@ed53795b), so the
# real serializer converts these objects too.


@dataclass
class UniqueToken:
    token_id: int
    token_extra_id: int = 0


@dataclass
class KVCacheStoredBlockData:
    block_hash: int
    tokens: list[UniqueToken]
    cache_level: int = 0
    priority: int = 35
    # C++ ``loraId`` (cpp/include/tensorrt_llm/executor/executor.h @ 879039f6); upstream's
    # serializer does not write it
    lora_id: int | None = None
    mm_keys: list[Any] | None = None  # newer revisions (serialized when present)
    cache_salt: str | None = None  # newer revisions (serialized when present)


@dataclass
class KVCacheStoredData:
    parent_hash: int | None
    blocks: list[KVCacheStoredBlockData]


@dataclass
class KVCacheRemovedData:
    block_hashes: list[int]


@dataclass
class KVCacheCreatedData:
    num_blocks_per_cache_level: list[int]


@dataclass
class KVCacheEventDiff:
    old_value: int
    new_value: int


@dataclass
class KVCacheUpdatedData:
    block_hash: int
    cache_level: KVCacheEventDiff | None = None
    priority: KVCacheEventDiff | None = None


@dataclass
class KVCacheEvent:
    event_id: int
    data: Any
    window_size: int
    attention_dp_rank: int | None = None


def event_object(event: MappingABC[str, Any]) -> KVCacheEvent:
    """The C++-like event object for one serialized event dict (the simulated block pool
    records dicts; the simulated KV cache manager hands out objects)."""
    data = event["data"]
    kind = data["type"]
    payload: Any
    if kind == "stored":
        payload = KVCacheStoredData(data.get("parent_hash"), [
            KVCacheStoredBlockData(
                b["block_hash"],
                [UniqueToken(t["token_id"], t.get("token_extra_id", 0)) for t in b["tokens"]],
                b.get("cache_level", 0), b.get("priority", 35), b.get("lora_id"),
                b.get("mm_keys"), b.get("cache_salt"))
            for b in data["blocks"]])
    elif kind == "removed":
        payload = KVCacheRemovedData(list(data["block_hashes"]))
    elif kind == "created":
        payload = KVCacheCreatedData(list(data["num_blocks_per_cache_level"]))
    elif kind == "updated":
        def diff(d: Any) -> KVCacheEventDiff | None:
            return None if d is None else KVCacheEventDiff(d["old_value"], d["new_value"])
        payload = KVCacheUpdatedData(data["block_hash"], diff(data.get("cache_level")),
                                     diff(data.get("priority")))
    else:
        raise ValueError(f"event_object: unknown event data type {kind!r}")
    return KVCacheEvent(event["event_id"], payload, event["window_size"],
                        event.get("attention_dp_rank"))


class KVCacheEventSerializer:
    """Same output shape as TensorRT-LLM's ``tensorrt_llm._utils.KVCacheEventSerializer``
    (NVIDIA/TensorRT-LLM@ed53795b): one dict per event with ``event_id``, ``data``,
    ``window_size`` (and ``attention_dp_rank`` when set); ``lora_id`` is not written, as
    upstream leaves it out; a block's ``mm_keys`` and ``cache_salt`` (newer revisions) only
    when set. Dispatches on the data object's class name, as upstream does."""

    @classmethod
    def serialize(cls, events: Any) -> Any:
        if events is None:
            return None
        if not isinstance(events, list):
            return cls.to_json_str(events)
        return [cls.to_json_str(event) for event in events]

    @classmethod
    def to_json_str(cls, event: Any) -> dict[str, Any]:
        if event is None:
            return {}
        name = type(event.data).__name__
        convert = {"KVCacheCreatedData": cls._created, "KVCacheStoredData": cls._stored,
                   "KVCacheStoredBlockData": cls._stored_block,
                   "KVCacheRemovedData": cls._removed,
                   "KVCacheUpdatedData": cls._updated}.get(name)
        if convert is None:
            raise ValueError(f"Unknown KVCache event data type: {name}")
        out = {"event_id": event.event_id, "data": convert(event.data),
               "window_size": event.window_size}
        if event.attention_dp_rank is not None:
            out["attention_dp_rank"] = event.attention_dp_rank
        return out

    @staticmethod
    def _created(data: Any) -> dict[str, Any]:
        return {"type": "created", "num_blocks_per_cache_level": data.num_blocks_per_cache_level}

    @classmethod
    def _stored(cls, data: Any) -> dict[str, Any]:
        return {"type": "stored", "parent_hash": data.parent_hash,
                "blocks": [cls._stored_block(b) for b in data.blocks]}

    @staticmethod
    def _stored_block(data: Any) -> dict[str, Any]:
        out = {"type": "stored_block", "block_hash": data.block_hash,
               "tokens": [{"type": "unique_token", "token_id": t.token_id,
                           "token_extra_id": t.token_extra_id} for t in data.tokens],
               "cache_level": data.cache_level, "priority": data.priority}
        # Newer revisions add these per block; left out when absent, as older ones write it.
        if getattr(data, "mm_keys", None):
            out["mm_keys"] = data.mm_keys
        if getattr(data, "cache_salt", None) is not None:
            out["cache_salt"] = data.cache_salt
        return out

    @staticmethod
    def _removed(data: Any) -> dict[str, Any]:
        return {"type": "removed", "block_hashes": data.block_hashes}

    @staticmethod
    def _diff(data: Any) -> dict[str, Any] | None:
        if data is None:
            return None
        return {"type": "event_diff", "new_value": data.new_value, "old_value": data.old_value}

    @classmethod
    def _updated(cls, data: Any) -> dict[str, Any]:
        return {"type": "updated", "block_hash": data.block_hash,
                "cache_level": cls._diff(data.cache_level), "priority": cls._diff(data.priority)}


class V2EventManager:
    """KVCacheManagerV2's Python event manager as far as the plugin's tee sees it
    (``_event_manager.py``, Python backend): the radix tree calls ``add_stored_event``
    through the instance, so a wrapped attribute is called. Records what it was handed."""

    def __init__(self) -> None:
        self.stored: list[int] = []
        self._window_size_by_layer_group: dict[int, int] = {}

    def add_stored_event(self, parent_hash: Any, blocks: Any, layer_group_id: Any = None
                         ) -> None:
        self.stored.extend(b.block_hash for b in blocks)

    def add_stored_block_event_from_block(self, block: Any) -> None:
        raise NotImplementedError("V2KVCacheManager.commit calls add_stored_event")

    def add_removed_event(self, block_hashes: Any) -> None:
        pass


class CppSinkV2EventManager(V2EventManager):
    """The C++ backend's event manager seen from Python: the same methods, but the radix tree
    calls them natively, never through the instance's attributes, so a wrapper set on the
    instance is never called (``kv_cache_events.py`` @44004b3864a7: "the C++ radix tree calls
    the sink natively, not through Python")."""


class V2KVCacheManager:
    """A KVCacheManagerV2 stand-in holding ``event_manager``. :meth:`commit` stores a chain of
    full blocks into the "radix tree": through the instance's attributes (Python backend) or,
    with ``cpp_sink=True``, the way the C++ backend does, bypassing them. ``bindings_type``
    makes the event manager's type look like TensorRT-LLM's nanobind class (what the plugin
    detects); without it the C++ sink can only be caught by the leader's self-check."""

    def __init__(self, *, cpp_sink: bool = False, bindings_type: bool = False) -> None:
        cls: type[V2EventManager] = CppSinkV2EventManager if cpp_sink else V2EventManager
        if bindings_type:
            cls = type("KVCacheEventManager", (cls,), {
                "__module__": "tensorrt_llm.bindings.internal.batch_manager.kv_cache_manager_v2"})
        self.event_manager = cls()
        self.cpp_sink = cpp_sink

    def commit(self, tokens: list[int], block_size: int) -> None:
        """Store ``tokens``' full blocks (block hash = :func:`trtllm_block_chain`)."""
        from types import SimpleNamespace

        em = self.event_manager
        parent = None
        for h, i in zip(trtllm_block_chain(tokens, block_size),
                        range(0, len(tokens), block_size), strict=False):
            data = SimpleNamespace(block_hash=h, tokens=tokens[i:i + block_size], mm_keys=[],
                                   cache_salt=None)
            if self.cpp_sink:  # as C++ calls its sink: no Python attribute lookup
                type(em).add_stored_event(em, parent, [data], 0)
            else:
                em.add_stored_event(parent, [data], 0)
            parent = h
