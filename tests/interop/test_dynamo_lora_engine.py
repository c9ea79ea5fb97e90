"""Two LoRA adapters (task ids 0 and 1) and the base model through the simulated engine, with
the same prompts, into NVIDIA Dynamo's real indexer and into RouterView.

The engine's serialized GPU-tier events name no adapter (upstream's ``KVCacheEventSerializer``
writes no ``lora_id``), so every ``lora_name`` on the GPU-tier stream comes from the leader's
names for its requests (``naming.names.LoraNames``); the tier events name the adapter of the
request they copy. The indexer subscribes to the GPU-tier stream (worker 1) and the consolidated
one (worker 2), with their replay endpoints; RouterView is fed the same two streams, recorded
from seq 0. Each test asserts no indexer warning, that the indexer holds exactly the blocks the
GPU pool and the tiers hold (per medium in passthrough), that RouterView holds the same and
counts no warning, and that a ``/query`` naming one adapter matches only that adapter's blocks:
exactly the prefix the pool (worker 1) or the streams' media (worker 2) hold under that adapter's
hashes, the same in RouterView.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _kvwire import wait_all_sent
from test_dynamo_indexer import (
    CONSOLIDATED_WORKER,
    GPU_WORKER,
    _env,
    _expected,
    _register,
    _settled,
)

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import trtllm_block_chain
from kvbm_plugin.wire.events import EventBatch, to_signed_int64
from kvbm_plugin.wire.identity import lora_name
from kvbm_plugin.wire.subscriber import StreamSubscriber

BS = 4
SCOPES = (None, 0, 1)  # the base model and LoRA task ids 0 and 1
SYSTEM = [1000 + i for i in range(16)]
# One prompt per scope that only that scope is sent: a query naming another scope must not
# match past the system prompt.
OWN = {scope: SYSTEM + [5000 + 100 * i + j for j in range(8)]
       for i, scope in enumerate(SCOPES)}


def _chain(tokens: list[int], lora: int | None) -> list[int]:
    """TensorRT-LLM's V1 hashes (wire form) of the full blocks of ``tokens``."""
    return [to_signed_int64(h) for h in trtllm_block_chain(tokens, BS, None, lora)]


def _prefix(hashes: list[int], held: set[int]) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


def _workload(engine: SimulatedEngine, wave: int) -> None:
    """Three chat turns per session, the same prompts under every scope, then each scope's
    own prompt."""
    sessions = {(scope, s): SYSTEM + [2000 + 97 * s + wave * 31 + j for j in range(6)]
                for scope in SCOPES for s in range(2)}
    for _turn in range(3):
        for (scope, _), prompt in sessions.items():
            engine.submit(prompt, 3, lora_task_id=scope)
        engine.run_until_idle(timeout_s=60)
        for key, prompt in sessions.items():
            sessions[key] = prompt + [3000 + len(prompt), 3001 + len(prompt)] * 2
    for scope, prompt in OWN.items():
        engine.submit(prompt, 2, lora_task_id=scope)
    engine.run_until_idle(timeout_s=60)


def _gpu_tokens(answer: dict[str, Any], worker: int) -> int:
    return int(answer.get("scores", {}).get(str(worker), {}).get("0", 0))


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_two_adapters_and_the_base_model_stay_apart(indexer: Indexer, tmp_path: Path,
                                                    mode: str) -> None:
    env = _env(tmp_path, mode)
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=32,
        max_num_tokens=128, max_batch_size=4, dtype=torch.float32, env=env, vocab_size=30000))
    subs = {GPU_WORKER: StreamSubscriber(config.publish_endpoint(0).connect,
                                         config.replay_endpoint(0).connect, start_seq=0),
            CONSOLIDATED_WORKER: StreamSubscriber(config.output.connect,
                                                  config.output_replay.connect, start_seq=0)}
    recorded: dict[int, list[EventBatch]] = {w: [] for w in subs}
    try:
        _register(indexer, config)
        _workload(engine, 0)
        # A batch sent before the indexer's SUB listened comes back only through the replay a
        # later batch triggers: a short wave more until one has reached it.
        for wave in range(1, 6):
            if _settled(engine, indexer, mode, timeout=5.0):
                break
            engine.submit([9000 + wave * 16 + j for j in range(13)], 2)
            engine.run_until_idle(timeout_s=60)
        _settled(engine, indexer, mode, timeout=20.0, required=True)
        assert indexer.warnings() == []

        def published() -> dict[int, int]:
            assert engine.leader.consolidator.wait_idle(10)
            return {GPU_WORKER: wait_all_sent(engine.leader.event_sink.stats),
                    CONSOLIDATED_WORKER: engine.leader.consolidator.stats()["batches_out"]}

        deadline = time.monotonic() + 30
        while any(subs[w].next_seq != n for w, n in published().items()):
            assert time.monotonic() < deadline, {w: s.next_seq for w, s in subs.items()}
            for w, sub in subs.items():
                recorded[w].extend(sub.poll(20))
        truth = {m: {to_signed_int64(h) for h in per_rank[0]}
                 for m, per_rank in engine.resident_blocks().items()}
        sink = engine.leader.event_sink.stats()
    finally:
        for sub in subs.values():
            sub.close()
        engine.shutdown()
    assert sink["lora_named_blocks"] > 0
    assert sink["lora_unnamed_blocks"] == 0
    # Every adapter's blocks are apart in the pool (the simulated engine hashes the task id).
    assert all(_chain(SYSTEM, s)[0] != _chain(SYSTEM, t)[0] for s in SCOPES for t in SCOPES
               if s != t)

    view = RouterView(BS)
    for w, batches in recorded.items():
        for batch in batches:
            view.apply_batch(batch, str(w), stream=f"{w}:0")
    assert view.counts.warnings == 0, view.counts.broken()
    ours = {(int(w), r, m): {to_signed_int64(h) for _, h in v}
            for (w, r, m), v in view.edges().items() if v}
    assert ours == indexer.held() == _expected(engine, mode)

    # What each worker's device tree holds, per the engine: worker 1 the GPU pool; worker 2
    # the union of every medium (dedup) or the GPU pool alone (passthrough).
    device = {GPU_WORKER: truth["GPU"],
              CONSOLIDATED_WORKER: set().union(*truth.values()) if mode == "dedup"
              else truth["GPU"]}
    own_matched = 0
    for asked in SCOPES:
        for sent, prompt in OWN.items():
            answer = indexer.query(prompt, lora_name=lora_name(asked))
            matches = view.match(prompt, lora_name=lora_name(asked))
            for w, held in device.items():
                want = _prefix(_chain(prompt, asked), held) * BS
                assert _gpu_tokens(answer, w) == want, (asked, sent, w)
                got = next((m.blocks_by_medium.get("GPU", 0) for m in matches
                            if m.worker == str(w)), 0)
                assert got * BS == want, (asked, sent, w)
                if asked != sent:
                    assert want <= len(SYSTEM)  # another scope's own prompt: not past it
                elif want > len(SYSTEM):
                    own_matched += 1
    assert own_matched > 0  # some scope's own prompt is matched past the shared part
    assert indexer.warnings() == []
