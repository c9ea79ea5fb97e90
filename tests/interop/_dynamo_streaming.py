"""Run inside a private network namespace by test_dynamo_streaming_relay.py: Dynamo's STREAMING mode
as ``dynamo.trtllm`` runs it, over the simulated engine under attention DP 2 with
``DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT`` set.

The engine YAML's ``kv_cache_config.kv_events_config`` (tcp, a topic) is handed, as in
``llm_worker.py``, to TensorRT-LLM (here the simulated engine, whose leaders move TensorRT-LLM's
publisher and take the endpoint) and, once the engine is up, to Dynamo's own
``dynamo.trtllm.publisher.get_publisher`` in STREAMING mode (ai-dynamo 1.6.1), which creates one
relay per attention-DP rank (``KvEventPublisher(zmq_endpoint=<endpoint + r>, zmq_topic,
dp_rank=r)``) under the registered worker's id. Before each request the KV router Dynamo's
frontend runs (``KvRouter.get_overlap_scores``) is asked with the request's own salt string;
its blocks for (worker, the request's rank) are compared with what the engine then reused.
Prints one JSON line with the tallies.

Usage: python _dynamo_streaming.py TMPDIR PORT (PORT and PORT + 1 free)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.testing.adp import AttentionDpEngine
from kvbm_plugin.testing.engine import EngineConfig
from kvbm_plugin.testing.fake_trtllm import KVEventsConfig

BS = 4
RANKS = 2
TOPIC = "kv-events"
SALTS = (None, "tenant-a", "tenant-b")


class _EngineFacts:
    """What Dynamo's ``Publisher`` asks of its engine in STREAMING mode."""

    def get_attention_dp_size(self) -> int:
        return RANKS


def _blocks(answer: dict, worker: int, rank: int) -> tuple[int, int, int]:
    for row in answer.get("workers", []):
        if row["worker_id"] == worker and row.get("dp_rank", 0) == rank:
            return (row["device_blocks"], row["host_pinned_extension_blocks"],
                    row["disk_extension_blocks"])
    return (0, 0, 0)


def _wait_published(tmp: str, port: int, env: dict[str, str]) -> int:
    """Until each rank's output has published the warm-up's blocks (read by a subscriber that
    replays from seq 0), so that Dynamo's relays, created next, have surely missed them."""
    from kvbm_plugin.cli.demo_adp import subscribers_for
    from kvbm_plugin.routers.router_view import RouterView

    settings = {**env, cc.OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{port}",
                cc.EVENTS_ENDPOINT: f"ipc://{tmp}/unused"}  # (the outputs are read only)
    settings.pop(cc.TRTLLM_MOVED_ENDPOINT)
    subscribers = subscribers_for(cc.load_consolidator_config(
        settings, num_ranks=RANKS, attention_dp=True), RANKS, RouterView(BS))
    try:
        deadline = time.monotonic() + 20
        while not all(len(s.held) >= 8 for s in subscribers):
            assert time.monotonic() < deadline, "the warm-up never reached the outputs"
            for s in subscribers:
                s.poll(20)
        return sum(len(s.held) for s in subscribers)
    finally:
        for s in subscribers:
            s.close()


def _output_subscriptions(engine: Any, rank: int) -> int:
    """Subscriptions rank ``rank``'s consolidated output (the YAML's endpoint) took in."""
    return int(engine.call(rank, "consolidator_stats")["output_subscriptions"])


