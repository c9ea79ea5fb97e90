"""A promised load that fails is recomputed, never computed on: each cause reaches the worker's
``get_block_ids_with_load_errors`` before the request can compute, the simulated executor's
manager (``handle_load_errors``, as upstream's) finds the request holding those blocks, and the
request redoes its connector-loaded tokens. Its KV then equals what the forward computes without
the plugin (``kv_mismatches`` compares every block with the model's values). With
``load_errors=False`` (TensorRT-LLM revisions without the API) the old behaviour stays: a
counted failure, computed on unfilled blocks."""

from __future__ import annotations

import os
from typing import Any

import pytest
from _engines import prompt, tiers

from kvbm_plugin.connector.meta import HOST, ConnectorMetadata, LoadCopy, LoadOp, TierLayout
from kvbm_plugin.worker.copy_engine import CopyEngine
from kvbm_plugin.worker.device_copy import DiskStaging
from kvbm_plugin.worker.load_errors import LoadErrorRecord
from kvbm_plugin.worker.request_progress import RequestProgress
from kvbm_plugin.worker.transfer_counters import TransferCounters

BS = 4


def _through_tier(engine: Any, tokens: list[int]) -> None:
    """Compute ``tokens`` once, then push them out of the GPU pool (into the tiers)."""
    engine.submit(tokens, 1)
    engine.run_until_idle()
    for k in range(4):
        engine.submit(prompt(700 + k, 40), 1)
        engine.run_until_idle()


def _rerun(engine: Any, tokens: list[int]) -> Any:
    before = engine.stats()
    req = engine.submit(tokens + prompt(99, 3), 2)
    engine.run_until_idle()
    return engine.result(req), before


def _flip_every_block_file(directory: str, offset: int) -> int:
    flipped = 0
    for root, _, files in os.walk(directory):
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            st = os.stat(path)
            with open(path, "r+b") as f:
                size = os.fstat(f.fileno()).st_size
                at = offset if offset >= 0 else size + offset
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x40]))
            # Bit rot keeps size and mtime: the leader's stat check cannot see it, the read's must
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            flipped += 1
    return flipped


@pytest.mark.parametrize("offset", [3, 20, 48 + 5, -1], ids=["magic", "key", "payload",
                                                           "last-byte"])
@pytest.mark.parametrize("load_errors", [True, False])
def test_a_flipped_byte_in_a_disk_file_is_recomputed(make_engine, tmp_path, offset,
                                                      load_errors, expect_errors) -> None:
    disk = tmp_path / "disk"
    env = tiers(disk=64, DYN_KVBM_DISK_CACHE_DIR=str(disk))
    engine = make_engine(num_gpu_blocks=16, env=env, load_errors=load_errors)
    a = prompt(7, 17)
    _through_tier(engine, a)
    assert _flip_every_block_file(str(disk), offset) > 0
    result, before = _rerun(engine, a)
    stats = engine.stats()
    worker = engine.workers[0].stats()
    assert result.disk_hit_tokens == 16  # the leader promised 4 disk blocks
    assert worker["corrupt_blocks"] >= 1 and engine.leader.stats()["loads_failed"] >= 1
    if load_errors:
        assert worker["load_error_blocks"] >= 1
        assert stats.recomputed_requests - before.recomputed_requests == 1
        assert result.kv_mismatches == 0 and stats.kv_mismatches == 0
    else:  # older TensorRT-LLM: counted, and computed on the unfilled blocks
        assert stats.recomputed_requests == 0
        assert result.kv_mismatches > 0


def test_rank_1_in_its_own_process_reports_its_load_errors(make_engine, tmp_path) -> None:
    """TP 2, rank 1 a child process: its failed blocks come back with its get_finished reply,
    and the manager unites them with rank 0's before the request can compute."""
    disk = tmp_path / "disk"
    env = tiers(disk=64, DYN_KVBM_DISK_CACHE_DIR=str(disk))
    engine = make_engine(num_gpu_blocks=16, env=env, tp_size=2, processes=True)
    a = prompt(17, 17)
    _through_tier(engine, a)
    assert _flip_every_block_file(str(disk / "rank1"), 48 + 9) > 0  # rank 1's files only
    result, before = _rerun(engine, a)
    assert result.disk_hit_tokens == 16
    assert engine.ranks[1].stats()["load_error_blocks"] >= 1
    assert engine.workers[0].stats()["load_error_blocks"] == 0
    assert engine.stats().recomputed_requests - before.recomputed_requests == 1
    assert result.kv_mismatches == 0


