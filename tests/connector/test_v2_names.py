"""TensorRT-LLM's own stream as the GPU-tier source: salted tenants and LoRA adapters carry
upstream's names. The leader computes each request's V2 radix keys (``naming.names``:
``tensorrt_llm/runtime/kv_cache_manager_v2/_block_radix_tree.py``, stored id 55130171628) and
hands the consolidator the scope the stream does not carry (``EngineForms.scopes``)."""

from __future__ import annotations

import hashlib

import pytest
from _engines import prompt
from _kvwire import free_port, wait_until

from kvbm_plugin.consolidator.engine_forms import EngineForms
from kvbm_plugin.naming.names import (
    radix_key_hash,
    radix_key_tail_hash,
    v2_block_key,
    v2_chain,
    v2_reuse_salt,
    v2_root_key,
    v2_scope_bytes,
)
from kvbm_plugin.testing.fake_trtllm import KVEventsConfig
from kvbm_plugin.wire.identity import cache_salt_id, salt_extra_key
from kvbm_plugin.wire.subscriber import StreamSubscriber


def _le(v: int) -> bytes:
    return v.to_bytes(8, "little")


def test_v2_keys_follow_the_radix_trees_rule_on_paper_inputs() -> None:
    # ReuseScope().to_bytes() is the mask byte 0 alone; sha256(b"\x00") is a known digest
    assert v2_scope_bytes() == b"\x00"
    assert v2_root_key().hex() == \
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    # bit 0: lora_id, bit 1: salt; each present field as 8 bytes little-endian, lora first
    assert v2_scope_bytes(7, None) == b"\x01" + _le(7)
    assert v2_scope_bytes(None, 11) == b"\x02" + _le(11)
    assert v2_scope_bytes(7, 11) == b"\x03" + _le(7) + _le(11)
    assert v2_root_key(7, 11) == hashlib.sha256(b"\x03" + _le(7) + _le(11)).digest()
    # upstream's own test: every scope, None vs 0 included, seeds a distinct root
    roots = {v2_root_key(*s) for s in ((None, None), (0, None), (None, 0), (0, 0), (7, 11))}
    assert len(roots) == 5
    root = v2_root_key()
    b0 = v2_block_key(root, [1, 2, 3, 4])
    assert b0 == hashlib.sha256(root + _le(1) + _le(2) + _le(3) + _le(4)).digest()
    b1 = hashlib.sha256(b0 + _le(5) + _le(6) + _le(7) + _le(8)).digest()
    assert v2_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [b0, b1]  # full blocks only
    assert v2_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, parent_key=b0) == [b1]
    # the manager's salt: the first 8 bytes of sha256(cache_salt), little-endian
    assert v2_reuse_salt("tenant-A") == \
        int.from_bytes(hashlib.sha256(b"tenant-A").digest()[:8], "little")
    # wire hashes: first 8 bytes (44004b3, 13599e9) or last 8 (the adapter form), signed
    key = bytes(range(0x80, 0xA0))
    assert radix_key_hash(key) == int.from_bytes(key[:8], "big") - (1 << 64)
    assert radix_key_tail_hash(key) == int.from_bytes(key[-8:], "big") - (1 << 64)
    with pytest.raises(ValueError, match="token id"):
        v2_block_key(root, [-1])
    # the newest hasher packs each id in 4 bytes (_block_radix_tree.py @ 27efb004dedb)
    le4 = b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))
    assert v2_block_key(root, [1, 2, 3, 4], 4) == hashlib.sha256(root + le4).digest()
    assert v2_chain([1, 2, 3, 4, 5], 4, width=4) == [v2_block_key(root, [1, 2, 3, 4], 4)]
    with pytest.raises(ValueError, match="token id"):
        v2_block_key(root, [1 << 32], 4)
    with pytest.raises(ValueError, match="width"):
        v2_block_key(root, [1], 2)


