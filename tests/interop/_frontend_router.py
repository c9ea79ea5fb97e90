"""Run inside a private network namespace by test_dynamo_frontend_router.py (Dynamo's event
plane and request plane bind addresses of their own choosing): the simulated engine's
consolidated output relayed onto Dynamo's event plane by Dynamo's own relay
(``KvEventPublisher(endpoint, zmq_endpoint=...)``, ai-dynamo-runtime 1.6.1), under a worker
registered as Dynamo's frontend sees one (``register_model``), and asked before each request
by the KV router Dynamo's frontend runs (``KvRouter.get_overlap_scores``) with the request's
own salt string and adapter name. Prints one JSON line with the tallies.

Usage: python _frontend_router.py TMPDIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.tools.chat_workload import RouterProbe
from kvbm_plugin.tools.llmd_model import LlmdIndexer, llmd_tap
from kvbm_plugin.tools.router_view import RouterView

BS = 4
ADAPTERS = {0: "adapter-a", 1: "adapter-b"}
SALTS = (None, "tenant-a", "tenant-b")


def _cached_blocks(answer: dict, worker: int) -> int:
    for row in answer.get("workers", []):
        if row["worker_id"] == worker:
            return (row["device_blocks"] + row["host_pinned_extension_blocks"]
                    + row["disk_extension_blocks"])
    return 0


async def main(tmp: str) -> dict:
    from dynamo.llm import (
        KvEventPublisher,
        KvRouter,
        KvRouterConfig,
        ModelInput,
        ModelType,
        WorkerType,
        register_model,
    )
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("kvbm.worker.generate")

    async def handler(request: object, context: object = None):  # never called here
        yield {"token_ids": []}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler))
    await register_model(ModelInput.Tokens, ModelType.Completions, endpoint, "demo-model",
                         "demo-model", worker_type=WorkerType.Aggregated,
                         kv_cache_block_size=BS, skip_model_assets=True)
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
           cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gr",
           cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/out", cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/or",
           cc.CPU_CACHE_NUM_BLOCKS: "16", cc.DISK_CACHE_NUM_BLOCKS: "96",
           cc.DISK_CACHE_DIR: f"{tmp}/disk",
           cc.LORA_NAMES: ",".join(f"{k}={v}" for k, v in ADAPTERS.items())}
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=32,
        tp_size=1, max_num_tokens=128, max_batch_size=4, dtype=torch.float32, env=env,
        vocab_size=30000))
    # The relay connects before the first batch is published: nothing precedes it unseen.
    relay = KvEventPublisher(endpoint, kv_block_size=BS, zmq_endpoint=config.output.connect,
                             zmq_topic="")
    router = KvRouter(endpoint, BS, KvRouterConfig())
    worker = endpoint.connection_id()
    tap = llmd_tap([LlmdIndexer(block_size=BS)], config.output.connect,
                   config.output_replay.connect, start_seq=0, view=RouterView(BS))
    probe = RouterProbe(engine, tap, settle_timeout=20.0)
    out = {"asked": 0, "reused": 0, "agreed": 0, "foreign": 0, "requests": 0,
           "view_waits_timed_out": 0}
    try:
        deadline = time.monotonic() + 20
        while not (await router.get_overlap_scores([0] * BS)).get("workers"):
            assert time.monotonic() < deadline, "the router never saw the worker"
            await asyncio.sleep(0.05)  # poll interval: discovery is asynchronous
        system = [1000 + i for i in range(16)]
        scopes = [(lora, salt) for lora in (None, 0, 1) for salt in SALTS]
        prompts = {scope: list(system) for scope in scopes}
        for turn in range(4):
            for i, (lora, salt) in enumerate(scopes):
                prompt = prompts[(lora, salt)] + [3000 + 131 * i + 7 * turn + j
                                                  for j in range(6)]
                assert probe.settle()
                name = None if lora is None else ADAPTERS[lora]
                want = probe.predict(prompt, salt) // BS if lora is None else None
                # Dynamo applies the relayed events asynchronously: wait (bounded) until its
                # answer matches the plugin's own view (base model), then take it.
                wait_until = time.monotonic() + 3.0
                while True:
                    answer = await router.get_overlap_scores(prompt, lora_name=name,
                                                             cache_namespace=salt)
                    got = _cached_blocks(answer, worker)
                    if want is None or got == want:
                        break
                    if time.monotonic() > wait_until:
                        out["view_waits_timed_out"] += 1
                        break
                    await asyncio.sleep(0.02)  # poll interval
                foreign = await router.get_overlap_scores(prompt, lora_name=name,
                                                          cache_namespace="tenant-unused")
                out["foreign"] += _cached_blocks(foreign, worker)
                rid = engine.submit(prompt, 3, cache_salt=salt, lora_task_id=lora)
                engine.run_until_idle(timeout_s=60)
                result = engine.result(rid)
                reused = result.gpu_hit_tokens + result.host_hit_tokens + result.disk_hit_tokens
                out["asked"] += len(prompt)
                out["reused"] += reused
                out["agreed"] += len(prompt) - abs(got * BS - reused)
                out["requests"] += 1
                prompts[(lora, salt)] = prompt + result.tokens[len(prompt):]
    finally:
        tap.close()
        engine.shutdown()
        relay.shutdown()
        serving.cancel()
        runtime.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
