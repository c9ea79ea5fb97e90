"""Attention DP end to end: every rank its own process (leader, worker, tiers, consolidator),
TensorRT-LLM's event gather onto rank 0, one router view over every rank's consolidated
output. Each rank's view must equal that rank's truth, no op may wait for another rank's
worker, and no rank but 0 may read its gathered event queue."""

from __future__ import annotations

import pytest

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.demo_adp import AdpRouterProbe, subscribers_for
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.adp import AttentionDpEngine
from kvbm_plugin.testing.engine import EngineConfig
from kvbm_plugin.wire.events import to_signed_int64

BS = 4


def _env(tmp_path) -> dict[str, str]:  # noqa: ANN001
    return {cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu",
            cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/gpu-replay",
            cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
            cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-replay",
            cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "64",
            cc.DISK_CACHE_DIR: str(tmp_path / "disk")}


def _prompt(rank: int, turn: int) -> list[int]:
    """Rank ``rank``'s own prefix (6 blocks), then a turn-specific tail."""
    return [100 * rank + i for i in range(6 * BS)] + [5000 + 10 * turn + rank, 7, 9]


# Without RequestData.block_hashes (TensorRT-LLM <= 1.2.x, every KVCacheManagerV2) a rank > 0
# learns its blocks' names from its own stream, which rank 0 publishes.
# (processes=False: every rank's engine in this process, exchanging events in memory.)
# Rank processes import torch (seconds each): without block hashes the ranks learn their names
# in this process by default, and in processes in the slow set (the processes' transport runs
# by default with block hashes, and without them in test_adp_trtllm_publisher.py).
@pytest.mark.parametrize(("ranks", "block_hashes", "processes"),
                         [(2, True, True), (2, False, False), (2, True, False),
                          pytest.param(2, False, True, marks=pytest.mark.slow),
                          # 4 ranks: 5 processes; the same paths as 2, in the slow set
                          pytest.param(4, True, True, marks=pytest.mark.slow)])
def test_attention_dp_ranks_in_processes(tmp_path, ranks: int, block_hashes: bool,
                                         processes: bool) -> None:
    config = EngineConfig(attention_dp=ranks, processes=processes, env=_env(tmp_path),
                          tokens_per_block=BS, num_gpu_blocks=12,
                          provide_block_hashes=block_hashes)
    with AttentionDpEngine(config) as engine:
        subscribers = subscribers_for(
            cc.load_consolidator_config(config.env, num_ranks=ranks, attention_dp=True),
            ranks, RouterView(BS))
        try:
            probe = AdpRouterProbe(engine, subscribers, settle_timeout=20.0)
            for turn in range(3):
                for r in range(ranks):
                    engine.submit(_prompt(r, turn), 2, dp_rank=r)
                engine.run_until_idle()
                # Another prompt per rank evicts the prefix from the small GPU pool: the next
                # turn's prefix comes back from the host tier.
                for r in range(ranks):
                    engine.submit([9000 + 100 * r + i for i in range(10 * BS)], 1, dp_rank=r)
                engine.run_until_idle()
            assert probe.settle()
            truth = engine.resident_blocks()
            for r, subscriber in enumerate(subscribers):
                # Rank r's output carries rank r only, and exactly what rank r's tiers hold.
                want = {(r, to_signed_int64(h)) for per_rank in truth.values()
                        for h in per_rank[r]}
                assert truth["GPU"][r] and truth["CPU"][r] and subscriber.held == want, r
                leader = engine.call(r, "leader_stats")
                # Every tier copy went out under TensorRT-LLM's name (none waits for one).
                assert leader["tier_stores_waiting_for_name"] == 0, leader
                # Each leader waited for its own worker only: every op completed.
                assert leader["ops_inflight"] == 0 and leader["saves_committed"] > 0, leader
                assert leader["reports_rejected"] == 0
            stats = engine.stats()
            assert stats.host_hit_tokens > 0 and stats.kv_mismatches == 0
            assert stats.requests_finished == stats.requests_submitted == 6 * ranks
            # Rank 0 published every rank's GPU-tier stream; no other rank read its queue
            # (TensorRT-LLM's exchange thread gathers it onto rank 0).
            assert [engine.call(r, "queue_reads") for r in range(1, ranks)] == [0] * (ranks - 1)
            assert all(engine.leader.event_sink.rank_batches_published(r) > 0
                       for r in range(ranks))
            assert probe.view.counts.warnings == 0
            assert probe.predict(_prompt(ranks - 1, 9), None, ranks - 1) > 0
            assert probe.predict(_prompt(ranks - 1, 9), None, 0) == 0  # ranks kept apart
        finally:
            for subscriber in subscribers:
                subscriber.close()


