"""Run inside a private network namespace by test_dynamo_frontend_router.py: a deployment of two
workers behind Dynamo's frontend (``python -m dynamo.frontend --router-mode kv``, ai-dynamo
1.6.1, its own process, file discovery), the frontend choosing which worker serves each request.

Each worker is what a ``dynamo.trtllm`` worker with the plugin is: a simulated engine with the
plugin's leader, host and disk tiers and consolidator (passthrough), its consolidated output
relayed onto Dynamo's event plane by Dynamo's own relay (``KvEventPublisher(endpoint,
zmq_endpoint=...)``) under the worker's own id, the base model and each adapter registered
(``register_model``, an adapter as ``lora_name`` of the base model), and a handler that serves
the routed request on its engine (``routing.cache_salt``, ``model`` = the adapter's name).

A client sends the demo's steady multi-tenant chat (``kvbm-plugin demo --requests 48 --tenants 2
--adapters 2``), one request at a time, as a client does: token ids, ``model`` the adapter's
name, ``nvext.cache_salt`` its salt string. Before each request, a probe (``nvext.annotations:
["probe"]``, which the frontend hands the worker as the request's ``annotations``; answered
by the handler without the engine) waits, bounded, until the frontend's
answer settled on what the chosen worker's stream says it holds (Dynamo applies relayed events
asynchronously). Per request: the worker the frontend chose, its ``kv_hit_rate`` (host and disk
weighted 1.0, so it counts blocks), and what that worker's engine then reused. Prints one JSON
line with the tallies.

Usage: python _frontend_workers.py TMPDIR relay|streaming
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import torch
from _frontend_router import (
    ADAPTERS,
    BS,
    DEMO_ARGS,
    MODEL,
    _complete,
    _model_dir,
    _start_frontend,
    _stop_frontend,
)

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli import demo_options
from kvbm_plugin.cli.demo_routers import adapter_names
from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.testing.chat_workload import AccuracyTally
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import KVEventsConfig

PORT = 18123  # the namespace is private: nothing else binds there
WORKERS = 2


class _EngineFacts:
    """What Dynamo's ``Publisher`` asks of its engine in STREAMING mode."""

    def get_attention_dp_size(self) -> int:
        return 1


