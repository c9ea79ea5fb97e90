"""Dynamo's STREAMING mode (ai-dynamo 1.6.1's own ``dynamo.trtllm.publisher`` relays, the KV
router Dynamo's frontend routes with) reading the consolidated output that
``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT`` puts at the endpoint the engine YAML names, under
attention DP 2. The run is _dynamo_streaming.py, in a private network namespace (Dynamo's
planes bind addresses of their own choosing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _netns import netns_missing, run_in_netns


def _why_not() -> str | None:
    for module in ("dynamo.llm", "dynamo.trtllm.publisher"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install 'kvbm-plugin[interop]')"
        except ImportError:
            return f"{module} is not installed (pip install 'kvbm-plugin[interop]')"
    return netns_missing()


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_dynamos_streaming_relays_every_tier_of_each_rank_under_the_workers_id(
        tmp_path: Path) -> None:
    # any two consecutive ports: the namespace is private, nothing else binds there
    out = run_in_netns(Path(__file__).with_name("_dynamo_streaming.py"), tmp_path, 25557)
    assert out["requests"] == 30 and out["reused"] > out["asked"] // 3, out
    # base-model requests: Dynamo's router credits each what the engine then reused, every
    # tier included (host and disk blocks held by Dynamo), on the request's own dp rank only
    assert out["agreed"] == out["asked"], out
    assert out["host_or_disk_credited"] > 0, out
    assert out["other_rank"] == 0 and out["foreign"] == 0, out
    # Salted tenants, asked by the salt string a client sends: TensorRT-LLM's streaming events
    # carry no salt; the leader computes upstream's V2 names of its salted requests and hands
    # their scope to the consolidator. Each rank confirms the names' truncation from its own
    # stream (before, a rank whose requests finished before their names were read never did:
    # 0 %, 64 % or 100 % across runs).
    assert out["salted_reused"] > 0, out
    assert out["salted_agreed"] == out["salted_asked"], out
    # the limit: what the output published before Dynamo's relays subscribed is not replayed:
    # the GPU blocks stored then are not Dynamo's when its relays join (a later tier move
    # re-announces a block, in passthrough mode, as a host or disk block)
    assert out["warm_published"] >= 64 and out["warm_gpu_held_at_join"] >= 64, out
    assert out["warm_gpu_credited_at_join"] == 0, out