def test_a_registered_scope_goes_into_the_gpu_blocks_identity() -> None:
    forms = EngineForms()
    salt = cache_salt_id("tenant-A")
    forms.scopes.register(5, (3, salt))
    forms.scopes.register(6, (3, salt))
    events = [{"type": "BlockStored", "block_hashes": [5, 6, 7], "parent_block_hash": None,
               "token_ids": list(range(12)), "block_size": 4, "lora_id": None,
               "medium": "GPU", "lora_name": None}]
    out = forms(0, events)
    assert out[0]["extra_keys"] == [[salt_extra_key(salt)], [salt_extra_key(salt)], None]
    assert out[0]["lora_id"] == 3 and out[0]["lora_name"] == "lora-3"
    assert forms.stats()["engine_scopes_applied"] == 2
    # the older adapter form writes its hash as a u64: the same block as its int64
    forms.scopes.register(-2, (None, salt))
    unsigned = forms(0, [dict(events[0], block_hashes=[(1 << 64) - 2], extra_keys=None,
                              token_ids=[1, 2, 3, 4], lora_id=None, lora_name=None)])
    assert unsigned[0]["extra_keys"] == [[salt_extra_key(salt)]]
    assert unsigned[0]["lora_id"] is None
    small = EngineForms()
    small.scopes.capacity = 2
    for h in range(3):
        small.scopes.register(h, (None, 1))
    assert small.scopes.get(0) is None and small.stats()["engine_scopes_evicted"] == 1


@pytest.mark.parametrize(("form", "width"), [("44004b3864a7", 8), ("13599e98c71c", 8),
                                             ("13599e98c71c", 4)])
def test_salted_and_adapter_blocks_go_out_under_upstreams_names(make_engine, tmp_path,
                                                               form, width) -> None:
    # width: bytes per token id in upstream's radix keys (8, or 4 on the newest hasher); the
    # leader computes both until the stream shows which one this engine uses
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
    manager.form = form  # upstream's msgspec schema of that revision
    manager.key_width = width
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-replay",
                           start_seq=0)
    try:
        for seed in range(3):
            engine.submit(prompt(seed, 17), 2)
            engine.run_until_idle()
        engine.submit(prompt(0, 17), 2, cache_salt="tenant-A")
        engine.run_until_idle()
        engine.submit(prompt(1, 17), 2, lora_task_id=3)
        engine.run_until_idle()
        engine.submit(prompt(0, 17), 2, cache_salt="tenant-A", lora_task_id=3)
        engine.run_until_idle()
        for seed in range(4, 7):  # evict the scoped blocks from the GPU into the host tier
            engine.submit(prompt(seed, 17), 2)
            engine.run_until_idle()
        gpu = manager.resident_wire_hashes()
        host = {h - (1 << 64) if h >= 1 << 63 else h for h in leader.resident_hashes("host")}
        view: set[int] = set()

        def settled() -> bool:
            sub.poll(20)
            view.clear()
            view.update(h for _, h in sub.held)
            return view == gpu | host

        wait_until(settled, 10, "the consolidated view = upstream's GPU blocks + host tier")
        gpu_names = {h for _, h, medium in sub.held_with_medium if medium == "GPU"}
        # every GPU-tier name on the consolidated stream is one upstream put on the wire (a
        # block held in two media goes out once, under the medium that stored it first)
        assert gpu <= gpu_names <= manager.published_hashes
        assert host <= manager.published_hashes  # tier copies under upstream's names
        salt = v2_reuse_salt("tenant-A")
        for tokens, lora, s in ((prompt(0, 17), None, salt), (prompt(1, 17), 3, None),
                                (prompt(0, 17), 3, salt)):
            names = {radix_key_hash(k) for k in v2_chain(tokens[:16], 4, lora_id=lora, salt=s,
                                                         width=width)}
            assert names <= manager.published_hashes  # upstream's own names for them...
            assert names <= view  # ...held by the consolidated view (GPU or host tier)
        stats = leader.stats()
        assert stats["tier_stores_unnamed_dropped"] == 0
        assert leader.consolidator.stats()["hash_conflicts"] == 0
        assert sub.stats.orphan_stores == 0 and sub.stats.unknown_removes == 0
        assert sub.stats.duplicate_stores == 0
        # the scoped blocks were offloaded and named (not left waiting for a name)
        assert stats["tier_stores_waiting_for_name"] == 0
        assert stats["engine_scopes_applied"] > 0  # salted/adapter GPU blocks were scoped
        assert leader._naming.v2_wire == ("head", width)  # noqa: SLF001 - the form it found
    finally:
        sub.close()


