"""The worker's CUDA timeout paths, with a real GPU stalled by a spinning kernel.

These need a CUDA device and are skipped without one (CI has none); the same logic is covered
on CPU with stand-in events in test_transfer_paths.py. Run on a GPU machine with
``python -m pytest tests/tiers/test_cuda_paths.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

import kvbm_plugin.connector_worker as worker_mod
from kvbm_plugin.connector.meta import (
    HOST,
    ConnectorMetadata,
    SaveOp,
    TierLayout,
    close_hub,
    open_hub,
)
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SPIN_CYCLES = 4_000_000_000  # about two seconds of a spinning kernel: a stalled GPU


@pytest.fixture()
def cuda_worker():
    group = "cuda-paths"
    hub = open_hub(group)
    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false",
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "8",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8"}
    worker = worker_mod.KvbmConnectorWorker(LlmArgs(KvCacheConfig(32), ParallelConfig(0, 1),
                                                    kvbm_plugin_env=env,
                                                    kvbm_plugin_group=group))
    pool = torch.ones((8, 4, 2, 32 * 128), dtype=torch.bfloat16, device="cuda")
    worker.register_kv_caches(pool)
    try:
        yield worker, hub, pool
    finally:
        torch.cuda.synchronize()
        worker.shutdown()
        close_hub(group)


def test_a_copy_behind_a_stalled_gpu_fails_after_the_timeout_and_its_id_finishes(
        cuda_worker) -> None:
    worker, hub, _ = cuda_worker
    worker._copy_engine.timeout_s = 0.3
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        torch.cuda._sleep(SPIN_CYCLES)
    worker.bind_connector_meta(ConnectorMetadata(
        0, TierLayout(8, 0, None), saves=(SaveOp(1, 77, 0, HOST, 0, 123),)))
    worker.start_load_kv(forward)
    worker.wait_for_save(forward)  # the save's copy waits for the stalled forward pass
    start = time.monotonic()
    finished: list[int] = []
    while not finished and time.monotonic() - start < 5.0:
        finished = worker.get_finished([77], [])[0]
        time.sleep(0.01)
    assert finished == [77]
    assert time.monotonic() - start < 1.5  # the timeout, not the stall, ended it
    assert [(r.op_id, r.ok) for r in hub.drain()] == [(1, False)]
    assert worker._host.keys[0] is None  # failed: not advertised as in the tier
    torch.cuda.synchronize()  # the GPU recovers: the late completion must change nothing
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert hub.drain() == []
        time.sleep(0.02)
    assert worker._copy_engine._pending == {}


def test_a_timed_out_disk_load_keeps_its_staging_buffer(cuda_worker) -> None:
    worker, _, pool = cuda_worker
    disk_staging = worker._disk_io.staging
    disk_staging.timeout_s = -1.0  # every wait times out
    staging = disk_staging.buffer
    staging.fill_(3)
    with torch.cuda.stream(disk_staging.stream):
        torch.cuda._sleep(SPIN_CYCLES // 20)
    assert disk_staging.to_device(5) is False
    assert disk_staging.buffer is not staging and disk_staging.buffer.is_pinned()
    torch.cuda.synchronize()
    assert bool((pool[5] == 3).all())  # the late copy read the buffer it was given, intact
