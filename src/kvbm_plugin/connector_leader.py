"""KvbmConnectorLeader: TensorRT-LLM's connector scheduler side (filled by the connector issue)."""

from __future__ import annotations

from kvbm_plugin._trtllm_compat import KvCacheConnectorScheduler


class KvbmConnectorLeader(KvCacheConnectorScheduler):  # type: ignore[misc, valid-type]
    """Scheduler-side connector; runs on rank 0 (or each attention-DP rank)."""