def test_unsupported_connector_is_refused_under_attention_dp(tmp_path, monkeypatch) -> None:
    """TensorRT-LLM's manager refuses a connector that did not opt in (validate_attention_dp);
    the simulated one does too."""
    from kvbm_plugin.connector_leader import KvbmConnectorLeader

    monkeypatch.setattr(KvbmConnectorLeader, "supports_attention_dp", False)
    with pytest.raises(NotImplementedError, match="supports_attention_dp"):
        AttentionDpEngine(EngineConfig(attention_dp=2, env=_env(tmp_path), tokens_per_block=BS))


def test_an_idle_rank_runs_dummy_passes_while_another_works(tmp_path) -> None:
    """TensorRT-LLM pads an attention-DP rank without requests with a dummy while another rank
    has work (``_pad_attention_dp_dummy_request``); the connector sees empty metadata, and the
    rank's passes flush its KV events and call ``get_finished``. With no work anywhere the
    loops block: no pass at all."""
    config = EngineConfig(attention_dp=2, env=_env(tmp_path), tokens_per_block=BS)
    with AttentionDpEngine(config) as engine:
        idle = engine.ranks[1].engine  # type: ignore[union-attr]
        manager = idle.kv_cache_connector_manager
        engine.submit(_prompt(0, 0), 3, dp_rank=0)
        engine.run_until_idle()
        builds, finished_calls = manager.metadata_builds, manager.get_finished_calls
        assert builds > 0 and finished_calls >= builds
        assert idle.leader.stats()["requests_tracked"] == 0
        assert idle.workers[0].get_connector_meta().is_empty()
        passes = idle.stats().iterations
        for _ in range(3):
            engine.step()
        assert (manager.metadata_builds, idle.stats().iterations) == (builds, passes)


def test_each_rank_is_its_own_llm_d_pod_with_a_dp_rank_field_in_the_topic(tmp_path) -> None:
    """``DYN_KVBM_KV_EVENTS_TOPIC=kv@pod-0-dp{dp_rank}@m``: each rank's consolidated output
    names its own pod, so llm-d (which drops a batch's dp rank; routers/llmd_model.py) credits
    each rank's prefix to that rank only."""
    from kvbm_plugin.routers.llmd_model import LlmdIndexer, llmd_tap

    env = {**_env(tmp_path), cc.TOPIC: "kv@pod-0-dp{dp_rank}@m",
           cc.CONSOLIDATOR_MODE: "passthrough"}
    config = EngineConfig(attention_dp=2, processes=False, env=env, tokens_per_block=BS,
                          num_gpu_blocks=12)
    llmd = LlmdIndexer(block_size=BS)
    with AttentionDpEngine(config) as engine:
        consolidator = cc.load_consolidator_config(env, num_ranks=2, attention_dp=True)
        view = RouterView(BS)
        taps = [llmd_tap([llmd], consolidator.for_dp_rank(r).output.connect,
                         consolidator.for_dp_rank(r).output_replay.connect, start_seq=0,
                         view=view) for r in range(2)]
        try:
            probe = AdpRouterProbe(engine, taps, settle_timeout=20.0)
            for turn in range(2):
                for r in range(2):
                    engine.submit(_prompt(r, turn), 2, dp_rank=r)
                engine.run_until_idle()
            assert probe.settle()
        finally:
            for tap in taps:
                tap.close()
    assert llmd.counts["parse_errors"] == 0 and llmd.counts["unknown_parent_stores"] == 0
    for r in range(2):
        prefix = _prompt(r, 0)[:6 * BS]
        assert set(llmd.match(prefix, "m")) == {f"pod-0-dp{r}"}, r
        assert llmd.cached_tokens(prefix, "m", pod=f"pod-0-dp{r}") == 6 * BS
