"""Two engines, two "nodes": a prefix one computed is onboarded by the other from Mooncake Store.

Each engine is a process of its own (``testing.engine_process``) with its own leader, host
tier, consolidator (passthrough: each medium on its own) and TP 2 (rank 1 in a further
process); both share one private ``mooncake_master`` on loopback and announce their writes to
each other. A router view subscribes to both consolidated streams.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from _engines import prompt

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.testing.local_server import ServerError
from kvbm_plugin.wire.events import to_unsigned_u64

BS = 4
REQUIRE = os.environ.get("KVBM_REQUIRE_SHARED") == "1"


def _unavailable(reason: str) -> None:
    if REQUIRE:
        pytest.fail(f"KVBM_REQUIRE_SHARED=1 and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Any]:
    from kvbm_plugin.consolidator_config import ConfigError
    from kvbm_plugin.testing.mooncake_master import MooncakeMaster
    from kvbm_plugin.tiers.shared.mooncake import import_client

    try:
        import_client()
    except ConfigError as exc:
        _unavailable(f"Mooncake is not installed ({exc})")
    try:
        server = MooncakeMaster(tmp_path / "master").start()
    except ServerError as exc:
        _unavailable(str(exc))
    yield server
    server.kill()  # after the engines' shutdown; a SIGTERM'd mooncake_master takes ~1 s to go


def engine_env(tmp: Path, name: str, other: str, master: Any) -> dict[str, str]:
    return {
        cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
        cc.EVENTS_ENDPOINT: f"ipc://{tmp}/{name}-gpu",
        cc.REPLAY_ENDPOINT: f"ipc://{tmp}/{name}-gpu-replay",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/{name}-out",
        cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/{name}-out-replay",
        cc.CPU_CACHE_NUM_BLOCKS: "64",
        cc.SHARED_TIER: "mooncake", cc.SHARED_MODEL_KEY: "sim-model",
        cc.SHARED_ADDRESS: master.address, cc.SHARED_METRICS_ADDRESS: master.metrics_address,
        cc.SHARED_SEGMENT_GB: "0.03125", cc.SHARED_BUFFER_GB: "0",
        cc.SHARED_ANNOUNCE_ENDPOINT: f"ipc://{tmp}/{name}-announce",
        cc.SHARED_PEERS: f"ipc://{tmp}/{other}-announce",
        cc.SHARED_ANNOUNCE_SECRET_FILE: str(secret_file(tmp)),
    }


def secret_file(tmp: Path) -> Path:
    """The two engines' announcement secret (one file, both read it)."""
    path = tmp / "announce.secret"
    if not path.exists():
        path.write_bytes(os.urandom(32).hex().encode())
    return path


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def engines(tmp_path: Path, master: Any) -> Iterator[tuple[Any, Any, dict]]:
    from kvbm_plugin.testing.engine_process import EngineProcess

    envs = {"a": engine_env(tmp_path, "a", "b", master),
            "b": engine_env(tmp_path, "b", "a", master)}
    # Both brought up and shut down side by side: each takes seconds (processes starting,
    # Mooncake clients closing), and neither waits on the other (wait_subscribed below).
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(EngineProcess, name, {
            "num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "tokens_per_block": BS,
            "num_gpu_blocks": 48, "tp_size": 2, "processes": True, "env": envs[name]})
            for name in ("a", "b")]
    made = [f.result() for f in starting if f.exception() is None]
    try:
        for f in starting:
            f.result()  # the first bring-up error, raised once both are done
        for eng in made:  # each hears every announcement of the other from now on
            eng.wait_subscribed(1)
        yield made[0], made[1], envs
    finally:
        with ThreadPoolExecutor(2) as pool:
            for stopped in [pool.submit(eng.shutdown) for eng in made]:
                stopped.result()


def subscriber(env: dict[str, str], worker: str) -> Any:
    from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber

    return TreeSubscriber(env[cc.OUTPUT_ENDPOINT], env[cc.OUTPUT_REPLAY_ENDPOINT], start_seq=0,
                          view=RouterView(BS), worker=worker)


def external(view: Any, worker: str) -> set[int]:
    """The u64 hashes ``worker`` holds in the EXTERNAL tier, as the view shows them."""
    return {to_unsigned_u64(h) for _, h, tier in view.held(worker) if tier == "EXTERNAL"}


