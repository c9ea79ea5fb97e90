"""Host and disk tiers are chosen by name among the ``kvbm_plugin.tiers`` entry points
(``DYN_KVBM_HOST_TIER``, ``DYN_KVBM_DISK_TIER``; tiers/selection.py): a third party's tier,
registered by its own distribution under its own name, runs in place of the built-in one;
a bad name is refused at the worker's construction, naming the variable and value."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from _engines import prompt, tiers

from kvbm_plugin._util.plugins import TIERS_GROUP, load_group
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

THIRD_PARTY = '''
from kvbm_plugin.tiers.base import OffloadTier, WriteResult
from kvbm_plugin.tiers.host import HostTier

CALLS = []


class RamDisk(OffloadTier):
    """A "disk" tier in memory: blocks by slot, each remembered with its key."""

    name = "disk"
    medium = "disk"

    def __init__(self, spec):
        super().__init__(spec)
        self.blocks = {}
        CALLS.append(("open", type(self).__name__, spec.capacity))

    def write(self, slot, key, block):
        self.blocks[slot] = (key, block.clone())
        CALLS.append(("write", slot))
        return WriteResult(True)  # no file: no signature for the leader to stat

    def read(self, slot, key, out):
        held = self.blocks.get(slot)
        CALLS.append(("read", slot))
        if held is None or held[0] != key:
            return False
        out.copy_(held[1])
        return True


class NumaHost(HostTier):
    def __init__(self, spec):
        super().__init__(spec)
        CALLS.append(("open", type(self).__name__, spec.capacity))
'''


@pytest.fixture
def third_party_tiers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An installed-looking distribution registering ``ramdisk`` and ``numa`` tiers (and,
    to show which kind each variable takes, RamDisk again as ``ramhost``)."""
    (tmp_path / "thirdparty_tiers.py").write_text(THIRD_PARTY)
    info = tmp_path / "thirdparty_tiers-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-tiers\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{TIERS_GROUP}]\nramdisk = thirdparty_tiers:RamDisk\n"
        "numa = thirdparty_tiers:NumaHost\nramhost = thirdparty_tiers:RamDisk\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_group(TIERS_GROUP, refresh=True)
    import thirdparty_tiers

    yield thirdparty_tiers
    monkeypatch.undo()
    sys.modules.pop("thirdparty_tiers", None)
    load_group(TIERS_GROUP, refresh=True)


def test_a_third_party_disk_and_host_tier_selected_by_name_carry_the_blocks(
        third_party_tiers: Any, make_engine: Any) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=4, disk=64,
                                                      DYN_KVBM_HOST_TIER="numa",
                                                      DYN_KVBM_DISK_TIER="ramdisk"))
    a = prompt(61, 17)  # 4 full blocks
    engine.submit(a, 1)
    engine.run_until_idle()
    for k in range(4):  # push it out of the GPU pool and the 4-block host tier: to disk
        engine.submit(prompt(600 + k, 40), 1)
        engine.run_until_idle()
    again = engine.submit(a, 1)
    engine.run_until_idle()
    result = engine.result(again)
    calls = third_party_tiers.CALLS
    assert ("open", "NumaHost", 4) in calls and ("open", "RamDisk", 64) in calls
    assert type(engine.workers[0]._disk_io.tier).__name__ == "RamDisk"  # noqa: SLF001
    assert result.disk_hit_tokens > 0 and result.kv_mismatches == 0
    assert any(c[0] == "write" for c in calls) and any(c[0] == "read" for c in calls)


def _worker(**env: str) -> KvbmConnectorWorker:
    return KvbmConnectorWorker(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),
                                       kvbm_plugin_env=tiers(host=8, disk=8, **env),
                                       kvbm_plugin_group="tier-selection"))


@pytest.mark.parametrize(("env", "message"), [
    ({"DYN_KVBM_DISK_TIER": "nope"},
     r"DYN_KVBM_DISK_TIER='nope': no entry point named 'nope' in group 'kvbm_plugin.tiers' "
     r"\(known: .*disk.*host.*\)"),
    ({"DYN_KVBM_DISK_TIER": "redis"},
     r"DYN_KVBM_DISK_TIER='redis' names .*RedisStore, which is not an offload tier"),
    ({"DYN_KVBM_HOST_TIER": "disk"},
     r"DYN_KVBM_HOST_TIER='disk' names kvbm_plugin.tiers.disk.DiskTier, which is not a host "
     r"tier \(a subclass of kvbm_plugin.tiers.host.HostTier\)"),
])
def test_a_bad_tier_name_is_refused_at_construction_naming_the_variable(env: dict[str, str],
                                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _worker(**env)


def test_a_host_tier_without_a_host_pool_is_refused(third_party_tiers: Any) -> None:
    """The transfer thread copies into a host tier's ``pool`` and checks its ``keys``: an
    OffloadTier that is no HostTier cannot be the host tier."""
    with pytest.raises(ConfigError, match=r"DYN_KVBM_HOST_TIER='ramhost' names "
                                          r"thirdparty_tiers.RamDisk, which is not a host tier"):
        _worker(DYN_KVBM_HOST_TIER="ramhost")
