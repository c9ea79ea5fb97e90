"""KvbmConnectorWorker: TensorRT-LLM's connector worker side (filled by the connector issue)."""

from __future__ import annotations

from kvbm_plugin._trtllm_compat import KvCacheConnectorWorker


class KvbmConnectorWorker(KvCacheConnectorWorker):  # type: ignore[misc, valid-type]
    """Worker-side connector; runs on every rank."""
