"""Sliding-window models on the consolidated stream, both consolidator loops: the strict
router view over the leader's consolidated output holds exactly the tiers' blocks (one name
per block, advertised only while every layer group holds it) and predicts what the engine
reused (testing/vswa_engine.py; leader/layer_groups.py)."""

from __future__ import annotations

import time
from typing import Any

from _loops import both_implementations
from _vswa import BS, OFF, WINDOW, _check_engine, _drive, settle

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.testing.vswa_engine import VswaConfig, VswaEngine
from kvbm_plugin.wire.events import to_signed_int64

loops = both_implementations("consolidator")


def _wait(condition: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_the_consolidated_stream_agrees_with_what_the_engine_reused(tmp_path) -> None:
    """Both consolidator loops, TP 2: the strict router view over the consolidated output
    holds exactly the tiers' blocks and predicts the engine's reuse on >= 99 % of tokens."""
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu",
           cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/gpu-replay",
           cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-replay",
           cc.CPU_CACHE_NUM_BLOCKS: "10", cc.DISK_CACHE_NUM_BLOCKS: "64", **OFF}
    sub = TreeSubscriber(env[cc.OUTPUT_ENDPOINT], env[cc.OUTPUT_REPLAY_ENDPOINT], start_seq=0,
                         view=RouterView(BS), worker="w")
    try:
        with VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW, tp_size=2,
                                   env=env)) as engine:
            leader = engine.leader
            assert leader is not None

            def route(tokens: list[int]) -> int:
                settle(engine)
                want = {(0, to_signed_int64(h)) for tier in ("host", "disk")
                        for h in leader.resident_hashes(tier)}

                def caught_up() -> bool:
                    sub.poll(10)
                    return sub.held == want

                _wait(caught_up, "the consolidated stream to show the tiers")
                return sub.view.cached_tokens(tokens)

            total, disagreed, loaded = _drive(engine, route, seed=3)
            _check_engine(engine)
            assert loaded > 0.2 * total and disagreed <= 0.01 * total, (loaded, disagreed)
            assert sub.view.counts.warnings == 0, sub.view.counts.as_dict()
    finally:
        sub.close()


def test_attention_dp_ranks_each_consolidate_their_own_groups(tmp_path) -> None:
    """Attention DP 2, both consolidator loops: each rank's own executor, leader and
    consolidated output; one strict view over both outputs predicts each rank's reuse."""
    from kvbm_plugin.cli.demo_adp import subscribers_for

    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu",
           cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/gpu-replay",
           cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-replay",
           cc.CPU_CACHE_NUM_BLOCKS: "10", cc.DISK_CACHE_NUM_BLOCKS: "64",
           cc.DISK_CACHE_DIR: str(tmp_path / "disk"), **OFF}
    view = RouterView(BS)
    subs = subscribers_for(cc.load_consolidator_config(env, num_ranks=2, attention_dp=True),
                           2, view)
    engines = []
    try:
        for r in range(2):
            engines.append(VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW,
                                                 attention_dp=2, dp_rank=r, env=env)))
        for r, engine in enumerate(engines):
            leader = engine.leader
            assert leader is not None

            def route(tokens: list[int], r: int = r, engine: VswaEngine = engine,
                      leader: Any = leader) -> int:
                settle(engine)
                want = {(r, to_signed_int64(h)) for tier in ("host", "disk")
                        for h in leader.resident_hashes(tier)}

                def caught_up() -> bool:
                    for sub in subs:
                        sub.poll(5)
                    return subs[r].held == want

                _wait(caught_up, f"rank {r}'s consolidated stream to show its tiers")
                return view.cached_tokens(tokens, dp_rank=r)

            total, disagreed, loaded = _drive(engine, route, seed=7 + r, turns=3)
            _check_engine(engine)
            assert loaded > 0 and disagreed <= 0.01 * total, (r, loaded, disagreed, total)
        assert view.counts.warnings == 0, view.counts.as_dict()
    finally:
        for engine in engines:
            engine.shutdown()
        for sub in subs:
            sub.close()
