"""LoRA requests through the simulated engine: the GPU-tier stream names every adapter block
by its adapter although TensorRT-LLM's serialized events carry no ``lora_id`` (the leader
names each request's first block to the event sink), with TensorRT-LLM's block hashes handed
over (``RequestData.block_hashes``) and computed by the leader (releases without them); and
the leader names the host-tier copies by TensorRT-LLM's hashes in both cases (without
``block_hashes`` it learns them from the GPU-tier events, whose first blocks are the same
tokens under three scopes)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _kvwire import wait_all_sent

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.testing.fake_trtllm import trtllm_block_chain
from kvbm_plugin.wire.events import BlockStored, to_signed_int64
from kvbm_plugin.wire.identity import lora_name
from kvbm_plugin.wire.subscriber import StreamSubscriber

BS = 4
SYSTEM = list(range(101, 113))  # three full blocks every scope shares
SCOPES = (None, 0, 1)  # the base model and LoRA task ids 0 and 1


def chain(tokens: list[int], lora: int | None) -> list[int]:
    """TensorRT-LLM's V1 hashes (wire form) of the full blocks of ``tokens``."""
    return [to_signed_int64(h) for h in trtllm_block_chain(tokens, BS, None, lora)]


def record(tmp: Path, provide_block_hashes: bool,
           prompts: list[tuple[list[int], int | None]]
           ) -> tuple[list[Any], dict[str, int], dict[str, int]]:
    env = {cc.ENABLE_CONSOLIDATOR: "false", cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu",
           cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-r", cc.CPU_CACHE_NUM_BLOCKS: "64"}
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=64,
        dtype=torch.float32, env=env, provide_block_hashes=provide_block_hashes))
    sub = StreamSubscriber(config.publish_endpoint(0).connect,
                           config.replay_endpoint(0).connect, start_seq=0)
    events: list[Any] = []
    try:
        for prompt, lora in prompts:
            engine.submit(prompt, 3, lora_task_id=lora)
        engine.run_until_idle()
        engine.leader.flush_events()
        sink = engine.leader.event_sink
        deadline = time.monotonic() + 20
        published = wait_all_sent(sink.stats)
        while sub.next_seq != published:
            assert time.monotonic() < deadline, (sub.next_seq, sink.stats())
            events.extend(e for b in sub.poll(20) for e in b.events)
        return events, sink.stats(), engine.leader.stats()
    finally:
        sub.close()
        engine.shutdown()


@pytest.mark.parametrize("provide_block_hashes", [True, False])
def test_every_adapter_block_goes_out_under_its_adapter(tmp_path: Path,
                                                        provide_block_hashes: bool) -> None:
    prompts = [(SYSTEM + [200 + i], lora) for lora in SCOPES for i in range(2)]
    prompts.append((SYSTEM + [300, 301, 302, 303, 304], 1))  # one adapter's own prompt
    events, stats, leader = record(tmp_path, provide_block_hashes, prompts)
    published: dict[int, Any] = {}
    for e in events:
        if isinstance(e, BlockStored):
            for h in map(to_signed_int64, e.block_hashes):
                assert published.setdefault(h, e.lora_name) == e.lora_name, h  # one name
    for lora in SCOPES:
        for h in chain(SYSTEM, lora):
            assert published[h] == lora_name(lora)
    own = chain(SYSTEM + [300, 301, 302, 303, 304], 1)
    assert all(published[h] == "lora-1" for h in own)
    assert stats["lora_named_blocks"] > 0
    assert stats["lora_unnamed_blocks"] == 0
    assert stats["orphan_stores_dropped"] == 0
    assert leader["saves_committed"] > 0
    assert leader["tier_stores_waiting_for_name"] == 0  # every host copy named, none twice
    assert leader["block_name_mismatches"] == 0