class Worker:
    """One worker: its runtime, engine, relay, stream view and handler (requests served)."""

    def __init__(self, tmp: str, index: int, loop: asyncio.AbstractEventLoop,
                 streaming: bool) -> None:
        from dynamo.llm import KvEventPublisher
        from dynamo.runtime import DistributedRuntime

        self.name = name = f"w{index}"
        self.runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
        self.endpoint = self.runtime.endpoint("kvbm.worker.generate")
        self.id = int(self.endpoint.connection_id())
        env = {cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
               cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/{name}-or",
               cc.CPU_CACHE_NUM_BLOCKS: "16", cc.DISK_CACHE_NUM_BLOCKS: "96",
               cc.DISK_CACHE_DIR: f"{tmp}/{name}-disk",
               cc.LORA_NAMES: ",".join(f"{k}={v}" for k, v in adapter_names(ADAPTERS).items())}
        self.yaml_events: dict[str, Any] | None = None
        if streaming:
            # README's configuration for Dynamo's frontend (`kvbm-plugin yaml --for
            # dynamo-streaming`): the YAML's kv_events_config names the endpoint Dynamo's
            # STREAMING relay reads; the plugin moves TensorRT-LLM's own publisher (the
            # GPU-tier source) and binds its consolidated output there.
            port = 25557 + 10 * index  # the namespace is private: nothing else binds there
            self.yaml_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://*:{port}", "topic": "kv-events",
                                "replay_endpoint": f"tcp://127.0.0.1:{port + 1}"}
            env[cc.TRTLLM_MOVED_ENDPOINT] = f"ipc://{tmp}/{name}-trtllm"
            output = f"tcp://127.0.0.1:{port}"
        else:
            env.update({cc.EVENTS_ENDPOINT: f"ipc://{tmp}/{name}-gpu",
                        cc.REPLAY_ENDPOINT: f"ipc://{tmp}/{name}-gr",
                        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/{name}-out"})
            output = cc.load_consolidator_config(env).output.connect
        self.engine = SimulatedEngine(EngineConfig(
            num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=32,
            tp_size=1, max_num_tokens=128, max_batch_size=4, dtype=torch.float32, env=env,
            vocab_size=30000, provide_block_hashes=not streaming,
            kv_events_config=None if not streaming else KVEventsConfig(**self.yaml_events)))
        self.relay: Any = None
        if not streaming:  # Dynamo's relay, made by hand
            self.relay = KvEventPublisher(self.endpoint, kv_block_size=BS, zmq_endpoint=output,
                                          zmq_topic="")
        # what this worker's stream says it holds (the truth a router's answer is held to)
        self.stream = TreeSubscriber(output, f"ipc://{tmp}/{name}-or", start_seq=0,
                                     view=RouterView(BS))
        self.served: list[dict[str, Any]] = []  # per request the engine served
        self.serving: asyncio.Future | None = None
        self._lora_ids = {v: k for k, v in adapter_names(ADAPTERS).items()}
        self._loop = loop

    def holds(self, prompt: list[int], salt: str | None, lora_name: str | None) -> int:
        """Prompt tokens this worker's stream says are cached (any tier), as of now."""
        self.stream.poll(0)
        return self.stream.view.cached_tokens(prompt, namespace=salt, lora_name=lora_name)

    async def start(self, model_dir: str) -> None:
        from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

        if self.yaml_events is not None:
            # As dynamo.trtllm's llm_worker.py does once the engine is up: its STREAMING
            # relay, one per attention-DP rank (one here), under the worker's id
            from dynamo.trtllm.publisher import KvEventPublicationMode, get_publisher

            self.relay = get_publisher(
                self.endpoint, _EngineFacts(), self.id, BS, [], component_gauges=None,
                publish_metrics=False,
                kv_event_publication_mode=KvEventPublicationMode.STREAMING,
                streaming_kv_events_config=dict(self.yaml_events),
                streaming_kv_events_gpus_per_node=8)
            await self.relay.__aenter__()
        # Nothing is published before the relay's SUB joined (it has no replay): the output
        # saw its subscription and this script's view's
        publisher = self.engine.leader.consolidator._publisher
        deadline = time.monotonic() + 20
        while publisher.stats()["subscriptions_applied"] < 2:
            assert time.monotonic() < deadline, f"{self.name}: the relay never subscribed"
            await asyncio.sleep(0.02)  # poll interval: ZMQ connects asynchronously
        self.serving = asyncio.ensure_future(self.endpoint.serve_endpoint(self.handler))
        await register_model(ModelInput.Tokens, ModelType.Completions, self.endpoint, model_dir,
                             MODEL, worker_type=WorkerType.Aggregated, kv_cache_block_size=BS)
        for name in adapter_names(ADAPTERS).values():
            await register_model(ModelInput.Tokens, ModelType.Completions, self.endpoint,
                                 model_dir, MODEL, worker_type=WorkerType.Aggregated,
                                 kv_cache_block_size=BS, lora_name=name,
                                 base_model_path=model_dir)

    async def handler(self, request: dict, context: object = None):
        """The routed request: served on this worker's engine (a probe is answered at once)."""
        if "probe" in (request.get("annotations") or []):  # nvext.annotations, passed on
            yield {"token_ids": [2], "finish_reason": "stop"}
            return
        prompt = list(request["token_ids"])
        salt = (request.get("routing") or {}).get("cache_salt")
        lora = self._lora_ids.get(request.get("model"))
        gen = request["stop_conditions"]["max_tokens"]
        result = await self._loop.run_in_executor(None, self.serve, prompt, gen, salt, lora)
        self.served.append({"prompt": len(prompt), "gpu": result.gpu_hit_tokens,
                            "host": result.host_hit_tokens, "disk": result.disk_hit_tokens})
        yield {"token_ids": list(result.tokens[len(prompt):]), "finish_reason": "length"}

    def serve(self, prompt: list[int], gen: int, salt: str | None, lora: int | None) -> Any:
        rid = self.engine.submit(prompt, gen, cache_salt=salt, lora_task_id=lora)
        self.engine.run_until_idle(timeout_s=60)
        return self.engine.result(rid)

    async def shutdown(self) -> None:
        self.stream.close()
        self.engine.shutdown()
        if self.yaml_events is not None and self.relay is not None:
            await self.relay.__aexit__(None, None, None)
        elif self.relay is not None:
            self.relay.shutdown()
        if self.serving is not None:
            self.serving.cancel()
        self.runtime.shutdown()


def _ask(prompt: list[int], salt: str | None, model: str, gen: int, probe: bool) -> dict:
    nvext_extra = {"annotations": ["probe"]} if probe else {}
    return _complete(PORT, prompt, salt, model, max_tokens=1 if probe else gen,
                     extra_fields=["worker_id", "timing"], **nvext_extra)


def _routed(answer: dict, prompt: list[int]) -> tuple[int, int]:
    """(the worker the frontend chose, the prompt tokens it credited that worker with)."""
    nvext = answer["nvext"]
    rate = nvext["timing"]["kv_hit_rate"]  # over the prompt's blocks, a partial one counted
    return int(nvext["worker_id"]["decode_worker_id"]), round(rate * -(-len(prompt) // BS)) * BS


async def main(tmp: str, mode: str) -> dict:
    os.environ["DYN_FILE_KV"] = f"{tmp}/discovery"  # the frontend's and the workers'
    frontend = _start_frontend(tmp, PORT)
    loop = asyncio.get_running_loop()
    workers: list[Worker] = []
    out: dict[str, Any] = {"best_worker": 0, "settle_timeouts": 0, "foreign": 0,
                           "tier_reused": 0, "served": {}, "scopes": set()}
    tally = AccuracyTally()
    try:
        model_dir = _model_dir(tmp)
        workers = [Worker(tmp, i, loop, mode == "streaming") for i in range(WORKERS)]
        for w in workers:
            await w.start(model_dir)
        by_id = {w.id: w for w in workers}
        models = [MODEL, *adapter_names(ADAPTERS).values()]
        for model in models:
            deadline = time.monotonic() + 60
            while True:  # the frontend serves each model once discovery found it
                try:
                    await loop.run_in_executor(None, _ask, [5] * BS, None, model, 1, True)
                    break
                except OSError:  # refused until it listens; 404 until the model is found
                    assert time.monotonic() < deadline, f"the frontend never served {model}"
                    await asyncio.sleep(0.1)  # poll interval: discovery is asynchronous
        args = demo_options.build_parser().parse_args(DEMO_ARGS)
        demo_options.check_options(args)
        workload = demo_options.workload_for(args)
        names = adapter_names(ADAPTERS)
        # Each tenant's system prompt, under every adapter, served first on a worker of its
        # own (tenant t on worker t % 2) straight through its engine: from then on the frontend
        # has a reason to send each tenant to one worker, so both serve and the choice shows.
        for t, system in enumerate(workload.system_prompts):
            for lora in [None, *names]:
                worker = workers[t % WORKERS]
                await loop.run_in_executor(None, worker.serve, system + [1, 2, 3], 1,
                                           f"tenant-{t}", lora)
        while tally.requests < args.requests:
            request = workload.next_request()
            assert request is not None
            lora_name = None if request.lora is None else names[request.lora]
            model = lora_name or MODEL
            prompt, salt = request.prompt, request.salt
            # Settle: probes until the frontend credits its chosen worker with what that
            # worker's stream holds (bounded; a timeout is counted, and the request still goes)
            deadline = time.monotonic() + 5.0
            while True:
                answer = await loop.run_in_executor(None, _ask, prompt, salt, model, 1, True)
                chosen, credited = _routed(answer, prompt)
                if credited == by_id[chosen].holds(prompt, salt, lora_name):
                    break
                if time.monotonic() > deadline:
                    out["settle_timeouts"] += 1
                    break
                await asyncio.sleep(0.02)  # poll interval: Dynamo applies events asynchronously
            # what each worker holds of the prompt now: the frontend should pick the best
            best = max(w.holds(prompt, salt, lora_name) for w in workers)
            foreign = await loop.run_in_executor(None, _ask, prompt, "tenant-unused", model, 1,
                                                 True)
            out["foreign"] += _routed(foreign, prompt)[1]
            # The request itself, as a client sends it: the frontend routes, the worker serves
            answer = await loop.run_in_executor(None, _ask, prompt, salt, model,
                                                request.gen_tokens, False)
            chosen, credited = _routed(answer, prompt)
            worker = by_id[chosen]
            served = worker.served[-1]
            assert served["prompt"] == len(prompt)
            out["best_worker"] += credited == best
            tally.add(len(prompt), credited, served["gpu"], served["host"], served["disk"])
            out["tier_reused"] += served["host"] + served["disk"]
            out["served"][worker.name] = out["served"].get(worker.name, 0) + 1
            out["scopes"].add(f"{salt}/{lora_name}")
            tokens = answer["choices"][0]["text"].split()
            workload.finished(request, prompt + [int(t[1:]) for t in tokens])
        out.update(requests=tally.requests, asked=tally.prompt_tokens,
                   agreed=tally.agree_tokens, reused=tally.reused_tokens,
                   scopes=sorted(out["scopes"]))
    finally:
        for w in workers:
            await w.shutdown()
        _stop_frontend(frontend)
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))), flush=True)
