"""The several-group save barrier (worker/layer_groups.py): wait_for_save waits, at
most ISSUE_TIMEOUT_S, until the transfer thread issued the iteration's saves, because the next
allocation may hand a sliding page to another request. A save job the executor thread stopped
waiting for must not read its pages later: by then they may hold another request's KV."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from _engines import tiers

from kvbm_plugin.connector.meta import (
    HOST,
    ConnectorMetadata,
    SaveOp,
    TierLayout,
    close_hub,
    open_hub,
)
from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.testing.fake_layout import (
    KvCacheBufferRef,
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
)
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig
from kvbm_plugin.worker import layer_groups as layer_group_worker

BS = 4


def _finished(worker: KvbmConnectorWorker, saving: list[int]) -> None:
    deadline = time.monotonic() + 10
    while worker.get_finished(saving, []) == ([], []):
        assert time.monotonic() < deadline, "the save never reached a terminal state"
        time.sleep(0.005)


@pytest.fixture
def two_groups() -> Any:
    group = "issue-barrier"
    open_hub(group)
    args = LlmArgs(KvCacheConfig(BS, max_attention_window=[8, 4096]), ParallelConfig(0, 1),
                   kvbm_plugin_env=tiers(host=8), kvbm_plugin_group=group)
    worker = KvbmConnectorWorker(args)
    full = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    sliding = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8) + 5000
    worker.register_kv_cache_layout(KvCacheLayout(BS, (
        KvCacheLayerGroupLayout(0, (1,), None,
                                (KvCacheRegion.over(full, (KvCacheBufferRef(1, "key"),)),)),
        KvCacheLayerGroupLayout(1, (0,), 8,
                                (KvCacheRegion.over(sliding, (KvCacheBufferRef(0, "key"),)),)),
    )))
    try:
        yield worker, full, sliding
    finally:
        worker.shutdown()
        close_hub(group)


def test_a_save_the_executor_stopped_waiting_for_never_reads_its_pages(
        two_groups: Any, monkeypatch: pytest.MonkeyPatch, expect_errors: Any) -> None:
    """The transfer thread is held (a job before the save) past the barrier's bound; the
    executor thread goes on and the window hands the sliding page to another request, which
    writes it. Released, the save must fail rather than store the other request's bytes
    under this block's key (before: slot 0 held them, advertised as block 99)."""
    worker, full, sliding = two_groups
    monkeypatch.setattr(layer_group_worker, "ISSUE_TIMEOUT_S", 0.2)
    gate = threading.Event()
    transfers = worker._transfers  # noqa: SLF001
    transfers._run_loads = lambda loads: gate.wait(10)  # noqa: SLF001
    transfers.put_loads(())
    worker.bind_connector_meta(ConnectorMetadata(
        1, TierLayout(8, 0, None), saves=(SaveOp(1, 7, 3, HOST, 0, 99, pages=(3, 2)),)))
    started = time.monotonic()
    worker.wait_for_save(None)
    assert time.monotonic() - started < 5  # bounded
    sliding[2] = -1.0  # the next pass: page 2 now belongs to another request
    gate.set()
    _finished(worker, [7])
    host = worker._host  # noqa: SLF001
    assert host.keys[0] != 99, "a save read a page after the executor stopped guarding it"
    assert worker.stats()["saves_abandoned"] == 1
    assert any("its saves fail" in m for m in expect_errors.messages())


def test_a_save_issued_in_time_is_stored_byte_exact(two_groups: Any) -> None:
    """The barrier's normal case: the save is issued before wait_for_save returns, so a page
    the next pass rewrites was read first."""
    worker, full, sliding = two_groups
    expected = torch.cat([full[3].view(torch.uint8), sliding[2].view(torch.uint8)])
    worker.bind_connector_meta(ConnectorMetadata(
        1, TierLayout(8, 0, None), saves=(SaveOp(1, 7, 3, HOST, 0, 99, pages=(3, 2)),)))
    worker.wait_for_save(None)
    sliding[2] = -1.0
    _finished(worker, [7])
    host = worker._host  # noqa: SLF001
    assert host.keys[0] == 99
    assert torch.equal(host.pool[0], expected)  # type: ignore[attr-defined]
    assert worker.stats()["saves_abandoned"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_disk_load_into_a_page_waits_for_an_earlier_save_of_it() -> None:
    """CUDA: an earlier iteration's save of sliding page 2 still waits on the side stream
    (behind other copies: a sleep here) when the window hands page 2 to another request
    whose disk load writes it on the disk stream. The save must read block 99's bytes, not
    the load's."""
    group = "issue-barrier-cuda"
    open_hub(group)
    args = LlmArgs(KvCacheConfig(BS, max_attention_window=[8, 4096]), ParallelConfig(0, 1),
                   kvbm_plugin_env=tiers(host=8), kvbm_plugin_group=group)
    worker = KvbmConnectorWorker(args)
    full = torch.arange(8 * 16, dtype=torch.float32, device="cuda").reshape(8, 16)
    sliding = torch.arange(8 * 8, dtype=torch.float32, device="cuda").reshape(8, 8) + 5000
    try:
        worker.register_kv_cache_layout(KvCacheLayout(BS, (
            KvCacheLayerGroupLayout(0, (1,), None, (KvCacheRegion.over(
                full, (KvCacheBufferRef(1, "key"),)),)),
            KvCacheLayerGroupLayout(1, (0,), 8, (KvCacheRegion.over(
                sliding, (KvCacheBufferRef(0, "key"),)),)))))
        expected = sliding[2].view(torch.uint8).cpu()
        with torch.cuda.stream(worker._copy_engine.side_stream):  # noqa: SLF001
            torch.cuda._sleep(int(1e9))  # copies queued ahead of the save
        worker.bind_connector_meta(ConnectorMetadata(
            1, TierLayout(8, 0, None), saves=(SaveOp(1, 7, 3, HOST, 0, 99, pages=(3, 2)),)))
        worker.wait_for_save(None)
        staging = worker._disk_io.staging  # noqa: SLF001 (the disk thread's, idle here)
        assert staging.buffer.shape == (worker._groups_io.block_bytes,)  # noqa: SLF001
        staging.buffer.fill_(7)
        staging.timeout_s = 30.0
        assert staging.to_device(5, (5, 2))
        _finished(worker, [7])
        host = worker._host  # noqa: SLF001
        assert host.keys[0] == 99
        assert torch.equal(host.pool[0][16 * 4:], expected)  # type: ignore[attr-defined]
    finally:
        worker.shutdown()
        close_hub(group)


def test_a_save_naming_a_page_past_its_groups_pool_fails_whole(two_groups: Any,
                                                                expect_errors: Any) -> None:
    """A page index past a group's pool (8 pages here) addresses nothing: the save fails and
    the slot is not stored under the block's key (before: that group's segment was skipped,
    the rest copied, and the slot stored as block 99 with one group's bytes missing)."""
    worker, full, sliding = two_groups
    worker.bind_connector_meta(ConnectorMetadata(
        1, TierLayout(8, 0, None), saves=(SaveOp(1, 7, 3, HOST, 0, 99, pages=(3, 8)),
                                          SaveOp(2, 7, 4, HOST, 1, 98, pages=(4, 1)))))
    worker.wait_for_save(None)
    _finished(worker, [7])
    host = worker._host  # noqa: SLF001
    assert host.keys[0] is None and host.keys[1] == 98  # the good one still goes
    assert worker.stats()["ops_failed"] == 1
    assert any("page 8 of layer group 1" in m for m in expect_errors.messages())
