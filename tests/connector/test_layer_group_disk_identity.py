"""A disk file of a several-group model is read back only under the same layout: its header's
identity names every group's window, layers and region sizes, not only the distinct windows
of ``max_attention_window`` (two window patterns with the same distinct windows and the same
slot size lay layers out differently in a slot)."""

from __future__ import annotations

import torch
from _engines import tiers

from kvbm_plugin.connector.meta import close_hub, open_hub
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.testing.fake_layout import (
    KvCacheBufferRef,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

BS = 4


def _identity(pattern: list[int], group: str) -> str:
    """The disk identity of a worker registering ``pattern`` (a window per layer, 6 layers,
    the same page size per layer): group 0 the sliding layers, group 1 the full ones."""
    open_hub(group)
    args = LlmArgs(KvCacheConfig(BS, max_attention_window=pattern), ParallelConfig(0, 1),
                   kvbm_plugin_env=tiers(host=8), kvbm_plugin_group=group)
    worker = KvbmConnectorWorker(args)
    try:
        groups = []
        for gid, window in enumerate((8, 4096)):
            layers = tuple(i for i in range(6) if pattern[i % len(pattern)] == window)
            pages = torch.zeros(8, 4 * len(layers))
            region = KvCacheRegion.over(pages, tuple(KvCacheBufferRef(i, "key")
                                                     for i in layers))
            groups.append(KvCacheLayerGroupLayout(gid, layers, None if window == 4096
                                                  else window, (region,)))
        worker.register_kv_cache_layout(KvCacheLayout(BS, tuple(groups)))
        return worker._disk_identity  # noqa: SLF001
    finally:
        worker.shutdown()
        close_hub(group)


def test_two_window_patterns_with_the_same_windows_and_slot_size_differ_on_disk() -> None:
    a = _identity([8, 4096, 4096, 8, 8, 4096], "identity-a")  # sliding layers 0, 3, 4
    b = _identity([8, 4096], "identity-b")  # sliding layers 0, 2, 4: same sizes, same windows
    assert a != b
    assert _identity([8, 4096], "identity-c") == b  # the same layout: files readable again
