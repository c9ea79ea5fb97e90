"""Sliding-window models (several KV layer groups, leader/layer_groups.py): the per-group
calls of TensorRT-LLM's connector API, driven by the simulated sliding-window executor
(testing/vswa_engine.py). Every group's bytes come back exact, no sliding group is saved
beyond its window, no dead or -1 page is touched, and a router following the consolidated
stream agrees with what the engine reused. What stays unsupported is refused at
construction in one line."""

from __future__ import annotations

import pytest
from _engines import prompt, tiers
from _vswa import BS, OFF, WINDOW, ViewRecorder, _chats, _check_engine, _drive

from kvbm_plugin.connector_leader import KvbmConnectorLeader
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.testing.fake_layout import (
    KvCacheBufferRef,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig
from kvbm_plugin.testing.vswa_engine import VswaConfig, VswaEngine


def _args(windows: list[int], env: dict[str, str], group: str) -> LlmArgs:
    return LlmArgs(KvCacheConfig(BS, max_attention_window=windows), ParallelConfig(0, 1),
                   kvbm_plugin_env=env, kvbm_plugin_group=group)


# ------------------------------------------------------------------ refused at construction

@pytest.mark.parametrize("cls", [KvbmConnectorLeader, KvbmConnectorWorker])
def test_several_windows_without_the_per_group_api_are_refused_naming_them(cls,
                                                                            monkeypatch) -> None:
    import kvbm_plugin.connector_leader as leader_mod
    import kvbm_plugin.connector_worker as worker_mod

    for mod in (leader_mod, worker_mod):
        monkeypatch.setattr(mod, "has_layer_group_api", lambda: False)
    args = _args([4096, 512, 4096], tiers(host=8), "vswa-old")
    with pytest.raises(ConfigError, match=r"2 windows \[4096, 512\].*no update_state_after_"
                                          "alloc_by_layer_group"):
        cls(args)


@pytest.mark.parametrize(("env", "what"), [
    (tiers(disk=8), "the disk tier needs the host tier"),
    (tiers(host=8, DYN_KVBM_SHARED_TIER="memory", DYN_KVBM_SHARED_MODEL_KEY="m"),
     "shared tier does not support several layer groups")])
def test_what_several_groups_cannot_run_with_is_refused_in_one_line(env, what) -> None:
    with pytest.raises(ConfigError, match=what) as info:
        KvbmConnectorLeader(_args([4096, 512], env, "vswa-refused"))
    assert "\n" not in str(info.value) and "[4096, 512]" in str(info.value)


def test_several_windows_on_the_cpp_kv_cache_manager_are_refused() -> None:
    args = _args([4096, 512], tiers(host=8), "vswa-v1")
    args.kv_cache_config.use_kv_cache_manager_v2 = False
    with pytest.raises(ConfigError, match=r"2 windows \[4096, 512\].*use_kv_cache_manager_v2"
                                          "=False"):
        KvbmConnectorLeader(args)


def test_several_windows_reported_as_one_flat_list_stop_before_any_save() -> None:
    """A cache that does not describe its groups (one flat list for a several-window model)
    would have one group's pages saved as the block: the first build raises instead."""
    from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput

    leader = KvbmConnectorLeader(_args([4096, 512], tiers(host=8), "vswa-flat"))
    try:
        data = RequestData(1, list(range(9)), [0, 1, 2], 0, 9)
        with pytest.raises(RuntimeError, match=r"windows \[4096, 512\].*one flat page list"):
            leader.build_connector_meta(SchedulerOutput(new_requests=[data]))
        assert leader.stats()["saves_scheduled"] == 0
    finally:
        leader.shutdown()


def test_one_window_repeated_per_layer_is_one_group() -> None:
    KvbmConnectorLeader(_args([4096, 4096], tiers(host=8), "one-window")).shutdown()


def test_a_hybrid_layout_is_refused_naming_its_layer_kinds() -> None:
    import torch

    worker = KvbmConnectorWorker(_args([4096, 512], tiers(host=8), "hybrid"))
    try:
        attn = KvCacheRegion.over(torch.zeros(8, 64), (KvCacheBufferRef(0, "key"),
                                                       KvCacheBufferRef(0, "value")))
        ssm = KvCacheRegion.over(torch.zeros(8, 32), (KvCacheBufferRef(1, "ssm_state"),
                                                      KvCacheBufferRef(1, "conv_state")))
        layout = KvCacheLayout(BS, (KvCacheLayerGroupLayout(0, (0,), None, (attn,)),
                                    KvCacheLayerGroupLayout(1, (1,), None, (ssm,))))
        with pytest.raises(ValueError, match=r"hybrid model refused: layers \[1\] hold "
                                             "conv_state/ssm_state"):
            worker.register_kv_cache_layout(layout)
    finally:
        worker.shutdown()


# ------------------------------------------------------------------ the executor

def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(("tp_size", "device"), [
    (1, "cpu"), (2, "cpu"),
    pytest.param(2, "cuda", marks=pytest.mark.skipif("not _cuda()", reason="needs CUDA"))])
def test_a_sliding_window_model_offloads_and_onboards_every_group_byte_exact(tp_size,
                                                                             device) -> None:
    rec = ViewRecorder("w")
    with VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW, tp_size=tp_size,
                               device=device, env=tiers(host=10, disk=64, **OFF),
                               tier_events=rec)) as engine:
        total, disagreed, loaded = _drive(engine, lambda t: rec.view.cached_tokens(t))
        _check_engine(engine)
        assert loaded > 0.2 * total, (loaded, total)  # the long chat is never servable
        assert disagreed <= 0.01 * total, (disagreed, total)
        assert rec.view.counts.warnings == 0, rec.view.counts.as_dict()
        leader = engine.leader.stats()
        assert leader["host_evictions"] > 0 and leader["demotes_committed"] > 0, leader
        # Both tiers served blocks back: host copies and disk files (demoted host slots).
        assert leader["matched_host_tokens"] > 0 and leader["matched_disk_tokens"] > 0, leader
        worker = engine.ranks[-1].worker.stats()
        # A tier slot holds both groups' pages: the groups differ in bytes per page.
        io = engine.ranks[-1].worker._groups_io  # noqa: SLF001
        assert io is not None and len(set(io.page_bytes)) == 2
        assert worker["bytes_onboarded"] == worker["blocks_onboarded"] * io.block_bytes > 0


