"""Dynamo's frontend (``python -m dynamo.frontend --router-mode kv``, ai-dynamo 1.6.1, over
HTTP) and the KV router it runs (ai-dynamo-runtime 1.6.1: ``KvRouter``), fed the consolidated
output through Dynamo's own relay (``KvEventPublisher(zmq_endpoint=...)``) under a registered
worker, on a workload of the demo's steady multi-tenant chat (``kvbm-plugin demo --requests 48
--tenants 2 --adapters 2``: salted tenants on the base model and two adapters), each request
asking with its own salt string and adapter name (``DYN_KVBM_LORA_NAMES``). The run is
_frontend_router.py, in a private network namespace (Dynamo's planes bind addresses of their
own choosing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _netns import netns_missing, run_in_netns


def _why_not(mode: str) -> str | None:
    if importlib.util.find_spec("dynamo") is None or \
            importlib.util.find_spec("dynamo.llm") is None:
        return "ai-dynamo-runtime is not installed (pip install 'kvbm-plugin[interop]')"
    if mode != "router" and (importlib.util.find_spec("dynamo.frontend") is None
                             or importlib.util.find_spec("yaml") is None):
        return "Dynamo's frontend needs ai-dynamo and pyyaml (pip install --no-deps " \
            "ai-dynamo==1.6.1 pyyaml)"
    if mode == "streaming" and importlib.util.find_spec("dynamo.trtllm.publisher") is None:
        return "dynamo.trtllm.publisher is not installed (pip install --no-deps ai-dynamo)"
    return netns_missing()


def _run(script: str, tmp_path: Path, mode: str) -> dict:
    """The script's JSON tallies, run in a private network namespace."""
    return run_in_netns(Path(__file__).with_name(script), tmp_path, mode)


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=pytest.mark.skipif(_why_not(m) is not None, reason=str(_why_not(m))))
    for m in ("router", "http")])
def test_dynamos_kv_router_credits_tenants_and_adapters_as_the_engine_reused(
        tmp_path: Path, mode: str) -> None:
    # router: KvRouter.get_overlap_scores in the worker's process; http: Dynamo's frontend
    # process routes each request (its kv_hit_rate), as a client sends it
    out = _run("_frontend_router.py", tmp_path, mode)
    assert out["requests"] == 48 and out["reused"] > out["asked"] // 3
    # the demo's tenants on the base model and both adapters were asked
    assert {"tenant-0/None", "tenant-1/adapter-0", "tenant-0/adapter-1"} <= set(out["scopes"])
    assert out["agreed"] / out["asked"] >= 0.99, out
    assert out["foreign"] == 0, out  # a salt nobody used is credited nothing
    if mode == "http":  # every ask was a request the frontend routed to the worker
        assert out["frontend_requests"] >= 2 * out["requests"], out
        assert out["served"] >= out["frontend_requests"], out


@pytest.mark.parametrize("relay", [
    pytest.param(m, marks=pytest.mark.skipif(_why_not(m) is not None, reason=str(_why_not(m))))
    for m in ("relay", "streaming")])
def test_dynamos_frontend_routes_each_request_to_the_worker_whose_tiers_hold_its_prefix(
        tmp_path: Path, relay: str) -> None:
    # Two workers (engine, plugin, Dynamo's relay each) behind Dynamo's frontend process, which
    # picks the worker; the chosen worker serves the request on its engine (_frontend_workers.py).
    # relay: Dynamo's KvEventPublisher on the consolidated output, made by hand; streaming:
    # README's configuration (TensorRT-LLM's own publisher moved, the output at the YAML's
    # endpoint, Dynamo's STREAMING relay from dynamo.trtllm.publisher)
    out = _run("_frontend_workers.py", tmp_path, relay)
    assert out["requests"] == 48 and out["reused"] > out["asked"] // 3, out
    assert {"tenant-0/None", "tenant-1/adapter-0", "tenant-0/adapter-1"} <= set(out["scopes"])
    assert len(out["served"]) == 2, out  # both workers served requests
    # each request went to a worker holding the most of its prefix (any tier), and the
    # frontend's credit for it agreed with what that worker's engine then reused
    assert out["best_worker"] == out["requests"], out
    assert out["agreed"] / out["asked"] >= 0.99, out
    assert out["tier_reused"] > 0, out  # host and disk prefixes were routed to and onboarded
    assert out["foreign"] == 0, out