def test_under_attention_dp_each_ranks_salted_blocks_keep_upstreams_names(tmp_path) -> None:
    """Two attention-DP ranks, each with its own TensorRT-LLM stream, consolidator and host
    tier: a salted tenant on each rank; each rank's consolidated view holds exactly its GPU
    pool's and tiers' blocks, the salted ones under upstream's names."""
    from kvbm_plugin import consolidator_config as cc
    from kvbm_plugin.cli.demo_adp import subscribers_for
    from kvbm_plugin.events.trtllm_publisher import trtllm_streams
    from kvbm_plugin.routers.router_view import RouterView
    from kvbm_plugin.testing.adp import AttentionDpEngine
    from kvbm_plugin.testing.engine import EngineConfig
    from kvbm_plugin.wire.events import to_signed_int64

    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/trt",
                            replay_endpoint=f"ipc://{tmp_path}/trt-replay")
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-replay",
           cc.CPU_CACHE_NUM_BLOCKS: "24"}
    config = EngineConfig(attention_dp=2, env=env, tokens_per_block=4, num_gpu_blocks=12,
                          kv_events_config=events, provide_block_hashes=False)
    salt = v2_reuse_salt("tenant-A")
    with AttentionDpEngine(config) as engine:
        view = RouterView(4)
        streams = trtllm_streams(engine.rank0.kv_cache_manager.trtllm_pub, 0, "127.0.0.1")
        subscribers = subscribers_for(cc.load_consolidator_config(
            env, num_ranks=2, attention_dp=True, gpu_streams=streams), 2, view)
        try:
            for r in range(2):
                engine.submit(prompt(r, 17), 2, dp_rank=r)
            engine.run_until_idle()
            for r in range(2):
                engine.submit(prompt(r, 17), 2, cache_salt="tenant-A", dp_rank=r)
            engine.run_until_idle()
            for seed in range(4, 7):  # evict into the host tier
                for r in range(2):
                    engine.submit(prompt(10 * seed + r, 17), 2, dp_rank=r)
                engine.run_until_idle()
            for r in range(2):
                engine.call(r, "publish_now")

            def truth(r: int) -> set[tuple[int, int]]:
                resident = engine.call(r, "resident_blocks")
                return ({(r, h) for h in engine.call(r, "gpu_wire_hashes")}
                        | {(r, to_signed_int64(h)) for h in resident["CPU"][r]})

            def settled() -> bool:
                for subscriber in subscribers:
                    subscriber.poll(10)
                return all(engine.call(r, "leader_stats")["tier_stores_waiting_for_name"] == 0
                           and s.held == truth(r) for r, s in enumerate(subscribers))

            wait_until(settled, 20, "each rank's consolidated view = its GPU pool + tier")
            for r, subscriber in enumerate(subscribers):
                names = {(r, radix_key_hash(k)) for k in v2_chain(prompt(r, 17)[:16], 4,
                                                                   salt=salt)}
                assert names <= subscriber.held  # the salted tenant, under upstream's names
                assert engine.call(r, "leader_stats")["engine_scopes_applied"] > 0
        finally:
            for subscriber in subscribers:
                subscriber.close()


def test_the_truncation_is_confirmed_from_the_stream_after_the_request_is_gone() -> None:
    # A request may finish before the stream that stores its blocks is read (the overlap
    # loop publishes a pass later; the reader is another thread): the truncation and the
    # salt rule are then confirmed from the stream itself, and the salted blocks' content
    # keys are named. Before, they were confirmed only through a live request's learned
    # names, and under attention DP one rank in two runs never confirmed them: its salted
    # tier copies waited for names for good (Dynamo credited none of them).
    from kvbm_plugin.leader.requests import RequestState
    from kvbm_plugin.naming.names import BlockNaming, NameInputs

    stats: dict[str, int] = {}
    naming = BlockNaming(4, stats)
    naming.v2_stream = True
    naming.scope_sink = EngineForms().scopes
    salt = v2_reuse_salt("tenant-A")
    tokens = list(range(100, 112))
    state = RequestState(7, scope=(None, cache_salt_id("tenant-A")), tokens=tokens,
                         keys=[11, 12, 13])
    state.name_inputs = NameInputs(cache_salt_id("tenant-A"), None, v2_salt=salt)
    naming.v2_extend(state)
    keys = v2_chain(tokens, 4, salt=salt)
    assert naming.v2_wire is None and naming.names.hash_of_key(11) is None  # not confirmed
    # the request is gone; the stream then stores its blocks under upstream's names
    naming.names.observe(0, [{
        "type": "BlockStored", "block_hashes": [radix_key_hash(k) for k in keys],
        "parent_block_hash": None, "token_ids": tokens, "block_size": 4, "lora_id": None,
        "medium": "GPU", "lora_name": None}])
    naming.refresh([])
    assert naming.v2_wire == ("head", 8)
    assert [naming.names.hash_of_key(k) for k in (11, 12, 13)] == \
        [radix_key_hash(k) % (1 << 64) for k in keys]  # u64, as the stream's names are kept