async def main(tmp: str, port: int) -> dict[str, Any]:
    from dynamo.llm import (
        KvRouter,
        KvRouterConfig,
        ModelInput,
        ModelRuntimeConfig,
        ModelType,
        WorkerType,
        register_model,
    )
    from dynamo.runtime import DistributedRuntime
    from dynamo.trtllm.publisher import KvEventPublicationMode, get_publisher

    # The engine YAML's block, as _resolve_streaming_kv_events_config resolves it.
    yaml_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": f"tcp://*:{port}", "topic": TOPIC,
                   "replay_endpoint": f"tcp://127.0.0.1:{port + 100}"}
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
           cc.TRTLLM_MOVED_ENDPOINT: f"ipc://{tmp}/trtllm-own",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/out-replay",
           cc.CPU_CACHE_NUM_BLOCKS: "16", cc.DISK_CACHE_NUM_BLOCKS: "96",
           cc.DISK_CACHE_DIR: f"{tmp}/disk"}
    engine = AttentionDpEngine(EngineConfig(
        attention_dp=RANKS, processes=False, env=env, tokens_per_block=BS, num_gpu_blocks=16,
        kv_events_config=KVEventsConfig(**yaml_events), provide_block_hashes=False))

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("kvbm.worker.generate")

    async def handler(request: object, context: object = None):  # never called here
        yield {"token_ids": []}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler))
    runtime_config = ModelRuntimeConfig()
    runtime_config.data_parallel_size = RANKS
    await register_model(ModelInput.Tokens, ModelType.Completions, endpoint, "demo-model",
                         "demo-model", worker_type=WorkerType.Aggregated,
                         kv_cache_block_size=BS, runtime_config=runtime_config,
                         skip_model_assets=True)
    worker = endpoint.connection_id()
    router = KvRouter(endpoint, BS, KvRouterConfig())
    out: dict[str, Any] = {"asked": 0, "reused": 0, "agreed": 0, "requests": 0,
                           "salted_reused": 0, "salted_asked": 0, "salted_agreed": 0,
                           "warm_credited": 0, "warm_reused": 0,
                           "warm_gpu_credited_at_join": 0, "warm_gpu_held_at_join": 0,
                           "warm_published": 0,
                           "host_or_disk_credited": 0, "salted_credited": 0, "foreign": 0,
                           "other_rank": 0, "first_answer": None}
    warm = {r: [7000 + 100 * r + i for i in range(8 * BS)] for r in range(RANKS)}
    try:
        # Served before Dynamo's relays subscribe (what a warm-up would be): the relay has no
        # replay, so these batches never reach Dynamo.
        for r in range(RANKS):
            engine.submit(warm[r], 1, dp_rank=r)
        engine.run_until_idle(timeout_s=60)
        out["warm_published"] = _wait_published(tmp, port, env) * BS
        joined = [_output_subscriptions(engine, r) for r in range(RANKS)]
        # After the engine is up, as llm_worker.py does: Dynamo's own STREAMING relays.
        async with get_publisher(
                endpoint, _EngineFacts(), int(worker), BS, [], component_gauges=None,
                publish_metrics=False,
                kv_event_publication_mode=KvEventPublicationMode.STREAMING,
                streaming_kv_events_config=dict(yaml_events),
                streaming_kv_events_gpus_per_node=8):
            # The relays' SUB sockets join late (slow joiner; they ask no replay): until each
            # rank's output took a new subscription in, what it sends is lost to them.
            deadline = time.monotonic() + 30
            while any(_output_subscriptions(engine, r) <= joined[r] for r in range(RANKS)):
                assert time.monotonic() < deadline, "Dynamo's relays never subscribed"
                await asyncio.sleep(0.05)  # poll interval
            for r in range(RANKS):  # the warm-up's GPU blocks, stored before the relays joined
                answer = await router.get_overlap_scores(warm[r] + [1, 2])
                out["warm_gpu_credited_at_join"] += _blocks(answer, worker, r)[0] * BS
                out["warm_gpu_held_at_join"] += len(engine.call(r, "gpu_wire_hashes")) * BS
            system = [1000 + i for i in range(16)]
            prompts = {(r, salt): [r * 100 + t for t in system]
                       for r in range(RANKS) for salt in SALTS}
            for turn in range(5):
                for (r, salt), prefix in prompts.items():
                    prompt = prefix + [3000 + 131 * r + 17 * (salt is not None)
                                       + 7 * turn + j for j in range(6)]
                    answer: dict = {}
                    want_by = time.monotonic() + 3.0
                    expected = None
                    while True:
                        answer = await router.get_overlap_scores(prompt, cache_namespace=salt)
                        got = _blocks(answer, worker, r)
                        # poll (bounded): Dynamo applies relayed events asynchronously
                        if expected is not None and sum(got) == expected or \
                                time.monotonic() > want_by:
                            break
                        expected = sum(got) if expected is None else expected
                        await asyncio.sleep(0.05)
                    got = _blocks(answer, worker, r)
                    if out["first_answer"] is None and sum(got):
                        out["first_answer"] = answer
                    other = _blocks(answer, worker, 1 - r)
                    out["other_rank"] += sum(other) if turn == 0 else 0
                    foreign = await router.get_overlap_scores(prompt,
                                                              cache_namespace="tenant-unused")
                    out["foreign"] += sum(_blocks(foreign, worker, r)) if salt else 0
                    rid = engine.submit(prompt, 3, cache_salt=salt, dp_rank=r)
                    engine.run_until_idle(timeout_s=60)
                    result = engine.result(rid)
                    reused = (result.gpu_hit_tokens + result.host_hit_tokens
                              + result.disk_hit_tokens)
                    if salt is None:  # base tenants: credit against the engine's reuse
                        out["asked"] += len(prompt)
                        out["reused"] += reused
                        out["agreed"] += len(prompt) - abs(sum(got) * BS - reused)
                    else:  # salted tenants: the same, asked by the salt string a client sends
                        out["salted_reused"] += reused
                        out["salted_asked"] += len(prompt)
                        out["salted_agreed"] += len(prompt) - abs(sum(got) * BS - reused)
                    out["requests"] += 1
                    out["host_or_disk_credited"] += got[1] + got[2]
                    out["salted_credited"] += sum(got) if salt else 0
                    prompts[(r, salt)] = prompt + result.tokens[len(prompt):]
                for r in range(RANKS):  # evict: the next turn's prefixes come from the tiers
                    engine.submit([9000 + 100 * r + i for i in range(14 * BS)], 1, dp_rank=r)
                engine.run_until_idle(timeout_s=60)
                await asyncio.sleep(0.2)  # let the tiers' events reach the router
            for r in range(RANKS):  # what Dynamo holds of the blocks it never saw stored
                answer = await router.get_overlap_scores(warm[r] + [1, 2])
                out["warm_credited"] += sum(_blocks(answer, worker, r)) * BS
                rid = engine.submit(warm[r] + [1, 2], 1, dp_rank=r)
                engine.run_until_idle(timeout_s=60)
                result = engine.result(rid)
                out["warm_reused"] += (result.gpu_hit_tokens + result.host_hit_tokens
                                       + result.disk_hit_tokens)
    finally:
        engine.shutdown()
        serving.cancel()
        runtime.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], int(sys.argv[2]))), default=str),
          flush=True)
