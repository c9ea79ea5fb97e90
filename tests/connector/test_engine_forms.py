"""Each form of TensorRT-LLM's ``kv_cache_events.py`` on the wire (upstream's msgspec schemas,
``testing.trtllm_stream.encode_form_batch``) read by the consolidator: string token ids become
Dynamo's multimodal routing ids, a non-null ``lora_id`` names the adapter, ``mm_keys`` become the
block's extra keys, anything else is refused one event at a time and counted."""

from __future__ import annotations

import logging

import msgpack
import pytest
from _kvwire import wait_until

from kvbm_plugin.consolidator.engine_forms import EngineForms, mm_pad_token
from kvbm_plugin.events.trtllm_publisher import read_trtllm_publisher, trtllm_streams
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, KVEventsConfig, LlmArgs, ParallelConfig
from kvbm_plugin.testing.trtllm_stream import FORMS, SimZmqEventPublisher, encode_form_batch
from kvbm_plugin.wire.subscriber import StreamSubscriber

DIGEST = "ab" * 32  # a multimodal item's digest, as the C++ sink writes it (hex)
UUID = "0123456789abcdef0123456789abcdef"


def _stored(h: int, tokens: list, parent: int | None = None, **more) -> dict:
    return {"block_hashes": [h], "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, **more}


def _batches(form: str) -> tuple[list[bytes], set[int]]:
    """Payloads form ``form`` writes, and the hashes that must be held after them."""
    plain = _stored(101, [1, 2, 3, 4])
    if form == "44004b3864a7":
        return [encode_form_batch(form, 1.0, [plain], 0)], {101}
    if form == "kv-event-adapter":  # a hex-string hash goes out as bytes: refused (malformed)
        odd = _stored(b"\x01" * 8, [5, 6, 7, 8])
        return [encode_form_batch(form, 1.0, [odd, plain], 0)], {101}
    mm = _stored(202, [9, DIGEST, DIGEST, 10], parent=101, lora_id=7,
                 mm_keys=[[{"hash": DIGEST, "start_offset": 0, "uuid": UUID}]])
    stray = _stored(303, [DIGEST, 1, 1, 1], mm_keys=[[]])  # a string naming no item
    return [encode_form_batch(form, 1.0, [plain, mm], 0),
            encode_form_batch(form, 2.0, [stray, _stored(404, [4, 4, 4, 4])], 0)], \
        {101, 202, 404}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_tensorrt_llms_stream_reaches_the_consolidated_stream(
        form, tmp_path, caplog) -> None:
    from kvbm_plugin.consolidator.service import KvEventConsolidator
    from kvbm_plugin.consolidator_config import load_consolidator_config

    caplog.set_level(logging.INFO, logger="kvbm_plugin")
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/trt",
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    native = read_trtllm_publisher(LlmArgs(KvCacheConfig(4, kv_events_config=events),
                                      ParallelConfig(0, 1)))
    config = load_consolidator_config(
        {"DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
         "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT": f"ipc://{tmp_path}/out-replay"},
        gpu_streams=trtllm_streams(native, 0, "127.0.0.1"))
    publisher = SimZmqEventPublisher(events, native, 0)
    payloads, expected = _batches(form)
    for payload in payloads:
        publisher.publish(payload)
    # sent before anyone subscribes: the consolidator gets them from the replay, once
    wait_until(lambda: publisher.published == len(payloads), 10, "upstream's batches sent")
    forms = EngineForms()
    observed: list = []
    consolidator = KvEventConsolidator(config, engine_observer=lambda r, e: observed.extend(e))
    consolidator.engine_forms = forms
    consolidator.start()
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-replay",
                           start_seq=0)
    out: list = []
    try:
        def held() -> bool:
            out.extend(e for b in sub.poll(20) for e in b.events)
            return sub.held == {(0, h) for h in expected}

        wait_until(held, 10, f"form {form}'s blocks under upstream's names")
    finally:
        sub.close()
        consolidator.shutdown()
        publisher.shutdown()
    stats = {**consolidator.stats(), **forms.stats()}
    if form == "kv-event-adapter":
        assert stats["malformed"] == 1  # the bytes hash: counted, its batch's other event kept
    if form == "13599e98c71c":
        mm = next(e for e in out if getattr(e, "block_hashes", None) == [202])
        pad = mm_pad_token(UUID)
        assert mm.token_ids == [9, pad, pad, 10]  # Dynamo's routing ids for the item
        assert mm.lora_name == "lora-7" and mm.lora_id == 7
        # the digest in Dynamo's marker form: its first 16 hex digits, then 48 zeros
        assert mm.extra_keys == [[DIGEST[:16] + "0" * 48]]
        assert stats["engine_tokens_converted"] == 2 and stats["engine_mm_blocks"] == 1
        assert stats["engine_events_refused"] == 1 and forms.refused == {"token_ids": 1}
        assert any("TensorRT-LLM BlockStored refused (token_ids" in r.getMessage()
                   and DIGEST not in r.getMessage() for r in caplog.records)
        # the leader's name table sees the same, normalised events
        assert [e["block_hashes"] for e in observed if e["type"] == "BlockStored"] == \
            [[101], [202], [404]]
    else:
        assert stats["engine_events_refused"] == stats["engine_tokens_converted"] == 0


