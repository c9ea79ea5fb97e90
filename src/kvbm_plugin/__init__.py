"""kvbm_plugin: a KV-cache connector plugin for TensorRT-LLM.

Engine YAML::

    kv_connector_config:
      connector_module: kvbm_plugin
      connector_scheduler_class: KvbmConnectorLeader
      connector_worker_class: KvbmConnectorWorker

The connector classes are resolved on first attribute access, so importing the package (CLI,
config, event path) imports neither TensorRT-LLM nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["KvbmConnectorLeader", "KvbmConnectorWorker", "__version__"]

if TYPE_CHECKING:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.connector_worker import KvbmConnectorWorker


def __getattr__(name: str) -> Any:
    if name == "KvbmConnectorLeader":
        from kvbm_plugin.connector_leader import KvbmConnectorLeader

        return KvbmConnectorLeader
    if name == "KvbmConnectorWorker":
        from kvbm_plugin.connector_worker import KvbmConnectorWorker

        return KvbmConnectorWorker
    raise AttributeError(f"module 'kvbm_plugin' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
