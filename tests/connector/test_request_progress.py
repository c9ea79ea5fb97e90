"""The worker's per-request bookkeeping on its own (worker/request_progress.py): what
``get_finished`` returns and when, and what a fence lets write."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from kvbm_plugin.connector.meta import HOST, ConnectorMetadata, LoadCopy, LoadOp, SaveOp, TierLayout
from kvbm_plugin.worker import request_progress
from kvbm_plugin.worker.load_errors import LoadErrorRecord
from kvbm_plugin.worker.request_progress import RequestProgress
from kvbm_plugin.worker.transfer_counters import TransferCounters

LAYOUT = TierLayout(8, 0, None)


def _progress() -> RequestProgress:
    counters = TransferCounters()
    return RequestProgress(0, counters, LoadErrorRecord(0, counters))


def _load(req_id: int, n: int) -> LoadOp:
    return LoadOp(req_id, tuple(LoadCopy(req_id * 10 + i, HOST, i, 0, i) for i in range(n)))


def test_an_id_is_returned_once_after_it_was_passed_in_and_its_ops_ended() -> None:
    progress = _progress()
    progress.expect(ConnectorMetadata(0, LAYOUT, saves=(SaveOp(1, 7, 0, HOST, 0, 1),
                                                        SaveOp(2, 7, 1, HOST, 1, 2)),
                                      loads=(_load(8, 2), LoadOp(9, ()))))
    assert progress.finished([7], [8, 9]) == ([], [9])  # 9 had nothing to load
    progress.save_ended([7])
    progress.load_ended([8, 8])
    assert progress.finished([], []) == ([], [8])  # 7 still has one save in flight
    progress.save_ended([7])
    assert progress.finished([], []) == ([7], [])
    assert progress.finished([], []) == ([], [])  # each once
    assert not progress.busy()


def test_a_loading_id_no_load_op_named_comes_back_after_the_orphan_timeout(
        monkeypatch: pytest.MonkeyPatch, expect_errors) -> None:  # noqa: ANN001
    now = [1000.0]
    monkeypatch.setattr(request_progress, "time",
                        SimpleNamespace(monotonic=lambda: now[0], sleep=time.sleep))
    progress = _progress()
    assert progress.finished([], [5]) == ([], [])
    now[0] += request_progress.LOAD_ORPHAN_TIMEOUT_S - 1
    assert progress.finished([], []) == ([], [])
    now[0] += 2
    assert progress.finished([], []) == ([], [5])  # the ranks do not hang on it
    assert expect_errors.wait_for("no load op arrived")


def test_a_fence_waits_for_the_copies_writing_and_stops_the_queued_ones() -> None:
    progress = _progress()
    progress.expect(ConnectorMetadata(0, LAYOUT, loads=(_load(3, 2),)))
    assert progress.begin_writing(3)  # one copy writes a device block of request 3 now
    fenced = threading.Event()
    fence = threading.Thread(target=lambda: (progress.fence([3], 10.0), fenced.set()))
    fence.start()
    deadline = time.monotonic() + 10
    while not progress.is_fenced(3):
        assert time.monotonic() < deadline, "the fence never marked the request"
        time.sleep(0.001)
    assert not fenced.wait(0.1)  # it waits for the copy still writing
    progress.written([3])  # the copy ends
    assert fenced.wait(10)
    fence.join()
    assert progress.is_fenced(3) and not progress.begin_writing(3)  # the queued copy never writes
    progress.load_failed(3, [1])  # its blocks are no longer its: no load error
    assert progress.load_errors.take() == []
    progress.load_ended([3, 3])
    assert not progress.is_fenced(3)  # nothing of its is left to write