def test_a_failed_host_copy_batch_is_recomputed(make_engine, monkeypatch) -> None:
    """A host→device batch that ends failed (what ``CopyEngine.fail_overdue`` does to one past
    ``OP_TIMEOUT_S``, or a copy that cannot be issued) reports its blocks."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(host=64))
    a = prompt(8, 17)
    _through_tier(engine, a)
    issue = CopyEngine.issue

    def failing_onboard(self, copies, wait_event, done, direction):  # noqa: ANN001
        if direction == "onboard":
            return done(False)  # the batch timed out
        return issue(self, copies, wait_event, done, direction)

    monkeypatch.setattr(CopyEngine, "issue", failing_onboard)
    result, before = _rerun(engine, a)
    assert result.host_hit_tokens == 16
    assert engine.workers[0].stats()["load_error_blocks"] == 4
    assert engine.stats().recomputed_requests - before.recomputed_requests == 1
    assert result.kv_mismatches == 0


def test_a_disk_copy_to_the_device_that_fails_is_recomputed(make_engine, monkeypatch,
                                                            tmp_path) -> None:
    """The disk thread's staging→device copy timing out (``DiskStaging.to_device`` False)."""
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64))
    a = prompt(9, 13)
    _through_tier(engine, a)
    monkeypatch.setattr(DiskStaging, "to_device", lambda self, block, pages=(): False)
    result, before = _rerun(engine, a)
    assert result.disk_hit_tokens == 12
    assert engine.stats().recomputed_requests - before.recomputed_requests == 1
    assert result.kv_mismatches == 0


def test_the_worker_reports_each_failed_block_once_and_never_a_fenced_requests() -> None:
    counters = TransferCounters()
    progress = RequestProgress(0, counters, LoadErrorRecord(0, counters))
    progress.expect(ConnectorMetadata(0, TierLayout(8, 0, None), loads=(
        LoadOp(5, (LoadCopy(1, HOST, 0, 11, 7),)),)))
    progress.fence([5], 1.0)  # a cancel: request 5's blocks went back to TensorRT-LLM
    assert progress.load_errors.take() == []
    progress.load_failed(4, [9, 3, -1])
    progress.load_failed(5, [7])  # TRT-LLM freed its blocks: not its any more
    assert progress.load_errors.take() == [3, 9]
    assert progress.load_errors.take() == []
    assert counters.snapshot()["load_error_blocks"] == 2


def test_a_recomputed_request_in_chunks_never_saves_an_unfilled_block(make_engine,
                                                                      tmp_path) -> None:
    """The leader forgets the tokens a failed load promised (its first report's position is the
    truth), so a request recomputing in 4-token chunks never offloads a block before its chunk
    refilled it: a third run loads what the second one saved, and its KV is exact."""
    disk = tmp_path / "disk"
    env = tiers(disk=64, DYN_KVBM_DISK_CACHE_DIR=str(disk))
    engine = make_engine(num_gpu_blocks=16, env=env, max_num_tokens=4)
    a = prompt(21, 17)
    _through_tier(engine, a)
    _flip_every_block_file(str(disk), 48 + 5)
    second, before = _rerun(engine, a)
    assert second.disk_hit_tokens == 16 and second.kv_mismatches == 0
    assert engine.stats().recomputed_requests - before.recomputed_requests == 1
    _through_tier(engine, prompt(22, 5))
    third, _ = _rerun(engine, a)
    assert third.disk_hit_tokens == 16 and third.kv_mismatches == 0
    assert engine.stats().kv_mismatches == 0


@pytest.mark.parametrize("chunk", [4, 256])
def test_without_load_errors_what_was_computed_on_an_unfilled_block_is_never_offloaded(
        make_engine, tmp_path, chunk) -> None:
    """Older TensorRT-LLM: the request computes on the block its failed load left unfilled
    (counted; unavoidable there), but the leader offloads nothing of it from that block on, so
    no later request loads that wrong KV from a well-formed tier copy."""
    disk = tmp_path / "disk"
    env = tiers(disk=64, DYN_KVBM_DISK_CACHE_DIR=str(disk))
    engine = make_engine(num_gpu_blocks=16, env=env, max_num_tokens=chunk, load_errors=False)
    a = prompt(23, 17)
    _through_tier(engine, a)
    _flip_every_block_file(str(disk), 48 + 5)
    second, _ = _rerun(engine, a)
    assert second.disk_hit_tokens == 16 and second.kv_mismatches > 0
    _through_tier(engine, prompt(24, 5))
    third, _ = _rerun(engine, a)
    assert third.kv_mismatches == 0