def test_a_sliding_group_is_never_saved_beyond_its_window() -> None:
    """One long prompt: its first blocks left the window during its own prefill, so no group
    saves them (a block is kept only with every group), and nothing of it is servable."""
    with VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW,
                               env=tiers(host=64, **OFF))) as engine:
        long = prompt(5, 12 * BS + 1)
        engine.submit(long, 2)
        engine.run_until_idle()
        again = engine.submit(long, 2)
        engine.run_until_idle()
        _stats = engine.stats
        assert _stats.window_violations == 0 and _stats.dead_page_touches == 0
        assert engine.loaded_tokens(again) == 0
        assert engine.leader.stats()["saves_scheduled"] == 0
        # A prompt within the window: every block saved in both groups, and served back.
        short = prompt(6, 3 * BS + 1)
        engine.submit(short, 1)
        engine.run_until_idle()
        back = engine.submit(short, 1)
        engine.run_until_idle()
        assert engine.loaded_tokens(back) == 3 * BS and engine.stats.kv_mismatches == 0
        assert engine.stats.sliding_saves == engine.stats.full_saves == 3


def test_attention_dp_ranks_each_serve_their_own_groups() -> None:
    """Attention DP 2: each rank its own executor and leader (its own tiers)."""
    recs = [ViewRecorder("w"), ViewRecorder("w")]
    engines = [VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW, attention_dp=2,
                                     dp_rank=r, env=tiers(host=10, disk=64, **OFF),
                                     tier_events=recs[r])) for r in range(2)]
    try:
        for r, engine in enumerate(engines):
            total, disagreed, loaded = _drive(engine, lambda t, r=r: recs[r].view.cached_tokens(
                t, dp_rank=r), seed=5 + r, turns=2)
            _check_engine(engine)
            assert loaded > 0 and disagreed <= 0.01 * total, (r, loaded, disagreed, total)
            assert recs[r].view.counts.warnings == 0
            assert {m.dp_rank for m in recs[r].view.match(_chats(5 + r)[0])} <= {r}
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_save_reads_a_sliding_page_before_the_window_hands_it_to_another_request() -> None:
    """The transfer thread is held back until the third pass ran (or 1 s): block 0 of a
    19-token prompt is saved at its prefill and leaves the window two passes later, when its
    page goes to the next request. wait_for_save waits until the save was issued, so the
    tier copy is still block 0's (without that wait it would hold the other request's)."""
    import threading

    with VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW,
                               env=tiers(host=64, **OFF))) as engine:
        transfers = engine.ranks[0].worker._transfers  # noqa: SLF001
        passes = [0]
        moved = threading.Condition()
        run_saves = transfers._run_saves  # noqa: SLF001

        def held_back(meta, event) -> None:  # noqa: ANN001
            start = passes[0]
            with moved:
                moved.wait_for(lambda: passes[0] >= start + 3, timeout=1.0)
            run_saves(meta, event)

        transfers._run_saves = held_back  # noqa: SLF001
        step = engine.step

        def counted() -> None:
            step()
            with moved:
                passes[0] += 1
                moved.notify_all()

        engine.step = counted  # type: ignore[method-assign]
        first = prompt(8, 19)
        engine.submit(first, 4)
        for _ in range(2):
            engine.step()
        engine.submit(prompt(9, 7), 1)  # takes the page block 0 of the first one left
        engine.run_until_idle()
        transfers._run_saves = run_saves  # noqa: SLF001
        again = engine.submit(first, 1)
        engine.run_until_idle()
        assert engine.loaded_tokens(again) == 16
        assert engine.stats.kv_mismatches == 0 and engine.stats.dead_page_touches == 0


