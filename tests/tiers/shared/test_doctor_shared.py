"""``kvbm-plugin doctor`` with a shared tier: the store reached and what it reports, or a
FAIL naming the variable (at once, not after Mooncake's 90 s of set-up retries)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli import doctor
from kvbm_plugin.testing.local_server import free_port


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("DYN_KVBM_") or name == cc.MOONCAKE_CONFIG_PATH:
            monkeypatch.delenv(name)
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")


def _shared(monkeypatch: pytest.MonkeyPatch, **env: str) -> doctor.Check:
    for name, value in env.items():
        monkeypatch.setenv(getattr(cc, name), value)
    return doctor._shared_check()


def test_no_shared_tier_is_reported_off(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _shared(monkeypatch)
    assert check.status == "ok" and cc.SHARED_TIER in check.detail


def test_a_missing_model_key_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _shared(monkeypatch, SHARED_TIER="mooncake")
    assert check.status == "fail" and cc.SHARED_MODEL_KEY in check.detail


def test_an_absent_master_fails_at_once_naming_the_address(
        monkeypatch: pytest.MonkeyPatch, mooncake_master_factory: Any) -> None:
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    check = _shared(monkeypatch, SHARED_TIER="mooncake", SHARED_MODEL_KEY="m",
                    SHARED_ADDRESS=address)
    assert time.monotonic() - started < 3
    assert check.status == "fail"
    assert f"{cc.SHARED_ADDRESS}='{address}': no Mooncake master answers" in check.detail


def test_a_master_reports_its_pool(monkeypatch: pytest.MonkeyPatch,
                                   mooncake_master: Any, mooncake_store_factory: Any,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    mooncake_store_factory(mooncake_master, segment_bytes=16 << 20)  # a worker's segment
    for name, value in (("SHARED_TIER", "mooncake"), ("SHARED_MODEL_KEY", "m"),
                        ("SHARED_ADDRESS", mooncake_master.address),
                        ("SHARED_METRICS_ADDRESS", mooncake_master.metrics_address)):
        monkeypatch.setenv(getattr(cc, name), value)
    doctor.main_doctor(["--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    check = checks["shared tier (mooncake)"]
    assert check["status"] == "ok", check
    assert "Mem Storage: 0 B / 16.00 MB" in check["detail"] and "Clients: 1" in check["detail"]
    assert "evicted keys: 0" in check["detail"]
    # Without the metrics address: reachable, and told where the pool's report is.
    monkeypatch.delenv(cc.SHARED_METRICS_ADDRESS)
    check2 = doctor._shared_check()
    assert check2.status == "ok" and cc.SHARED_METRICS_ADDRESS in check2.detail


def test_a_wrong_metrics_address_fails_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                 mooncake_master: Any) -> None:
    wrong = f"127.0.0.1:{free_port()}"
    check = _shared(monkeypatch, SHARED_TIER="mooncake", SHARED_MODEL_KEY="m",
                    SHARED_ADDRESS=mooncake_master.address, SHARED_METRICS_ADDRESS=wrong)
    assert check.status == "fail" and f"{cc.SHARED_METRICS_ADDRESS}='{wrong}'" in check.detail


def test_redis_reports_its_memory_and_policy(monkeypatch: pytest.MonkeyPatch,
                                             redis_server_factory: Any) -> None:
    server = redis_server_factory(maxmemory="8mb", policy="allkeys-lru")
    check = _shared(monkeypatch, SHARED_TIER="redis", SHARED_MODEL_KEY="m",
                    SHARED_ADDRESS=server.unix_address)
    assert check.status == "warn" and "maxmemory_policy allkeys-lru" in check.detail
    assert "redis_version 7" in check.detail and "evicts without telling" in check.detail
    server.stop()
    check = doctor._shared_check()
    assert check.status == "fail" and f"{cc.SHARED_ADDRESS}=" in check.detail
