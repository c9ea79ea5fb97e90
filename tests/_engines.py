"""Helpers of the tests that drive the simulated engine: tier settings and prompts (the engine
factory fixture, ``make_engine``, is in conftest.py)."""

from __future__ import annotations

import threading
from typing import Any

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


def flush_gpu(engine: Any, count: int, n: int = 40) -> None:
    """Run unrelated requests until the GPU pool has evicted everything older."""
    for k in range(count):
        engine.submit(prompt(500 + k, n), 1)
        engine.run_until_idle()



def adp_truth(engine, r: int) -> set[tuple[int, int]]:  # noqa: ANN001
    """What rank ``r`` of an attention-DP engine holds, as ``(dp rank, signed hash)``: its GPU
    blocks under TensorRT-LLM's own wire names, its host and disk blocks."""
    from kvbm_plugin.wire.events import to_signed_int64

    resident = engine.call(r, "resident_blocks")
    tiers = resident["CPU"][r] | resident["DISK"][r]
    return ({(r, h) for h in engine.call(r, "gpu_wire_hashes")}
            | {(r, to_signed_int64(h)) for h in tiers})


def adp_settled(engine, subscribers) -> bool:  # noqa: ANN001
    """One poll of each rank's subscriber, then whether every rank's view equals its truth
    (a tier copy is advertised once its name came back on the rank's own stream: none may
    still wait for one)."""
    for subscriber in subscribers:
        subscriber.poll(10)
    return all(engine.call(r, "leader_stats")["tier_stores_waiting_for_name"] == 0
               and s.held == adp_truth(engine, r) for r, s in enumerate(subscribers))


def held_disk(monkeypatch: Any, method: str) -> threading.Event:
    """``DiskTier.<method>`` ("read" or "write") waits for the returned event before it runs
    (30 s at most): set it to let the held calls through."""
    from kvbm_plugin.tiers.disk import DiskTier

    original = getattr(DiskTier, method)
    release = threading.Event()

    def held(self: Any, *args: Any) -> Any:
        release.wait(30)
        return original(self, *args)

    monkeypatch.setattr(DiskTier, method, held)
    return release
