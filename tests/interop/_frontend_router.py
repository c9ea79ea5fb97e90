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
from kvbm_plugin.cli import demo_options
from kvbm_plugin.cli.demo_routers import adapter_names
from kvbm_plugin.routers.llmd_model import LlmdIndexer, llmd_tap
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.chat_workload import RouterProbe, drive
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

BS = 4
ADAPTERS = 2
DEMO_ARGS = ["--requests", "48", "--tenants", "2", "--adapters", str(ADAPTERS),
             "--max-context", "96", "--sessions", "6", "--turns", "3", "--system-tokens", "16",
             "--user-tokens", "8", "--gen-tokens", "3", "--block-size", str(BS),
             "--gpu-blocks", "32", "--mode", "passthrough"]


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
           cc.LORA_NAMES: ",".join(f"{k}={v}" for k, v in adapter_names(ADAPTERS).items())}
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
    out: dict = {"foreign": 0, "view_waits_timed_out": 0, "scopes": set()}

    def overlap(prompt: list[int], salt: str | None, lora_name: str | None) -> int:
        async def scores() -> dict:  # Dynamo's awaitable is made on the loop's thread
            return await router.get_overlap_scores(prompt, lora_name=lora_name,
                                                   cache_namespace=salt)

        answer = asyncio.run_coroutine_threadsafe(scores(), loop).result(30)
        return _cached_blocks(answer, worker) * BS

    def ask(prompt: list[int], salt: str | None, lora_name: str | None) -> int:
        """Asked by the drive (its thread) as a client asks: salt string, adapter name."""
        # Dynamo applies the relayed events asynchronously: wait (bounded) until its answer
        # matches the plugin's own view, then take it.
        want = tap.view.cached_tokens(prompt, namespace=salt, lora_name=lora_name)
        wait_until = time.monotonic() + 3.0
        while (got := overlap(prompt, salt, lora_name)) != want:
            if time.monotonic() > wait_until:
                out["view_waits_timed_out"] += 1
                break
            time.sleep(0.02)  # poll interval: Dynamo's indexer applies events asynchronously
        out["foreign"] += overlap(prompt, "tenant-unused", lora_name)
        out["scopes"].add(f"{salt}/{lora_name}")
        return got

    # The demo's steady multi-tenant chat, with two adapters (what `kvbm-plugin demo --requests
    # 48 --tenants 2 --adapters 2` sends, at this engine's sizes)
    args = demo_options.build_parser().parse_args(DEMO_ARGS)
    demo_options.check_options(args)
    workload = demo_options.workload_for(args)
    probe = RouterProbe(engine, tap, settle_timeout=20.0, external=ask,
                        lora_names=adapter_names(ADAPTERS))
    try:
        deadline = time.monotonic() + 20
        while not (await router.get_overlap_scores([0] * BS)).get("workers"):
            assert time.monotonic() < deadline, "the router never saw the worker"
            await asyncio.sleep(0.05)  # poll interval: discovery is asynchronous
        result = await loop.run_in_executor(None, lambda: drive(
            engine, probe, workload, max_requests=args.requests, timeout_s=240))
        tally = result.external_tally
        out.update(requests=tally.requests, asked=tally.prompt_tokens,
                   agreed=tally.agree_tokens,
                   reused=tally.reused_tokens, scopes=sorted(out["scopes"]))
    finally:
        tap.close()
        engine.shutdown()
        relay.shutdown()
        serving.cancel()
        runtime.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))), flush=True)
