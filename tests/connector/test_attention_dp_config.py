"""Attention DP: what each rank's leader reads from TensorRT-LLM's mapping, and the one rule
that gives every rank its own sockets (the collision check covers all of them)."""

from __future__ import annotations

import pytest

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.connector import llm_args
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig


def test_each_attention_dp_rank_is_a_group_of_one() -> None:
    """TensorRT-LLM's mapping reports tp_size = the dp size under attention DP; a leader that
    took it as its group size waited for reports from other ranks' workers forever."""
    par = llm_args.parallel_of(LlmArgs(KvCacheConfig(4), ParallelConfig(
        1, 2, enable_attention_dp=True)))
    assert (par.tp_size, par.tp_rank, par.dp_rank, par.dp_size) == (1, 0, 1, 2)
    plain = llm_args.parallel_of(LlmArgs(KvCacheConfig(4), ParallelConfig(1, 2)))
    assert (plain.tp_size, plain.tp_rank, plain.dp_rank, plain.dp_size) == (2, 1, 0, 1)


def _env(**extra: str) -> dict[str, str]:
    return {cc.TRTLLM_ZMQ_PORT: "20000", cc.LEADER_ZMQ_PUB_PORT: "30000", **extra}


def test_every_rank_has_its_own_sockets() -> None:
    env = _env(**{cc.SHARED_TIER: "redis", cc.SHARED_MODEL_KEY: "m", cc.METRICS: "1",
                  cc.METRICS_PORT: "40000"})
    config = cc.load_consolidator_config(env, num_ranks=4, attention_dp=True)
    ports = {r: config.for_dp_rank(r) for r in range(4)}
    assert [ports[r].output.port for r in range(4)] == [31000, 31001, 31002, 31003]
    assert [ports[r].stream_ranks() for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [config.publish_endpoint(r).port for r in range(4)] == [20000, 20001, 20002, 20003]
    sockets = {(r, role): e.port for r, role, e in cc.dp_rank_sockets(env, 4)}
    assert sockets[(3, "completion-report port")] == 30003
    assert sockets[(3, "shared-tier announce endpoint")] == 32003
    assert sockets[(3, "metrics port")] == 40003


@pytest.mark.parametrize(("extra", "words"), [
    # rank 1's report port would take rank 0's GPU-tier publisher port
    ({cc.TRTLLM_ZMQ_PORT: "30001"}, "dp rank 1 completion-report port"),
    # rank 1's consolidated output would take rank 0's shared-tier announce port
    ({cc.LEADER_ZMQ_PUB_PORT: "30000", cc.OUTPUT_ENDPOINT: "tcp://127.0.0.1:31999",
      cc.SHARED_TIER: "redis", cc.SHARED_MODEL_KEY: "m"}, "shared-tier announce"),
])
def test_collisions_between_ranks_are_refused(extra: dict[str, str], words: str) -> None:
    env = _env(**extra)
    cc.load_consolidator_config(env, num_ranks=2)  # one leader: no clash
    with pytest.raises(cc.ConfigError, match=words):
        cc.load_consolidator_config(env, num_ranks=2, attention_dp=True)
