"""The worker's copy machinery below the connector API: the parallel CPU copier and the CUDA
completion bookkeeping (exercised with stand-in events, so it runs without a GPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvbm_plugin.connector.metrics import get_metrics
from kvbm_plugin.tiers.copies import HostCopier, split_spans
from kvbm_plugin.worker.copy_engine import CopyEngine
from kvbm_plugin.worker.device_copy import POLL_S, wait_for_copy


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
def bare_engine():
    """A CPU copy engine whose completion thread (CUDA's) is started by hand, fed stand-ins."""
    engine = CopyEngine(torch.device("cpu"), False, 4096, 0, get_metrics())
    thread = threading.Thread(target=engine._completion_loop, daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        engine.finish_issued()
        thread.join(10)
        assert not thread.is_alive()
        engine.close(time.monotonic())


def _register(engine, copy_id: int, deadline: float, calls: list) -> _StandInEvent:
    event = _StandInEvent()
    with engine._lock:
        engine._pending[copy_id] = (deadline, lambda ok: calls.append((copy_id, ok)))
    engine._completions.put((copy_id, event))
    return event


def test_a_copy_is_finished_once_when_its_event_fires(bare_engine) -> None:
    calls: list = []
    first = _register(bare_engine, 1, time.monotonic() + 60, calls)
    second = _register(bare_engine, 2, time.monotonic() + 60, calls)
    second.fire()  # the stream completes in issue order: nothing finishes before the first
    first.fire()
    _wait_until(lambda: len(calls) == 2)
    assert calls == [(1, True), (2, True)]
    assert bare_engine._pending == {}


def test_an_overdue_copy_fails_once_and_its_late_completion_is_ignored(bare_engine,
                                                                       expect_errors) -> None:
    calls: list = []
    hung = _register(bare_engine, 7, time.monotonic() - 1, calls)  # already past its deadline
    bare_engine.fail_overdue(time.monotonic())
    assert calls == [(7, False)]
    hung.fire()  # the GPU recovers after all
    after = _register(bare_engine, 8, time.monotonic() + 60, calls)
    after.fire()
    _wait_until(lambda: len(calls) == 2)
    assert calls == [(7, False), (8, True)]
    assert expect_errors.wait_for("did not complete in time")


class _PolledEvent:
    """What ``wait_for_copy`` needs of a CUDA event: ``query()``, true from its ``fires_at``-th
    call on (None: never, a hung copy)."""

    def __init__(self, fires_at: int | None) -> None:
        self.fires_at = fires_at
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.fires_at is not None and self.queries >= self.fires_at


class _Clock:
    """A monotonic clock that moves only when the waiter sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_waiting_for_a_device_copy_returns_when_its_event_fires() -> None:
    """The disk thread's and the shared tier's reader's wait (one helper): polls until the
    copy's event fires, within the deadline."""
    clock = _Clock()
    event = _PolledEvent(fires_at=4)
    assert wait_for_copy(event, 1.0, clock=clock, sleep=clock.sleep) is True
    assert event.queries == 4 and len(clock.slept) == 3  # polled, never past the event


def test_waiting_for_a_hung_device_copy_gives_up_at_its_deadline() -> None:
    """A copy that never completes: False once ``timeout_s`` passed (then the caller gives
    later reads a staging buffer of their own), not an endless wait."""
    clock = _Clock()
    event = _PolledEvent(fires_at=None)
    assert wait_for_copy(event, 0.01, clock=clock, sleep=clock.sleep) is False
    assert 0.01 < clock.now - 100.0 <= 0.01 + 2 * POLL_S  # gave up just past the deadline
    assert event.queries == len(clock.slept) + 1
    # An event that has fired needs no time at all, even with no time left.
    assert wait_for_copy(_PolledEvent(fires_at=1), -1.0, clock=clock, sleep=clock.sleep)
