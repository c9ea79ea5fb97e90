"""Helpers of the tests that drive the simulated engine: tier settings and prompts (the engine
factory fixture, ``make_engine``, is in conftest.py)."""

from __future__ import annotations

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