def test_a_prefix_computed_by_one_engine_is_onboarded_by_the_other_byte_exact(engines) -> None:
    a, b, envs = engines
    subs = [subscriber(envs["a"], "a"), subscriber(envs["b"], "b")]
    try:
        system, tenant = prompt(1, 8 * BS), prompt(2, 6 * BS)
        ra = a.run([(system + prompt(3, 3), 2, None), (tenant + prompt(4, 3), 2, "t1")])
        assert all(r["finished"] and r["kv_mismatches"] == 0 for r in ra), ra
        a.settle()
        wait_for(lambda: len(b.stats()["shared"]) >= 14, "B to hear A's 14 blocks")
        b.settle()
        rb = b.run([(system + prompt(5, 3), 2, None), (tenant + prompt(6, 3), 2, "t2"),
                    (tenant + prompt(7, 3), 2, None), (tenant + prompt(8, 3), 2, "t1")])
        assert all(r["finished"] and r["kv_mismatches"] == 0 for r in rb), rb
        # B onboards what A computed (the whole system prompt; the tenant's under its salt
        # only), and nothing across tenants.
        assert [r["shared"] for r in rb] == [8 * BS, 0, 0, 6 * BS]
        assert [r["host"] for r in rb] == [0, 0, 0, 0]
        # The bytes on every rank are A's.
        for r_a, r_b, n in ((ra[0], rb[0], 8), (ra[1], rb[3], 6)):
            mine, theirs = (a.block_bytes(r_a["request_id"], n),
                            b.block_bytes(r_b["request_id"], n))
            assert len(mine) == 2 and mine == theirs
        stats = b.stats()
        assert sum(r["shared_loads"] for r in stats["ranks"]) == 2 * 14
        assert sum(r["shared_loads_failed"] for r in stats["ranks"]) == 0
        # The router sees B advertise, as EXTERNAL, exactly the blocks B can load.
        b.settle()
        a.settle()

        def advertised() -> bool:
            for sub in subs:
                sub.poll(20)
            return external(subs[1].view, "b") == {to_unsigned_u64(h)
                                                    for h in b.stats()["shared"]}

        wait_for(advertised, "B's EXTERNAL blocks on its consolidated stream")
        assert external(subs[0].view, "a") == {to_unsigned_u64(h) for h in a.stats()["shared"]}
        for sub in subs:
            assert sub.view.counts.warnings == 0, sub.view.counts.broken()
        assert not a.stats()["errors"] and not b.stats()["errors"]
        # The router would send the system prompt to B as well: B holds it as EXTERNAL.
        match = {m.worker: m for m in subs[1].view.match(system + [1])}
        assert match["b"].blocks_by_medium.get("EXTERNAL", 0) == 8
    finally:
        for sub in subs:
            sub.close()


# 20-30 s (the store's clients re-mount about a second after the master is back, then the
# agents' probes): in the slow set. The breaker and the directory's recovery after a master
# restart run by default in tests/tiers/shared/test_mooncake_faults.py and
# tests/connector/test_shared_tier.py.
@pytest.mark.slow
def test_the_master_stopped_and_restarted_mid_run(engines, master) -> None:
    a, b, envs = engines
    sub = subscriber(envs["b"], "b")
    try:
        first = prompt(10, 6 * BS)
        a.run([(first + prompt(11, 3), 2, None)])
        a.settle()
        wait_for(lambda: len(b.stats()["shared"]) >= 7, "B to confirm A's blocks")
        master.stop()
        # Both engines go on with their local tiers; every shared-tier failure is counted.
        second = prompt(12, 6 * BS)
        ra = a.run([(second + prompt(13, 3), 2, None), (first + prompt(14, 3), 2, None)])
        assert all(r["finished"] and r["kv_mismatches"] == 0 for r in ra), ra
        assert ra[1]["gpu_hit"] + ra[1]["host"] >= 6 * BS  # its own copies, not the store's
        a.settle()
        leader_a = a.stats()["leader"]
        assert leader_a["shared_saves_failed"] + leader_a["shared_saves_skipped_unavailable"] > 0
        rb = b.run([(second + prompt(15, 3), 2, None)])
        assert rb[0]["finished"] and rb[0]["kv_mismatches"] == 0 and rb[0]["shared"] == 0
        # B stops advertising what it can no longer load.
        wait_for(lambda: not b.stats()["leader"]["shared_agent_available"]
                 or not b.stats()["shared"], "B's agent to see the store gone")
        master.restart()  # same ports; an empty pool
        wait_for(lambda: a.stats()["leader"]["shared_agent_available"]
                 and b.stats()["leader"]["shared_agent_available"], "the agents to reconnect",
                 timeout=60)
        # B's blocks of the old pool are gone from its directory and from its stream.
        wait_for(lambda: not b.stats()["shared"], "B to drop the blocks the restart lost",
                 timeout=60)
        b.settle()

        def advertised() -> set[int]:
            sub.poll(20)
            return external(sub.view, "b")

        wait_for(lambda: not advertised(), "B's stream to remove them")
        third = prompt(16, 6 * BS)
        deadline = time.monotonic() + 60
        while True:  # the workers' clients re-mount their segments about a second after the
            # master is back: a write-through before that fails and is written again from
            # the host copy by the next request that uses it
            a.run([(third + prompt(17, 3), 2, None)])
            a.settle()
            if len(a.stats()["shared"]) >= 6 or time.monotonic() > deadline:
                break
            third = third[:-1] + [third[-1] + 1]
        wait_for(lambda: len(b.stats()["shared"]) >= 6, "B to confirm A's new blocks")
        b.settle()
        rb = b.run([(third + prompt(18, 3), 2, None)])
        assert rb[0]["shared"] == 6 * BS and rb[0]["kv_mismatches"] == 0
        for eng in (a, b):
            assert not eng.stats()["errors"], eng.stats()["errors"]
        assert sub.view.counts.warnings == 0, sub.view.counts.broken()
    finally:
        sub.close()
