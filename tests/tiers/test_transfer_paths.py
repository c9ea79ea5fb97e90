"""The worker's copy machinery below the connector API: the parallel CPU copier and the CUDA
completion bookkeeping (exercised with stand-in events, so it runs without a GPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.testing.fake_trtllm import KvCacheConfig, LlmArgs, ParallelConfig
from kvbm_plugin.tiers.copies import HostCopier, split_spans


@given(st.lists(st.integers(min_value=0, max_value=5000), max_size=12),
       st.integers(min_value=1, max_value=9))
def test_split_spans_covers_every_byte_once_in_order_and_balanced(sizes, shares) -> None:
    spans, addr = [], 0
    for size in sizes:
        spans.append((1_000_000 + addr, addr, size))
        addr += size
    parts = split_spans(spans, shares)
    flat = [span for part in parts for span in part]
    # Every byte copied once, in order, with dst/src offsets kept together.
    covered = 0
    for dst, src, n in flat:
        assert n > 0 and src == covered and dst == 1_000_000 + src
        covered += n
    assert covered == sum(sizes)
    assert len(parts) <= shares
    if parts:
        per_share = -(-sum(sizes) // shares)
        assert all(sum(n for *_, n in part) <= per_share for part in parts)


def test_host_copier_copies_scattered_blocks_exactly_with_helpers() -> None:
    blocks, elems = 24, 64 * 1024  # 24 x 128 KiB of bf16: above the parallel threshold
    src = torch.randn((blocks, elems), dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    order = list(reversed(range(blocks)))
    copier = HostCopier(3)
    try:
        copier.copy([(dst[order[i]], src[i]) for i in range(blocks)])
        assert copier._helpers is not None  # the batch was split across threads
        assert torch.equal(dst[torch.tensor(order)], src)
    finally:
        copier.close()


def test_host_copier_falls_back_to_torch_for_non_plain_pairs() -> None:
    src = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    strided_dst = torch.zeros(8, 8).t()  # not contiguous
    half_dst = torch.zeros(8, 8, dtype=torch.float16)  # other dtype: a conversion, not bytes
    small_dst = torch.zeros(8)
    copier = HostCopier(2)
    try:
        copier.copy([(strided_dst, src), (half_dst, src), (small_dst, src[3])])
        assert torch.equal(strided_dst, src)
        assert torch.equal(half_dst, src.half())
        assert torch.equal(small_dst, src[3])
        # Overlapping ranges (4 MiB, above the parallel threshold) are never cut into
        # concurrent shares: torch refuses them, so the batch fails instead of tearing.
        big = torch.arange(1 << 20, dtype=torch.float32)
        with pytest.raises(RuntimeError, match="single memory location"):
            copier.copy([(big[1:], big[:-1])])
        assert copier._helpers is None  # nothing qualified for the parallel path
    finally:
        copier.close()


class _StandInEvent:
    """What the completion thread needs of a CUDA event: a blocking ``synchronize``."""

    def __init__(self) -> None:
        self._fired = threading.Event()

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        if not self._fired.wait(30):
            raise RuntimeError("stand-in event never fired")


def _wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.001)


@pytest.fixture()
def bare_worker():
    worker = KvbmConnectorWorker(LlmArgs(KvCacheConfig(4), ParallelConfig(0, 1),
                                         kvbm_plugin_env={}, kvbm_plugin_group="completion"))
    thread = threading.Thread(target=worker._completion_loop, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker._completions.put(None)
        thread.join(10)
        assert not thread.is_alive()


def _register(worker, copy_id: int, deadline: float, calls: list) -> _StandInEvent:
    event = _StandInEvent()
    with worker._lock:
        worker._copies[copy_id] = (deadline, lambda ok: calls.append((copy_id, ok)))
    worker._completions.put((copy_id, event))
    return event


def test_a_copy_is_finished_once_when_its_event_fires(bare_worker) -> None:
    calls: list = []
    first = _register(bare_worker, 1, time.monotonic() + 60, calls)
    second = _register(bare_worker, 2, time.monotonic() + 60, calls)
    second.fire()  # the stream completes in issue order: nothing finishes before the first
    first.fire()
    _wait_until(lambda: len(calls) == 2)
    assert calls == [(1, True), (2, True)]
    assert bare_worker._copies == {}


def test_an_overdue_copy_fails_once_and_its_late_completion_is_ignored(bare_worker,
                                                                       expect_errors) -> None:
    calls: list = []
    hung = _register(bare_worker, 7, time.monotonic() - 1, calls)  # already past its deadline
    bare_worker._fail_overdue_copies(time.monotonic())
    assert calls == [(7, False)]
    hung.fire()  # the GPU recovers after all
    after = _register(bare_worker, 8, time.monotonic() + 60, calls)
    after.fire()
    _wait_until(lambda: len(calls) == 2)
    assert calls == [(7, False), (8, True)]
    assert expect_errors.wait_for("did not complete in time")
