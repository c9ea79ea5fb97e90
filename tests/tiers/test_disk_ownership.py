"""A disk cache directory belongs to one engine, and a block file is read only by the model,
dtype, layout and rank that wrote it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.tiers.base import TierSpec
from kvbm_plugin.tiers.disk import DiskTier, claim_directory

SHAPE = (2, 2, 16)

_HOLDER = """
import sys
from kvbm_plugin.tiers.disk import claim_directory
claim = claim_directory(sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
"""


def _leader(directory: str, group: str):
    from kvbm_plugin.connector_leader import KvbmConnectorLeader
    from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig

    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8", "DYN_KVBM_DISK_CACHE_DIR": directory}
    return KvbmConnectorLeader(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),
                                       kvbm_plugin_env=env, kvbm_plugin_group=group))


@pytest.fixture
def holder(tmp_path):
    """Another process that holds ``tmp_path/'disk'``; killed (SIGKILL) by the test or at
    teardown."""
    directory = str(tmp_path / "disk")
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, directory], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield directory, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_second_engine_on_one_disk_directory_is_refused_until_the_owner_dies(holder) -> None:
    directory, proc = holder
    with pytest.raises(ConfigError) as refused:
        _leader(directory, "disk-owner-a")
    message = str(refused.value)
    assert "\n" not in message
    assert f"DYN_KVBM_DISK_CACHE_DIR={directory!r}" in message and f"pid {proc.pid}" in message
    proc.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
    proc.wait(timeout=30)
    leader = _leader(directory, "disk-owner-b")
    try:
        with pytest.raises(ConfigError, match="in use by another engine"):
            _leader(directory, "disk-owner-c")  # a second leader in this process, too
    finally:
        leader.shutdown()
    _leader(directory, "disk-owner-d").shutdown()  # shutdown released the claim


def test_attention_dp_leaders_claim_separately(tmp_path) -> None:
    first = claim_directory(str(tmp_path), 0)
    second = claim_directory(str(tmp_path), 1)
    with pytest.raises(ConfigError):
        claim_directory(str(tmp_path), 0)
    first.release()
    first.release()  # idempotent
    claim_directory(str(tmp_path), 0).release()
    second.release()


@pytest.mark.parametrize("other", [
    {"dtype": torch.bfloat16},  # same bytes per block, different numbers
    {"block_shape": (2, 4, 8)},  # same element count, another layout
    {"identity": "model=other;tokens_per_block=16;tp=1"},
    {"rank": 1},
], ids=["dtype", "layout", "model", "rank"])
def test_a_file_written_by_another_model_or_layout_reads_absent(tmp_path, other) -> None:
    mine = TierSpec(4, SHAPE, torch.float16, 0, directory=str(tmp_path),
                    identity="model=mine;tokens_per_block=16;tp=1")
    fields = {"capacity": 4, "block_shape": SHAPE, "dtype": torch.float16, "rank": 0,
              "directory": str(tmp_path), "identity": mine.identity, **other}
    theirs = DiskTier(TierSpec(**fields))
    block = torch.arange(64, dtype=theirs.spec.dtype).reshape(theirs.spec.block_shape)
    assert theirs.write(1, 77, block).ok
    ours = DiskTier(mine)
    # The other writer's rank directory is ours only when the rank is the same; point our
    # reader at their file either way (a misplaced or shared file).
    path = theirs.path(1)
    out = torch.full(SHAPE, -1.0, dtype=torch.float16)
    ours_path = ours.path(1)
    if path != ours_path:
        os.makedirs(os.path.dirname(ours_path), exist_ok=True)
        shutil.copyfile(path, ours_path)
    assert ours.read(1, 77, out) is False
    assert ours.foreign_reads == 1 and bool((out == -1).all())
    same = DiskTier(TierSpec(**fields))
    back = torch.empty(theirs.spec.block_shape, dtype=theirs.spec.dtype)
    assert same.read(1, 77, back) and torch.equal(back, block)
