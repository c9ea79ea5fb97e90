"""Shared-tier configuration: MOONCAKE_CONFIG_PATH filling the unset variables (a conflict
named), the store chosen by entry point, and the stores' start-up errors. No server needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.plugins import TIERS_GROUP, get_plugin
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import SharedSettings, load_shared_settings
from kvbm_plugin.tiers.shared.factory import store_class
from kvbm_plugin.tiers.shared.mooncake import MooncakeStore, apply_mooncake_config
from kvbm_plugin.tiers.shared.redis_store import RedisStore, redis_url

BASE_ENV = {cc.SHARED_TIER: "mooncake", cc.SHARED_MODEL_KEY: "m"}
CONFIG = {"local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE",
          "global_segment_size": "2gb", "local_buffer_size": 536870912, "protocol": "rdma",
          "device_name": "mlx5_0", "master_server_address": "10.0.0.1:50051"}


def _resolve(tmp_path: Path, config: object, **env: str) -> SharedSettings:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(config))
    full = {**BASE_ENV, cc.MOONCAKE_CONFIG_PATH: str(path), **env}
    settings = load_shared_settings(full)
    assert settings is not None
    return apply_mooncake_config(settings, full)


def test_the_file_fills_every_unset_variable(tmp_path: Path) -> None:
    settings = _resolve(tmp_path, CONFIG)
    assert (settings.address, settings.metadata_server, settings.protocol, settings.device,
            settings.local_hostname) == ("10.0.0.1:50051", "P2PHANDSHAKE", "rdma", "mlx5_0",
                                         "10.0.0.7")
    assert settings.segment_bytes == 2 << 30 and settings.buffer_bytes == 512 << 20


def test_a_variable_that_agrees_with_the_file_is_fine(tmp_path: Path) -> None:
    settings = _resolve(tmp_path, CONFIG, **{cc.SHARED_ADDRESS: "10.0.0.1:50051",
                                              cc.SHARED_SEGMENT_GB: "2"})
    assert settings.address == "10.0.0.1:50051" and settings.segment_bytes == 2 << 30


@pytest.mark.parametrize(("variable", "value", "key"), [
    (cc.SHARED_ADDRESS, "10.0.0.2:50051", "master_server_address"),
    (cc.SHARED_PROTOCOL, "tcp", "protocol"),
    (cc.SHARED_SEGMENT_GB, "1", "global_segment_size"),
    (cc.SHARED_BUFFER_GB, "0.25", "local_buffer_size"),
])
def test_a_conflict_names_both(tmp_path: Path, variable: str, value: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"{variable}='{value}' conflicts with {key}=.* in "
                       f"{cc.MOONCAKE_CONFIG_PATH}="):
        _resolve(tmp_path, CONFIG, **{variable: value})


def test_without_the_file_nothing_changes() -> None:
    settings = load_shared_settings(BASE_ENV)
    assert settings is not None and apply_mooncake_config(settings, BASE_ENV) is settings


@pytest.mark.parametrize("config", ["not json", "[1, 2]", {"global_segment_size": "lots"}])
def test_an_unusable_file_names_the_variable(tmp_path: Path, config: object) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    env = {**BASE_ENV, cc.MOONCAKE_CONFIG_PATH: str(path)}
    settings = load_shared_settings(env)
    assert settings is not None
    with pytest.raises(ConfigError, match=cc.MOONCAKE_CONFIG_PATH):
        apply_mooncake_config(settings, env)


def test_a_missing_file_names_the_variable(tmp_path: Path) -> None:
    env = {**BASE_ENV, cc.MOONCAKE_CONFIG_PATH: str(tmp_path / "absent.json")}
    settings = load_shared_settings(env)
    assert settings is not None
    with pytest.raises(ConfigError, match=f"{cc.MOONCAKE_CONFIG_PATH}=.*absent.json"):
        MooncakeStore(settings, env=env)


def test_the_store_is_chosen_by_entry_point() -> None:
    assert get_plugin(TIERS_GROUP, "mooncake") is MooncakeStore
    assert get_plugin(TIERS_GROUP, "redis") is RedisStore
    assert store_class("redis") is RedisStore
    with pytest.raises(ConfigError, match=f"{cc.SHARED_TIER}='host' names .*HostTier, an "
                       "offload tier, not a shared store"):
        store_class("host")
    with pytest.raises(ConfigError, match=f"{cc.SHARED_TIER}='s3': no entry point named 's3'"):
        store_class("s3")


def test_mooncake_settings_are_checked_before_connecting() -> None:
    with pytest.raises(ConfigError, match=f"{cc.SHARED_ADDRESS} is unset"):
        MooncakeStore(SharedSettings(store="mooncake", model_key="m"), env={})
    with pytest.raises(ConfigError, match=cc.SHARED_METRICS_ADDRESS):
        MooncakeStore(SharedSettings(store="mooncake", model_key="m", address="h:1",
                                        metrics_address="h"), env={})
    with pytest.raises(ConfigError, match=rf"{cc.SHARED_SEGMENT_GB}=0.000976562 \(1048576 bytes\)"):
        MooncakeStore(SharedSettings(store="mooncake", model_key="m", address="h:1",
                                        segment_bytes=1 << 20), env={})


@pytest.mark.parametrize(("address", "url"), [
    ("redis://h:6379/2", "redis://h:6379/2"), ("h:6379", "redis://h:6379"),
    ("/run/redis.sock", "unix:///run/redis.sock"), ("unix:///tmp/r.sock", "unix:///tmp/r.sock")])
def test_redis_addresses(address: str, url: str) -> None:
    assert redis_url(address) == url


def test_a_store_that_cannot_run_fails_under_kvbm_require_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from _require import VARIABLE, unavailable

    monkeypatch.setenv(VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception, match=f"{VARIABLE}=1 and no binary"):
        unavailable("no binary")
    monkeypatch.delenv(VARIABLE)
    with pytest.raises(pytest.skip.Exception, match="no binary"):
        unavailable("no binary")


THIRD_PARTY = """
from kvbm_plugin.tiers.shared.store import SharedStore
class Carrier(SharedStore):
    name = "carrier"
    def __init__(self, settings):
        self.settings = settings
    def exists(self, keys):
        return [0] * len(keys)
    def put(self, keys, buffers):
        return [0] * len(keys)
    def get_into(self, keys, buffers):
        return [-1] * len(keys)
    def health(self):
        return None
