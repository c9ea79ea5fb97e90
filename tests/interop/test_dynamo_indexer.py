"""The plugin's streams, fed to NVIDIA Dynamo's real KV indexer
(kvbm_plugin.routers.dynamo_indexer).

The simulated engine (real leader, worker, tiers, event sink and consolidator) runs chat turns;
the indexer subscribes to the GPU-tier stream (worker 1) and the consolidated stream (worker 2)
with their replay endpoints. Each test asserts that the indexer logged no warning (no event it
could not decode or apply: an unknown parent, an unknown removal, a bad batch) and that what it
holds is exactly what the GPU pool and the tiers hold: the GPU pool on worker 1; on worker 2
the union of GPU pool and tiers (dedup) or each medium on its own tier (passthrough).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.testing.chat_workload import TurnWaves, drive
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.wire.events import to_signed_int64

BS = 4
GPU_WORKER, CONSOLIDATED_WORKER = 1, 2


def _env(tmp: Path, mode: str, topic: str = "") -> dict[str, str]:
    return {
        cc.TOPIC: topic,
        cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: mode,
        cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-r",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/out", cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/out-r",
        cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "48",
        cc.DISK_CACHE_DIR: f"{tmp}/disk",
    }


def _register(indexer: Indexer, config: Any) -> None:
    indexer.register(GPU_WORKER, config.publish_endpoint(0).connect,
                     config.replay_endpoint(0).connect, BS)
    indexer.register(CONSOLIDATED_WORKER, config.output.connect, config.output_replay.connect,
                     BS)


def _expected(engine: SimulatedEngine, mode: str) -> dict[tuple[int, int, str], set[int]]:
    truth = {medium: {to_signed_int64(h) for h in per_rank[0]}
             for medium, per_rank in engine.resident_blocks().items()}
    out = {(GPU_WORKER, 0, "GPU"): truth["GPU"]}
    if mode == "dedup":
        out[(CONSOLIDATED_WORKER, 0, "GPU")] = set().union(*truth.values())
    else:
        out.update({(CONSOLIDATED_WORKER, 0, m): hashes for m, hashes in truth.items()})
    return {k: v for k, v in out.items() if v}


def _settled(engine: SimulatedEngine, indexer: Indexer, mode: str, *, timeout: float,
             required: bool = False) -> bool:
    """Whether the indexer comes to hold exactly the engine's blocks within ``timeout``."""
    # ``drive`` returns with the last requests' saves (and the demotions their evictions
    # started) still in flight: the truth is read once every transfer is applied, or a
    # tier's blocks committed after it was read show up as held and not resident (each medium
    # is its own tier in passthrough; dedup's union does not change when a block moves).
    engine.run_until_idle(timeout_s=60)
    engine.leader.flush_events()
    assert engine.leader.consolidator.wait_idle(10)
    expected = _expected(engine, mode)
    assert expected, "the workload left nothing cached"
    try:
        indexer.wait_for(lambda: indexer.held() == expected, "held == truth", timeout=timeout)
    except TimeoutError:
        if required:  # what differs, for the next reader of a failure (seen once, under load)
            held = indexer.held()
            diff = {key: (len(held.get(key, set()) - want), len(want - held.get(key, set())))
                    for key, want in expected.items()}
            diff.update({key: (len(got), 0) for key, got in held.items() if key not in expected})
            raise AssertionError(f"indexer held != truth after {timeout} s: per (worker, dp "
                                 f"rank, medium), (blocks held not resident, resident not held)"
                                 f": {diff}; the engine's stats {engine.leader.stats()}") from None
        return False
    return True


