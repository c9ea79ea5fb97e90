"""The plugin's consolidated stream as llm-d reads it (the test model, routers/llmd_model.py).

The simulated engine (real leader, worker, host/disk tiers, event sink and consolidator) runs
chat turns with ``DYN_KVBM_KV_EVENTS_TOPIC=kv@<pod>@<model>``; a tap on the consolidated output
(joined from seq 0 through the replay endpoint) hands every batch's raw frames to the model.
Before each request is scheduled, the model is asked how many prompt tokens llm-d credits the
pod with, as llm-d's scorer would for a request naming the served model (and its raw cache
salt); that answer is compared with what the engine then reused.

What works and what does not is asserted both ways, so that a fix shows here (and the "llm-d"
paragraph of docs/operations.md is updated with it).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from _kvwire import recv

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.llmd_model import DEFAULT_BLOCK_SIZE, LlmdIndexer, llmd_tap
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.chat_workload import DriveResult, RouterProbe, TurnWaves, drive
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.wire.events import AllBlocksCleared, BlockStored, encode_batch
from kvbm_plugin.wire.publisher import ZmqEventPublisher
from kvbm_plugin.wire.subscriber import StreamSubscriber

BS = 4
POD, MODEL = "pod-0", "demo-model"
TOPIC = f"kv@{POD}@{MODEL}"


def _run(tmp: Path, *, mode: str, salts: tuple[str, ...],
         extra_env: dict[str, str] | None = None) -> tuple[
        DriveResult, LlmdIndexer, LlmdIndexer, SimulatedEngine]:
    """The workload, llm-d asked before every request; returns the drive's result, the model
    at the engine's block size, the model at llm-d's default block size, and the engine (shut
    down)."""
    env = {
        cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: mode, cc.TOPIC: TOPIC,
        cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-r",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/out", cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/out-r",
        cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "48",
        cc.DISK_CACHE_DIR: f"{tmp}/disk", **(extra_env or {}),
    }
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=32,
        tp_size=1, max_num_tokens=128, max_batch_size=4, dtype=torch.float32, env=env,
        vocab_size=30000))
    llmd = LlmdIndexer(block_size=BS)  # blockSizeTokens set to the engine's block size
    llmd_default = LlmdIndexer()  # llm-d's default blockSizeTokens (16)
    tap = llmd_tap([llmd, llmd_default], config.output.connect, config.output_replay.connect,
                   start_seq=0, view=RouterView(BS))
    llmd.foreign = []  # what llm-d credits a salted prompt with under no or an unused salt

    def external(prompt: list[int], salt: str | None, lora_name: str | None) -> int:
        if salt is not None:
            llmd.foreign += [llmd.cached_tokens(prompt, MODEL, other, pod=POD)
                             for other in (None, "tenant-unused")]
        return llmd.cached_tokens(prompt, MODEL, salt, pod=POD)

    probe = RouterProbe(engine, tap, settle_timeout=20.0, external=external)
    try:
        result = drive(engine, probe, TurnWaves(sessions=4, turns=4, system_tokens=16,
                                                user_tokens=8, gen_tokens=3, seed=5,
                                                salts=salts), timeout_s=180)
    finally:
        tap.close()
        engine.shutdown()
    return result, llmd, llmd_default, engine


@pytest.fixture(scope="module")
def unsalted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    yield _run(tmp_path_factory.mktemp("llmd"), mode="dedup", salts=())


def test_llm_d_scores_what_the_engine_reuses_for_an_unsalted_tenant(unsalted: tuple) -> None:
    result, llmd, _, engine = unsalted
    tally = result.external_tally
    assert tally.requests == result.finished > 0
    assert tally.reused_tokens > 0
    assert tally.agreement >= 0.99, tally.describe()
    assert llmd.counts["parse_errors"] == 0, llmd.last_error
    assert llmd.counts["unknown_parent_stores"] == 0
    assert llmd.counts["topic_filtered"] == 0 and llmd.counts["batches"] > 0
    # the strict router view agrees too: llm-d's answers are not worse than the project's own
    assert result.tally.agreement >= 0.99, result.tally.describe()
    stats = engine.stats()
    assert stats.host_hit_tokens + stats.disk_hit_tokens > 0  # the tiers served prefixes


def test_in_dedup_mode_llm_d_weighs_every_tier_as_gpu(unsalted: tuple) -> None:
    _, llmd, _, _ = unsalted
    assert set(llmd.tiers_held(POD)) == {"gpu"}  # host and disk blocks get the GPU's weight


def test_at_llm_ds_default_block_size_a_smaller_engine_block_indexes_little(
        unsalted: tuple) -> None:
    # llm-d keys whole blocks of its own size from each event's tokens alone: a store of
    # fewer than 16 tokens gives no key, and its children's parent is then unknown.
    _, llmd, llmd_default, _ = unsalted
    assert DEFAULT_BLOCK_SIZE == 16 and BS < 16
    assert llmd_default.counts["unkeyed_stores"] + llmd_default.counts[
        "unknown_parent_stores"] > 0
    assert sum(llmd_default.tiers_held(POD).values()) < sum(llmd.tiers_held(POD).values())


def test_in_passthrough_mode_too_and_with_the_lower_tiers_media(tmp_path: Path) -> None:
    result, llmd, _, _ = _run(tmp_path, mode="passthrough", salts=())
    assert result.external_tally.agreement >= 0.99, result.external_tally.describe()
    assert llmd.counts["parse_errors"] == 0 and llmd.counts["unknown_parent_stores"] == 0
    assert set(llmd.tiers_held(POD)) == {"gpu", "cpu", "disk"}  # weights 1.0, 0.8, 1.0


@pytest.mark.parametrize("mode", ["passthrough", "dedup"])
def test_salted_tenants_asking_with_their_own_salt_string_get_their_reuse(
        tmp_path: Path, mode: str) -> None:
    """A tenant asks as a client does (its raw salt string): the consolidated output names the
    salt that way (DYN_KVBM_KV_EVENTS_SALT_FORM=client, the default): llm-d's score agrees
    with what the engine reused, and no tenant is credited with another's blocks."""
    result, llmd, _, _ = _run(tmp_path, mode=mode, salts=("tenant-a", "tenant-b"))
    tally = result.external_tally
    assert tally.reused_tokens > 0 and tally.predicted_tokens > 0
    assert tally.agreement >= 0.99, tally.describe()
    assert llmd.counts["parse_errors"] == 0 and llmd.counts["unknown_parent_stores"] == 0
    assert result.tally.agreement >= 0.99  # the strict (Dynamo-rule) view reads it too
    # the salt isolates: a salted prompt asked under no salt or an unused one gets nothing
    assert llmd.foreign and not any(llmd.foreign)