class NotAStore:
    pass
"""


@pytest.fixture
def tier_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An installed-looking distribution with entry points in the tiers group."""
    import sys

    from kvbm_plugin._util.plugins import load_group

    def make(entry_points: str) -> None:
        (tmp_path / "thirdparty_store.py").write_text(THIRD_PARTY)
        info = tmp_path / "thirdparty_store-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-store\n"
                                       "Version: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{TIERS_GROUP}]\n{entry_points}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        load_group(TIERS_GROUP, refresh=True)

    yield make
    monkeypatch.undo()
    sys.modules.pop("thirdparty_store", None)
    load_group(TIERS_GROUP, refresh=True)


def test_a_third_party_store_is_opened_behind_the_breaker(tier_dist: Any) -> None:
    from kvbm_plugin.tiers.shared.breaker import GuardedStore
    from kvbm_plugin.tiers.shared.factory import open_store

    tier_dist("carrier = thirdparty_store:Carrier")
    store = open_store(SharedSettings(store="carrier", model_key="m"))
    assert isinstance(store, GuardedStore) and store.store.name == "carrier"
    assert store.get_into(["k"], [(0, 1)]) == [-1] and store.stats()["get_into_missing"] == 1


def test_an_entry_point_that_is_neither_tier_nor_store_fails(tier_dist: Any) -> None:
    from kvbm_plugin._util.plugins import PluginLoadError

    with pytest.raises(PluginLoadError, match="not a subclass of kvbm_plugin.tiers.base."
                       "OffloadTier or kvbm_plugin.tiers.shared.store.SharedStore"):
        tier_dist("odd = thirdparty_store:NotAStore")
