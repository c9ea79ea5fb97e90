"""Run inside a private network namespace by test_dynamo_frontend_router.py (Dynamo's event
plane and request plane bind addresses of their own choosing): the simulated engine's
consolidated output relayed onto Dynamo's event plane by Dynamo's own relay
(``KvEventPublisher(endpoint, zmq_endpoint=...)``, ai-dynamo-runtime 1.6.1), under a worker
registered as Dynamo's frontend sees one (``register_model``, each adapter as a LoRA model of
it), and asked before each request, with the request's own salt string and adapter name:

* ``router``: by the KV router Dynamo's frontend runs (``KvRouter.get_overlap_scores``), in
  this process;
* ``http``: by Dynamo's frontend itself, ``python -m dynamo.frontend --router-mode kv`` (ai-dynamo
  1.6.1) in its own process, found by file discovery: ``POST /v1/completions`` with the
  prompt's token ids, ``model`` the adapter's name (or the base model's), ``nvext.cache_salt``
  the salt, ``nvext.extra_fields: ["timing"]``; the frontend routes it to the worker and answers
  its ``kv_hit_rate`` (the routed worker's cached blocks over the prompt's blocks, a partial
  last block counted; host and disk
  weighted 1.0 here, ``--router-host-cache-hit-weight``/``--router-disk-cache-hit-weight``, so
  it counts blocks). The worker's handler answers one token; the engine then serves the request.

Prints one JSON line with the tallies.

Usage: python _frontend_router.py TMPDIR [router|http]
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

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


MODEL = "demo-model"
VOCAB = 32000  # the engine's vocabulary (30,000) and the answer's token fit


def _model_dir(tmp: str) -> str:
    """What Dynamo's frontend needs of a model to tokenize and detokenize: config.json and a
    tokenizer.json (word level: token id ``i`` is the word ``t<i>``)."""
    path = Path(tmp) / "model"
    path.mkdir()
    vocab = {f"t{i}": i for i in range(VOCAB)}
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "bos_token_id": 0, "eos_token_id": 1}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": 4096, "bos_token": "t0", "eos_token": "t1"}))
    return str(path)


def _start_frontend(tmp: str, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dynamo.frontend", "--router-mode", "kv",
         "--discovery-backend", "file", "--http-host", "127.0.0.1", "--http-port", str(port),
         "--kv-cache-block-size", str(BS), "--router-host-cache-hit-weight", "1.0",
         "--router-disk-cache-hit-weight", "1.0"],
        stdout=open(f"{tmp}/frontend.log", "w"), stderr=subprocess.STDOUT)


def _stop_frontend(frontend: subprocess.Popen) -> None:
    frontend.terminate()
    try:
        frontend.wait(10)
    except subprocess.TimeoutExpired:
        frontend.kill()
        frontend.wait()


def _complete(port: int, prompt: list[int], salt: str | None, model: str, *,
              max_tokens: int = 1, extra_fields: tuple | list = ("timing",),
              **nvext: Any) -> dict:
    """One request to Dynamo's frontend, as a client sends it; its JSON answer."""
    nvext["extra_fields"] = list(extra_fields)
    if salt is not None:
        nvext["cache_salt"] = salt
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "nvext": nvext}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def _cached_blocks(answer: dict, worker: int) -> int:
    for row in answer.get("workers", []):
        if row["worker_id"] == worker:
            return (row["device_blocks"] + row["host_pinned_extension_blocks"]
                    + row["disk_extension_blocks"])
    return 0


async def main(tmp: str, mode: str) -> dict:
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

    http = mode == "http"
    port = 18123  # the namespace is private: nothing else binds there
    frontend = None
    if http:
        os.environ["DYN_FILE_KV"] = f"{tmp}/discovery"  # the frontend's and this worker's
        frontend = _start_frontend(tmp, port)
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file" if http else "mem", "tcp", event_plane="zmq")
    endpoint = runtime.endpoint("kvbm.worker.generate")
    served = {"requests": 0}

    async def handler(request: object, context: object = None):
        # the frontend's routed request: answered with one token (the engine serves the
        # request itself next, in drive)
        served["requests"] += 1
        yield {"token_ids": [2], "finish_reason": "stop"}

    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler))
    if http:
        model_dir = _model_dir(tmp)
        await register_model(ModelInput.Tokens, ModelType.Completions, endpoint, model_dir,
                             MODEL, worker_type=WorkerType.Aggregated, kv_cache_block_size=BS)
        for name in adapter_names(ADAPTERS).values():
            await register_model(ModelInput.Tokens, ModelType.Completions, endpoint,
                                 model_dir, MODEL, worker_type=WorkerType.Aggregated,
                                 kv_cache_block_size=BS, lora_name=name,
                                 base_model_path=model_dir)
    else:
        await register_model(ModelInput.Tokens, ModelType.Completions, endpoint, MODEL,
                             MODEL, worker_type=WorkerType.Aggregated,
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
    out: dict = {"foreign": 0, "view_waits_timed_out": 0, "scopes": set(),
                 "frontend_requests": 0, "mode": mode}

    def overlap(prompt: list[int], salt: str | None, lora_name: str | None) -> int:
        if http:  # what the frontend credited the worker it routed to (the only one)
            answer = _complete(port, prompt, salt, lora_name or MODEL)
            out["frontend_requests"] += 1
            rate = answer["nvext"]["timing"]["kv_hit_rate"]
            # over the prompt's blocks, a partial last block counted (-(-n // BS))
            return round(rate * -(-len(prompt) // BS)) * BS

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
        for model in [MODEL, *adapter_names(ADAPTERS).values()] if http else []:
            deadline = time.monotonic() + 60
            while True:  # the frontend serves each model once discovery found it
                try:
                    await loop.run_in_executor(None, _complete, port, [5] * BS, None, model)
                    break
                except OSError:  # refused until it listens; 404 until the model is found
                    assert time.monotonic() < deadline, f"the frontend never served {model}"
                    await asyncio.sleep(0.1)  # poll interval: discovery is asynchronous
        result = await loop.run_in_executor(None, lambda: drive(
            engine, probe, workload, max_requests=args.requests, timeout_s=240))
        tally = result.external_tally
        out.update(requests=tally.requests, asked=tally.prompt_tokens,
                   agreed=tally.agree_tokens,
                   reused=tally.reused_tokens, scopes=sorted(out["scopes"]),
                   served=served["requests"])
    finally:
        if frontend is not None:
            _stop_frontend(frontend)
        tap.close()
        engine.shutdown()
        relay.shutdown()
        serving.cancel()
        runtime.shutdown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2
                                      else "router"))), flush=True)
