"""The one module that imports TensorRT-LLM.

TRT-LLM's connector base classes moved in 1.3.0rc14; this module finds them on either path, and
otherwise provides stand-ins with the same constructor and method names so that
``import kvbm_plugin`` works (and the simulated engine can drive the connector) without
TensorRT-LLM. "Not installed" is normal and logged at debug level; "installed but broken"
(e.g. no libcuda.so.1 on a GPU-less host) gets one warning with the cause.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

CONNECTOR_MODULE_PATHS: tuple[str, ...] = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",  # >= 1.3.0rc14
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",  # 1.1.0rc3 .. 1.3.0rc13
)
STANDIN = "kvbm_plugin stand-in (TensorRT-LLM not importable)"


class StandinKvCacheConnectorScheduler(ABC):
    """Stand-in for TRT-LLM's ``KvCacheConnectorScheduler``: same constructor and methods."""

    supports_attention_dp = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> Any: ...

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...

    def wait_for_initialization(self) -> None:
        return None


class StandinKvCacheConnectorWorker(ABC):
    """Stand-in for TRT-LLM's ``KvCacheConnectorWorker``: same constructor and methods."""

    supports_attention_dp = False

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None
        super().__init__()

    def bind_connector_meta(self, metadata: Any) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> Any:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[[], None] | None:
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any,
                           secondary_kv_cache_tensor: Any = None) -> None: ...

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]: ...


@dataclass
class StandinSchedulerOutput:
    """Stand-in for TRT-LLM's ``SchedulerOutput``."""

    new_requests: list[Any] = field(default_factory=list)
    cached_requests: list[Any] = field(default_factory=list)
    attention_dp_rank: int | None = None


@dataclass(frozen=True)
class CompatInfo:
    """Which connector base classes are in use, for ``kvbm-plugin doctor``."""

    module: str  # import path of the base classes, or STANDIN
    trtllm_version: str | None  # None when TensorRT-LLM is not installed or not importable
    installed: bool
    error: str | None  # why an installed TensorRT-LLM could not be imported


def _load() -> tuple[type, type, type, CompatInfo]:
    if importlib.util.find_spec("tensorrt_llm") is None:
        logger.debug("TensorRT-LLM is not installed; using stand-in connector base classes")
        info = CompatInfo(STANDIN, None, installed=False, error=None)
        return (StandinKvCacheConnectorScheduler, StandinKvCacheConnectorWorker,
                StandinSchedulerOutput, info)
    errors: list[str] = []
    for path in CONNECTOR_MODULE_PATHS:
        try:
            module = importlib.import_module(path)
            classes = (module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker,
                       module.SchedulerOutput)
        except ModuleNotFoundError as exc:
            # Only "this path does not exist in this version" moves on to the next path.
            if exc.name is not None and path.startswith(exc.name):
                errors.append(f"{path}: {exc}")
                continue
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
            break
        except Exception as exc:  # a broken install raises anything (OSError, ImportError...)
            errors.append(f"{path}: {type(exc).__name__}: {exc}")
            break
        version = getattr(importlib.import_module("tensorrt_llm"), "__version__", None)
        info = CompatInfo(path, None if version is None else str(version), True, None)
        return (*classes, info)
    cause = "; ".join(errors)
    logger.warning("TensorRT-LLM is installed but its KV-cache connector API could not be "
                   "imported (%s); using stand-in base classes", cause)
    info = CompatInfo(STANDIN, _installed_version(), installed=True, error=cause)
    return (StandinKvCacheConnectorScheduler, StandinKvCacheConnectorWorker,
            StandinSchedulerOutput, info)


def _installed_version() -> str | None:
    import importlib_metadata

    try:
        return importlib_metadata.version("tensorrt-llm")
    except importlib_metadata.PackageNotFoundError:
        return None


KvCacheConnectorScheduler, KvCacheConnectorWorker, SchedulerOutput, COMPAT = _load()


def has_layer_group_api() -> bool:
    """Whether this TensorRT-LLM hands a cache of several layer groups to the connector per
    group (``update_state_after_alloc_by_layer_group``, ``connectors/kv_cache_connector.py``
    @ 035ab91cad04); the stand-ins do (the simulated executor drives those calls)."""
    return (KvCacheConnectorScheduler is StandinKvCacheConnectorScheduler
            or hasattr(KvCacheConnectorScheduler, "update_state_after_alloc_by_layer_group"))


def _has_events(candidate: Any) -> bool:
    """A KV cache manager that can hand out events: buffered (``get_latest_events``) or V2
    (``event_manager`` with the sink hooks)."""
    if candidate is None:
        return False
    event_manager = getattr(candidate, "event_manager", None)
    return (callable(getattr(candidate, "get_latest_events", None))
            or hasattr(event_manager, "add_stored_block_event_from_block"))


def find_kv_cache_manager(max_depth: int = 32) -> Any | None:
    """The KV cache manager of the PyExecutor that is calling us, or None.

    TensorRT-LLM gives the connector no handle on its KV cache manager, but every version's
    ``PyExecutor`` keeps it as ``self.kv_cache_manager`` and calls the connector scheduler from
    its own loop (``KvCacheConnectorManager.handle_metadata`` → ``build_connector_meta``).
    So the caller's frames lead to it without patching TensorRT-LLM. Call from the executor
    thread; it inspects at most ``max_depth`` frames and does no I/O.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        local = frame.f_locals
        candidate = local.get("kv_cache_manager")
        if _has_events(candidate):
            return candidate
        owner = local.get("self")
        candidate = getattr(owner, "kv_cache_manager", None) if owner is not None else None
        if _has_events(candidate):
            return candidate
        frame = frame.f_back
    return None


def kv_cache_manager_v2_backend() -> str | None:
    """TensorRT-LLM's KVCacheManagerV2 backend as its loaded module chose it (``cpp``, the
    default, or ``python``), or None when that module is not loaded (no V2 manager here).
    Reads ``sys.modules`` only, never imports: ``tensorrt_llm/runtime/kv_cache_manager_v2/
    __init__.py`` (stored id 57009499785) reads ``TLLM_KV_CACHE_MANAGER_V2_BACKEND`` once at
    import into ``_BACKEND``, so a later change of the variable does not change the backend."""
    module = sys.modules.get("tensorrt_llm.runtime.kv_cache_manager_v2")
    if module is None:
        return None
    backend = getattr(module, "BACKEND", None) or getattr(module, "_BACKEND", None)
    return backend.lower() if isinstance(backend, str) else None


def kv_event_serializer() -> Callable[[Any], list[dict[str, Any]]] | None:
    """TensorRT-LLM's serializer of buffered C++ KV events into dicts, or None without it."""
    if not COMPAT.installed or COMPAT.error:
        return None
    try:
        module = importlib.import_module("tensorrt_llm._utils")
        return module.KVCacheEventSerializer.serialize
    except Exception as exc:  # absent in some version: the sink then counts objects as malformed
        logger.warning("TensorRT-LLM's KVCacheEventSerializer is not importable (%s); buffered "
                       "KV events cannot be converted", exc)
        return None

__all__ = ["COMPAT", "CompatInfo", "KvCacheConnectorScheduler", "KvCacheConnectorWorker",
           "SchedulerOutput", "has_layer_group_api", "STANDIN", "find_kv_cache_manager",
           "kv_event_serializer"]