def _run(indexer: Indexer, tmp: Path, *, mode: str = "dedup", tp: int = 1,
         salts: tuple[str, ...] = (), late_join: bool = False,
         topic: str = "", extra_env: dict[str, str] | None = None) -> SimulatedEngine:
    env = {**_env(tmp, mode, topic), **(extra_env or {})}
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=32,
        tp_size=tp, max_num_tokens=128, max_batch_size=4, dtype=torch.float32, env=env,
        vocab_size=30000))
    try:
        if not late_join:
            _register(indexer, config)
        workload = TurnWaves(sessions=4, turns=4, system_tokens=16, user_tokens=8,
                             gen_tokens=3, seed=5, salts=salts)
        drive(engine, None, workload, timeout_s=120)
        if late_join:
            # Joined after every batch so far: the next batch shows the indexer the gap, and
            # the replay buffers fill it from seq 0.
            _register(indexer, config)
        # The indexer's SUB connects asynchronously (a slow joiner, seconds on a loaded
        # machine): batches sent before it listens reach it only through the replay that a
        # later batch triggers. So waves go on, each with its own bounded wait, until one
        # has reached it.
        if late_join or not _settled(engine, indexer, mode, timeout=5.0):
            for seed in range(6, 12):
                drive(engine, None, TurnWaves(sessions=2, turns=1, system_tokens=16,
                                              user_tokens=8, gen_tokens=3, seed=seed,
                                              salts=salts), timeout_s=60)
                if _settled(engine, indexer, mode, timeout=5.0):
                    break
        _settled(engine, indexer, mode, timeout=20.0, required=True)
        assert indexer.warnings() == []
        return engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_the_indexer_holds_what_the_engine_holds(indexer: Indexer, tmp_path: Path,
                                                 mode: str) -> None:
    _run(indexer, tmp_path, mode=mode)


@pytest.mark.parametrize("disk", ["0", "12"], ids=["host-only", "host-and-disk"])
def test_evictions_ahead_of_need_reach_the_indexer(indexer: Indexer, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   disk: str) -> None:
    """The keeper's evictions and demotions ahead of need (forced on these small tiers; in a
    deployment only from 16,384 blocks) reach Dynamo's indexer as the removals and stores it
    applies: it ends holding exactly what each tier holds, with no warning."""
    from kvbm_plugin.leader import offload_tiers

    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_MIN_CAPACITY", 1)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_SLOTS", 3)
    monkeypatch.setattr(offload_tiers, "EVICT_AHEAD_STEP", 2)
    extra = {cc.CPU_CACHE_NUM_BLOCKS: "12", cc.DISK_CACHE_NUM_BLOCKS: disk}
    if disk == "0":
        extra[cc.DISK_CACHE_DIR] = ""
    engine = _run(indexer, tmp_path, mode="passthrough", extra_env=extra)
    stats = engine.leader.stats()
    assert stats["evicted_ahead"] > 0
    # (and, in front of a disk tier, the host tier's victims demoted ahead of need)
    assert (stats["demoted_ahead"] > 0) == (disk != "0")


def test_an_llm_d_topic_is_read_too(indexer: Indexer, tmp_path: Path) -> None:
    # DYN_KVBM_KV_EVENTS_TOPIC=kv@<pod>@<model> (llm-d's convention, docs/operations.md
    # "llm-d"): Dynamo's indexer subscribes to every topic and holds the same blocks.
    _run(indexer, tmp_path, mode="passthrough", topic="kv@pod-0@demo-model")


def test_tensor_parallel_2(indexer: Indexer, tmp_path: Path) -> None:
    _run(indexer, tmp_path, tp=2, mode="passthrough")


def test_two_tenants_sharing_a_system_prompt_stay_apart(indexer: Indexer,
                                                        tmp_path: Path) -> None:
    salts = ("tenant-a", "tenant-b")
    engine = _run(indexer, tmp_path, salts=salts)
    assert engine.stats().prompt_tokens
    # Each tenant's system prompt is held under its own namespace, and only there: the salt
    # string the client sends (DYN_KVBM_KV_EVENTS_SALT_FORM=client, the default; Dynamo
    # reads the output's top-level cache_salt); the GPU-tier stream (worker 1) still names it
    # by the id's hex, as the plugin keys it inside.
    first = next(iter(indexer.held().values()))
    assert first
    system = _system_prompt(salts)
    for salt in salts:
        assert indexer.cached_tokens(system, cache_salt=salt) == len(system)
    assert indexer.cached_tokens(system) == 0
    assert indexer.cached_tokens(system, cache_salt="tenant-c") == 0


def _system_prompt(salts: tuple[str, ...]) -> list[int]:
    workload = TurnWaves(sessions=4, turns=4, system_tokens=16, user_tokens=8, gen_tokens=3,
                         seed=5, salts=salts)
    request = workload.next_request()
    assert request is not None
    return request.prompt[:16]


def test_a_late_join_is_repaired_by_replay(indexer: Indexer, tmp_path: Path) -> None:
    _run(indexer, tmp_path, mode="passthrough", late_join=True)
    assert indexer.count("Replay complete") >= 2  # both streams were replayed from seq 0