def test_in_the_id_form_a_salted_tenant_gets_no_credit_from_llm_d(tmp_path: Path) -> None:
    """DYN_KVBM_KV_EVENTS_SALT_FORM=id: salted blocks carry ``dynamo-cache-salt:<hex>`` on
    every block, which llm-d reads as a multimodal hash: a salted tenant's view is empty."""
    result, llmd, _, _ = _run(tmp_path, mode="passthrough", salts=("tenant-a", "tenant-b"),
                              extra_env={cc.SALT_FORM: "id"})
    tally = result.external_tally
    assert tally.reused_tokens > 0
    assert tally.predicted_tokens == 0, tally.describe()
    assert result.tally.agreement >= 0.99  # Dynamo's rules still hold (query by the hex)


ADAPTERS = {0: "adapter-a", 1: "adapter-b"}


def test_tenants_and_adapters_asking_as_clients_do_get_what_the_engine_reused(
        tmp_path: Path) -> None:
    """Salted and unsalted tenants on the base model and two adapters (the same system prompt
    under every scope), each request asking llm-d by its own salt string and its adapter's
    name (DYN_KVBM_LORA_NAMES gives the names): llm-d's score equals the engine's reuse on
    >= 99 % of prompt tokens, and no store is skipped for an unknown parent."""
    env = {
        cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough", cc.TOPIC: TOPIC,
        cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/gr",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
        cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-r",
        cc.CPU_CACHE_NUM_BLOCKS: "24", cc.DISK_CACHE_NUM_BLOCKS: "48",
        cc.DISK_CACHE_DIR: f"{tmp_path}/disk",
        cc.LORA_NAMES: ",".join(f"{k}={v}" for k, v in ADAPTERS.items()),
    }
    config = cc.load_consolidator_config(env)
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BS, num_gpu_blocks=32,
        tp_size=1, max_num_tokens=128, max_batch_size=4, dtype=torch.float32, env=env,
        vocab_size=30000))
    llmd = LlmdIndexer(block_size=BS)
    tap = llmd_tap([llmd], config.output.connect, config.output_replay.connect, start_seq=0,
                   view=RouterView(BS))
    probe = RouterProbe(engine, tap, settle_timeout=20.0)
    system = [1000 + i for i in range(16)]
    scopes = [(lora, salt) for lora in (None, 0, 1) for salt in (None, "tenant-a", "tenant-b")]
    prompts = {scope: list(system) for scope in scopes}
    asked = reused = agreed = foreign = 0
    try:
        for turn in range(4):
            for i, (lora, salt) in enumerate(scopes):
                prompt = prompts[(lora, salt)] = prompts[(lora, salt)] + [
                    3000 + 131 * i + 7 * turn + j for j in range(6)]
                assert probe.settle()
                model = MODEL if lora is None else ADAPTERS[lora]
                predicted = llmd.cached_tokens(prompt, model, salt, pod=POD)
                foreign += llmd.cached_tokens(prompt, model, "tenant-unused", pod=POD)
                rid = engine.submit(prompt, 3, cache_salt=salt, lora_task_id=lora)
                engine.run_until_idle(timeout_s=60)
                result = engine.result(rid)
                got = result.gpu_hit_tokens + result.host_hit_tokens + result.disk_hit_tokens
                asked += len(prompt)
                reused += got
                agreed += len(prompt) - abs(predicted - got)
                prompts[(lora, salt)] = prompt + result.tokens[len(prompt):]
    finally:
        tap.close()
        engine.shutdown()
    assert reused > 0
    assert agreed / asked >= 0.99, (agreed, asked, reused)
    assert llmd.counts["parse_errors"] == 0, llmd.last_error
    assert llmd.counts["unknown_parent_stores"] == 0
    assert foreign == 0  # a salt nobody used is credited nothing


