"""Attention DP with TensorRT-LLM's own streaming publisher as the GPU-tier source (issue 26,
item 6), end to end through the simulated executor: each rank binds its own endpoint (upstream's
``offset_endpoint_port``: ipc path + ``_dp{r}``), nothing is gathered onto rank 0, each rank's
leader consolidates its own rank's stream with its tiers, and a router following every rank's
consolidated output holds exactly what each rank's GPU pool and tiers hold."""

from __future__ import annotations

import pytest
from _engines import adp_settled, adp_truth
from _kvwire import wait_until

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.demo_adp import subscribers_for
from kvbm_plugin.events.trtllm_publisher import trtllm_streams
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.adp import AttentionDpEngine
from kvbm_plugin.testing.engine import EngineConfig
from kvbm_plugin.testing.fake_trtllm import KVEventsConfig

BS = 4
RANKS = 2


def _prompt(rank: int, turn: int) -> list[int]:
    return [100 * rank + i for i in range(6 * BS)] + [5000 + 10 * turn + rank, 7, 9]


@pytest.mark.parametrize("processes", [False, True])
def test_each_rank_streams_on_its_own_endpoint_and_the_router_sees_each_ranks_truth(
        tmp_path, processes: bool) -> None:
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/trt",
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-replay",
           cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "64",
           cc.DISK_CACHE_DIR: str(tmp_path / "disk")}
    config = EngineConfig(attention_dp=RANKS, processes=processes, env=env,
                          tokens_per_block=BS, num_gpu_blocks=12, kv_events_config=events,
                          provide_block_hashes=False)
    with AttentionDpEngine(config) as engine:
        rank0 = engine.rank0.kv_cache_manager
        # upstream's per-rank rule: rank 0 as given, rank r the path + "_dp{r}"
        assert rank0.publisher.endpoint == f"ipc://{tmp_path}/trt"
        if not processes:
            rank1 = engine.ranks[1].engine.kv_cache_manager  # type: ignore[union-attr]
            assert rank1.publisher.endpoint == f"ipc://{tmp_path}/trt_dp1"
        view = RouterView(BS)
        streams = trtllm_streams(rank0.trtllm_pub, 0, "127.0.0.1")
        subscribers = subscribers_for(cc.load_consolidator_config(
            env, num_ranks=RANKS, attention_dp=True, gpu_streams=streams), RANKS, view)
        try:
            for turn in range(3):
                for r in range(RANKS):
                    engine.submit(_prompt(r, turn), 2, dp_rank=r)
                engine.run_until_idle()
                for r in range(RANKS):  # evicts the prefix: the next turn loads it from host
                    engine.submit([9000 + 100 * r + i for i in range(10 * BS)], 1, dp_rank=r)
                engine.run_until_idle()
            for r in range(RANKS):
                engine.call(r, "publish_now")

            def truth(r: int) -> set[tuple[int, int]]:
                return adp_truth(engine, r)

            def settled() -> bool:
                return adp_settled(engine, subscribers)

            wait_until(settled, 20, "each rank's consolidated view = its GPU pool + tiers")
            for r, subscriber in enumerate(subscribers):
                resident = engine.call(r, "resident_blocks")
                assert engine.call(r, "gpu_wire_hashes") and resident["CPU"][r]
                assert engine.call(r, "stream_batches") > 0
                # every tier copy went out under a name this rank's own stream gave it
                names = {h & ((1 << 64) - 1) for h in engine.call(r, "stream_names")}
                assert resident["CPU"][r] | resident["DISK"][r] <= names
                assert subscriber.stats.orphan_stores == subscriber.stats.unknown_removes == 0
            # no second GPU-tier stream from the plugin (ranks > 0 have no sink at all)
            assert engine.leader.event_sink.stats()["events_in"] == 0
            assert view.counts.warnings == 0
            stats = engine.stats()
            assert stats.host_hit_tokens > 0 and stats.kv_mismatches == 0
        finally:
            for subscriber in subscribers:
                subscriber.close()
