"""VSWA / hybrid models (more than one KV layer group) are refused at construction, with the
windows named: the plugin keys one block per position across every layer and must never serve
one layer group's block into another."""

from __future__ import annotations

import pytest
from _engines import tiers

from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig


@pytest.mark.parametrize("cls", [KvbmConnectorLeader, KvbmConnectorWorker])
def test_several_attention_windows_are_refused_naming_them(cls) -> None:
    args = LlmArgs(KvCacheConfig(4, max_attention_window=[4096, 512, 4096]),
                   ParallelConfig(0, 1), kvbm_plugin_env=tiers(host=8),
                   kvbm_plugin_group="vswa")
    with pytest.raises(ConfigError, match=r"max_attention_window=\[4096, 512, 4096\].*2 KV "
                                          "layer groups"):
        cls(args)


def test_one_window_repeated_per_layer_is_one_group() -> None:
    args = LlmArgs(KvCacheConfig(4, max_attention_window=[4096, 4096]), ParallelConfig(0, 1),
                   kvbm_plugin_env=tiers(host=8), kvbm_plugin_group="one-window")
    KvbmConnectorLeader(args).shutdown()