def test_an_adapter_not_named_in_the_setting_goes_out_as_its_task_id() -> None:
    llmd = LlmdIndexer(block_size=BS)
    store = BlockStored([1 << 40], None, [1, 2, 3, 4], BS, lora_id=7)
    llmd.receive(encode_batch(TOPIC.encode(), 0, 0.0, [store], 0))
    assert llmd.counts["stores"] == 1
    assert llmd.cached_tokens([1, 2, 3, 4], "lora-7") == BS  # what the plugin writes
    assert llmd.cached_tokens([1, 2, 3, 4], "my-adapter") == 0  # no request names it


def test_llm_d_drops_the_dp_rank_two_ranks_on_one_topic_are_one_pod() -> None:
    llmd = LlmdIndexer(block_size=BS)
    for rank, tokens in ((0, [1, 2, 3, 4]), (1, [5, 6, 7, 8])):
        store = BlockStored([(1 << 40) + rank], None, tokens, BS)
        llmd.receive(encode_batch(TOPIC.encode(), rank, 0.0, [store], rank))
    assert llmd.cached_tokens([1, 2, 3, 4], MODEL, pod=POD) == BS
    assert llmd.cached_tokens([5, 6, 7, 8], MODEL, pod=POD) == BS
    assert set(llmd.match([5, 6, 7, 8], MODEL)) == {POD}


