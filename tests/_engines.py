"""Helpers of the tests that drive the simulated engine: tier settings, prompts, and an engine
factory fixture that shuts every engine it made down (import the fixture into a test module)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

OFF = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false"}


def tiers(host: int = 0, disk: int = 0, **extra: str) -> dict[str, str]:
    """Connector settings with no consolidator and the given tier sizes in blocks."""
    env = dict(OFF)
    if host:
        env["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"] = str(host)
    if disk:
        env["DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS"] = str(disk)
    env.update(extra)
    return env


def prompt(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids, distinct per seed."""
    return [(seed * 1000 + i * 7) % 997 + 1 for i in range(n)]


@pytest.fixture
def make_engine() -> Iterator[Callable[..., SimulatedEngine]]:
    """Builds engines from EngineConfig keywords; shuts each down after the test."""
    engines: list[SimulatedEngine] = []

    def make(**kw: Any) -> SimulatedEngine:
        engine = SimulatedEngine(EngineConfig(**kw))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