def test_one_group_on_the_layout_entry_keeps_the_flat_path() -> None:
    """register_kv_cache_layout with one group of one region forwards the pool tensor to
    register_kv_caches (upstream's default): flat ops, no per-group pages, bytes exact."""
    with VswaEngine(VswaConfig(tokens_per_block=BS, sliding_layers=0, full_layers=2,
                               env=tiers(host=64, **OFF))) as engine:
        assert engine.ranks[0].worker._groups_io is None  # noqa: SLF001
        first = prompt(11, 6 * BS + 1)
        engine.submit(first, 2)
        engine.run_until_idle()
        again = engine.submit(first, 1)
        engine.run_until_idle()
        assert engine.loaded_tokens(again) == 6 * BS
        assert engine.stats.kv_mismatches == 0 and engine.stats.pages_checked > 0
        assert engine.leader.stats()["window_skips"] == 0


def test_one_group_of_several_regions_copies_every_region() -> None:
    """A one-group layout no single pool tensor describes (K/V beside a block-scale region)
    goes the per-region way with flat ops: the op's device block is the page of every
    region, and a save and a load move every region's bytes."""
    import time

    import torch

    from kvbm_plugin.connector.meta import (
        HOST,
        ConnectorMetadata,
        LoadCopy,
        LoadOp,
        SaveOp,
        TierLayout,
        close_hub,
        open_hub,
    )

    group = "regions"
    open_hub(group)  # where the worker reports (a leader's hub)
    worker = KvbmConnectorWorker(_args([4096], tiers(host=8), group))
    try:
        kv = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
        scale = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 1000
        regions = (KvCacheRegion.over(kv, (KvCacheBufferRef(0, "key"),
                                           KvCacheBufferRef(0, "value"))),
                   KvCacheRegion.over(scale, (KvCacheBufferRef(0, "block_scale"),)))
        worker.register_kv_cache_layout(
            KvCacheLayout(BS, (KvCacheLayerGroupLayout(0, (0,), None, regions),)))
        tiers_layout = TierLayout(8, 0, None)

        def finished(saving: list[int], loading: list[int]) -> None:
            deadline = time.monotonic() + 10
            while worker.get_finished(saving, loading) == ([], []):
                assert time.monotonic() < deadline
                time.sleep(0.005)

        worker.bind_connector_meta(ConnectorMetadata(
            1, tiers_layout, saves=(SaveOp(1, 7, 3, HOST, 0, 99),)))
        worker.wait_for_save(None)
        finished([7], [])
        worker.bind_connector_meta(ConnectorMetadata(
            2, tiers_layout, loads=(LoadOp(8, (LoadCopy(2, HOST, 0, 99, 5),)),)))
        worker.start_load_kv(None)
        finished([], [8])
        assert torch.equal(kv[5], kv[3]) and torch.equal(scale[5], scale[3])
        assert worker.stats()["bytes_onboarded"] == (16 + 4) * 4
    finally:
        worker.shutdown()
        close_hub(group)


def test_a_layout_of_several_regions_with_the_shared_tier_is_refused_in_one_line() -> None:
    import torch

    env = tiers(host=8, DYN_KVBM_SHARED_TIER="memory", DYN_KVBM_SHARED_MODEL_KEY="m")
    worker = KvbmConnectorWorker(_args([4096], env, "regions-shared"))
    try:
        regions = tuple(KvCacheRegion.over(torch.zeros(8, n), (KvCacheBufferRef(0, role),))
                        for n, role in ((16, "key"), (4, "block_scale")))
        with pytest.raises(ValueError, match=r"^kvbm_plugin: the shared tier does not support "
                                             r"a KV cache of 1 layer group\(s\) and 2 regions"):
            worker.register_kv_cache_layout(
                KvCacheLayout(BS, (KvCacheLayerGroupLayout(0, (0,), None, regions),)))
    finally:
        worker.shutdown()