def test_a_dp_rank_field_in_the_topic_makes_each_rank_its_own_llm_d_pod(
        tmp_path: Path) -> None:
    """``DYN_KVBM_KV_EVENTS_TOPIC=kv@pod-0-dp{dp_rank}@<model>``: each attention-DP rank's
    publishers (GPU tier at base + r, its consolidator's output at output + r) carry the
    rank's own pod name, so llm-d, which drops the batch's dp rank, keeps the ranks apart."""
    topic = "kv@pod-0-dp{dp_rank}@" + MODEL
    config = cc.load_consolidator_config({cc.TOPIC: topic,
                                          cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/e",
                                          cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/o"},
                                         num_ranks=2)
    assert [config.for_dp_rank(r).publisher.topic for r in (0, 1)] == [
        f"kv@pod-0-dp0@{MODEL}", f"kv@pod-0-dp1@{MODEL}"]
    ctx = zmq.Context()
    pubs = [ZmqEventPublisher(config.publisher, config.publish_endpoint(r),
                              data_parallel_rank=r) for r in (0, 1)]
    subs: list[zmq.Socket] = []
    llmd = LlmdIndexer(block_size=BS)
    try:
        for r, pub in enumerate(pubs):
            subs.append(_joined(ctx, config.publish_endpoint(r).connect, b"kv@",
                                lambda pub=pub: pub.publish([])))
        for r, (pub, sub) in enumerate(zip(pubs, subs, strict=True)):
            store = BlockStored([(1 << 40) + r], None, [1 + 4 * r, 2, 3, 4], BS).to_wire()
            assert pub.publish([store])
            frames = recv(sub)
            while msgpack.unpackb(frames[2])[1] == []:
                frames = recv(sub)
            assert frames[0] == f"kv@pod-0-dp{r}@{MODEL}".encode()
            llmd.receive(frames)
    finally:
        for sub in subs:
            sub.close(0)
        for pub in pubs:
            pub.shutdown(2.0)
        ctx.term()
    assert set(llmd.match([1, 2, 3, 4], MODEL)) == {"pod-0-dp0"}
    assert set(llmd.match([5, 2, 3, 4], MODEL)) == {"pod-0-dp1"}
    # rank 1 holding nothing any more (the consolidator's AllBlocksCleared) leaves rank 0's
    llmd.receive(encode_batch(f"kv@pod-0-dp1@{MODEL}".encode(), 9, 0.0, [AllBlocksCleared()], 1))
    assert set(llmd.match([1, 2, 3, 4], MODEL)) == {"pod-0-dp0"}
    assert not llmd.match([5, 2, 3, 4], MODEL)


def _joined(ctx: zmq.Context, address: str, prefix: bytes,
            probe: Callable[[], object]) -> zmq.Socket:
    """A SUB with filter ``prefix`` that has received a probe (probes drained)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, prefix)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe()
        if sub.poll(20):
            while sub.poll(50):
                sub.recv_multipart()
            return sub
    sub.close(0)
    raise AssertionError(f"SUB {prefix!r} never joined {address}")


def test_an_llm_d_topic_reaches_llm_d_and_subscribers_of_every_topic(tmp_path: Path) -> None:
    """``DYN_KVBM_KV_EVENTS_TOPIC=kv@<pod>@<model>``: llm-d's ``kv@`` filter and the ``""``
    filter Dynamo and vLLM use both receive it, and so does the plugin's own subscriber."""
    config = cc.load_consolidator_config({cc.TOPIC: TOPIC,
                                          cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/e"})
    assert config.publisher.topic == TOPIC
    endpoint = config.publish_endpoint(0)
    pub = ZmqEventPublisher(config.publisher, endpoint)
    ctx = zmq.Context()
    subs: list[zmq.Socket] = []
    plugin = StreamSubscriber(endpoint.connect, context=ctx)
    try:
        subs += [_joined(ctx, endpoint.connect, prefix, lambda: pub.publish([]))
                 for prefix in (b"kv@", b"")]
        removed = [{"type": "BlockRemoved", "block_hashes": [1 << 40], "medium": "GPU"}]
        assert pub.publish(removed)
        llmd = LlmdIndexer(block_size=BS)
        for sub in subs:
            frames = recv(sub)
            while msgpack.unpackb(frames[2])[1] == []:  # another SUB's join probe
                frames = recv(sub)
            assert frames[0] == TOPIC.encode() and len(frames) == 3
            assert msgpack.unpackb(frames[2])[1] == removed
            assert struct.unpack(">Q", frames[1])[0] > 0
            llmd.receive(frames)
        assert llmd.counts["batches"] == 2 and llmd.counts["topic_filtered"] == 0
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            pub.publish(removed)
            got = [e for b in plugin.poll(50) for e in b.events]
        assert got and got[0].block_hashes == [1 << 40]
    finally:
        for sub in subs:
            sub.close(0)
        plugin.close()
        pub.shutdown(2.0)
        ctx.term()


@pytest.mark.parametrize("topic", ["kv@pod", "kv@@m", "kv@p@", "kv@p@org/m@v2", "kv@"])
def test_a_topic_llm_d_would_misread_is_refused(topic: str) -> None:
    with pytest.raises(cc.ConfigError, match=r"DYN_KVBM_KV_EVENTS_TOPIC='kv@"):
        cc.load_publisher_settings({cc.TOPIC: topic})
    for fine in ("", "kv", "kv-events", TOPIC):
        assert cc.load_publisher_settings({cc.TOPIC: fine}).topic == fine