def test_engine_forms_fills_names_counts_unread_fields_and_refuses_odd_mm_keys() -> None:
    forms = EngineForms()
    lora = _stored(1, [1, 2, 3, 4], lora_id=3)
    grouped = _stored(2, [1, 2, 3, 4], group_idx=1, kv_cache_spec_sliding_window=128)
    no_uuid = _stored(3, [DIGEST, 1, 1, 1], mm_keys=[[{"hash": DIGEST, "start_offset": 0}]])
    short = _stored(4, [1, 2, 3, 4], mm_keys=[])
    salted = _stored(5, [1, 2, 3, 4], extra_keys=[["dynamo-cache-salt:x"]],
                     mm_keys=[[{"hash": DIGEST, "start_offset": 2, "uuid": UUID},
                               {"hash": "item-7", "start_offset": 3}]])
    raw = [dict(e, type="BlockStored") for e in (lora, grouped, no_uuid, short, salted)]
    raw.append({"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
    out = forms(0, raw)
    assert [e.get("block_hashes") for e in out] == [[1], [2], [5], [1]]
    assert out[0]["lora_name"] == "lora-3"
    # the digest in Dynamo's marker form, an identifier of another shape with its offset
    assert out[2]["extra_keys"] == [["dynamo-cache-salt:x", DIGEST[:16] + "0" * 48,
                                     ["item-7", 3]]]
    assert "mm_keys" not in out[2]
    assert forms.refused == {"mm_uuid": 1, "mm_keys": 1}
    assert forms.fields_ignored == {"group_idx": 1, "kv_cache_spec_sliding_window": 1}
    # what it made is what the next reader gets unchanged (the name feed reads it again)
    again = msgpack.unpackb(msgpack.packb(out))
    assert forms(0, again) == again and forms.tokens_converted == 0


def test_a_salted_tenants_tier_blocks_never_go_out_under_a_name_the_plugin_made(
        make_engine, tmp_path) -> None:
    """TensorRT-LLM's stream carries no salt: a salted request's tier copies never take an
    unsalted block's name, which the consolidator would have to rename (``hash_conflicts``)
    into a GPU-tier name TensorRT-LLM never published; they go out under the V2 names the
    leader computes (``tests/connector/test_v2_names.py``)."""
    from _engines import prompt
    from _kvwire import free_port

    trt_port, replay_port = free_port(), free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{trt_port}",
                            replay_endpoint=f"tcp://*:{replay_port}")
    engine = make_engine(num_gpu_blocks=12, kv_events_config=events, provide_block_hashes=False,
                         env={"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
                              "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
                              "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT":
                                  f"ipc://{tmp_path}/out-replay",
                              "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "24"})
    leader, manager = engine.leader, engine.kv_cache_manager
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-replay",
                           start_seq=0)
    try:
        for seed in range(4):
            engine.submit(prompt(seed, 17), 2)
            engine.run_until_idle()
        engine.submit(prompt(0, 17), 2, cache_salt="tenant-A")  # same tokens, salted
        engine.run_until_idle()
        engine.submit(prompt(0, 17), 2)
        engine.run_until_idle()
        held: set[int] = set()

        def settled() -> bool:
            sub.poll(20)
            held.clear()
            held.update(h for _, h in sub.held)
            return bool(held) and leader.consolidator.stats()["batches_applied"] >= \
                manager.batches

        wait_until(settled, 10, "the consolidated stream caught up with TRT-LLM's")
        sub.poll(50)
        held = {h for _, h in sub.held}
        assert held <= manager.published_hashes  # every name is one TRT-LLM put on the wire
        assert leader.consolidator.stats()["hash_conflicts"] == 0
    finally:
        sub.close()
