"""LoRA adapters and cache salts as NVIDIA Dynamo's real indexer reads them.

The hand-made test feeds the event sink (both ingest loops) TensorRT-LLM-shaped
``stored``/``removed`` dicts with a per-event ``lora_id`` (task ids 0 and 7) and per-block
``cache_salt_id`` (the C++ request's salt), and the indexer the wire events out of it. The
engine tests (tests/interop/test_dynamo_lora_engine.py) run LoRA requests through the simulated
engine, whose serialized events carry no ``lora_id`` at all, as upstream's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.wire.events import encode_payload, encode_seq
from kvbm_plugin.wire.identity import cache_salt_id, salt_namespace
from kvbm_plugin.wire.publisher import EventPublisher, PublisherSettings

BS = 4
SYSTEM = [11, 12, 13, 14, 15, 16, 17, 18]


class _Recorder(EventPublisher):
    def __init__(self) -> None:
        super().__init__(PublisherSettings())
        self.batches: list[list[dict[str, Any]]] = []

    def publish(self, events: Any, data_parallel_rank: int | None = None) -> bool:
        from kvbm_plugin.wire.events import events_as_maps
        self.batches.append(events_as_maps(events))
        return True

    def shutdown(self, timeout: float = 5.0) -> None:
        pass


def _stored(parent: int | None, blocks: list[tuple[int, list[int]]], **data: Any) -> dict:
    per_block = data.pop("block", {})
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent, **data,
        "blocks": [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                               for t in toks], **per_block} for h, toks in blocks]}}


def _chain(base: int) -> list[tuple[int, list[int]]]:
    return [(base + 1, SYSTEM[:4]), (base + 2, SYSTEM[4:])]


@pytest.mark.parametrize("native", [True, False])
def test_adapters_base_model_and_salts_are_apart(indexer: Indexer, tmp_path: Path,
                                                 native: bool) -> None:
    if native and _compiled.loops("event_sink", {}) is None:
        pytest.skip("compiled loops not built")
    rec = _Recorder()
    sink = KvEventSink(rec, block_size=BS, native=native, strict=True)
    salt = cache_salt_id("tenant-a")
    # The same tokens five times: base model, adapter 0, adapter 7, a salted base-model chain
    # and a salted adapter-0 chain; each its own blocks for TensorRT-LLM, so for the router.
    sink.ingest([_stored(None, _chain(100)), _stored(None, _chain(200), lora_id=0),
                 _stored(None, _chain(300), lora_id=7),
                 _stored(None, _chain(400), block={"cache_salt_id": salt}),
                 _stored(None, _chain(500), lora_id=0, block={"cache_salt_id": salt})])
    sink.flush()
    sink.ingest([{"event_id": 1, "window_size": 64,
                  "data": {"type": "removed", "block_hashes": [302]}}])
    sink.flush()

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    endpoint = f"ipc://{tmp_path}/lora"
    pub.bind(endpoint)
    try:
        indexer.register(1, endpoint, None, BS)
        assert pub.poll(10_000), "the indexer never subscribed"
        pub.recv()
        for seq, events in enumerate(rec.batches):
            pub.send_multipart([b"", encode_seq(seq), encode_payload(time.time(), events, 0)])
        expected = {(1, 0, "GPU"): {101, 102, 201, 202, 301, 401, 402, 501, 502}}
        indexer.wait_for(lambda: indexer.held() == expected, "every chain held apart")
    finally:
        pub.close(0)
    ns = salt_namespace(salt)
    assert indexer.cached_tokens(SYSTEM) == 8
    assert indexer.cached_tokens(SYSTEM, lora_name="lora-0") == 8
    assert indexer.cached_tokens(SYSTEM, lora_name="lora-7") == 4  # its second block removed
    assert indexer.cached_tokens(SYSTEM, lora_name="lora-1") == 0
    assert indexer.cached_tokens(SYSTEM, cache_salt=ns) == 8
    assert indexer.cached_tokens(SYSTEM, cache_salt=ns, lora_name="lora-0") == 8
    assert indexer.cached_tokens(SYSTEM, cache_salt="0" * 16) == 0
    assert indexer.warnings() == []
