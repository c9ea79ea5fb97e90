"""Which of a rank's requests still have transfers in flight, and which may no longer write.

One :class:`RequestProgress` per worker answers TensorRT-LLM's ``get_finished`` (a request's
offloads, or its onboarding, are all terminal) and guards device blocks TensorRT-LLM took back
(a cancel during an async load *fences* the request: its queued loads never write, and the
copies writing now end before the next forward). Who calls it:

* the executor thread: :meth:`expect` (``bind_connector_meta``), :meth:`fence`,
  :meth:`finished` (``get_finished``);
* the transfer, completion and disk threads and the shared tier's reader thread: the
  ``begin_writing`` / ``written`` bracket around a copy into device blocks, ``save_ended`` /
  ``load_ended`` once per terminal op, and :meth:`load_failed` before a failed load's report.

Every method holds one lock for a few dict operations; :meth:`fence` alone waits (for copies
already writing: one block or one batch, at most ``timeout_s``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

from kvbm_plugin.connector.meta import ConnectorMetadata, save_count
from kvbm_plugin.worker.copy_runs import count_down
from kvbm_plugin.worker.load_errors import LoadErrorRecord
from kvbm_plugin.worker.transfer_counters import TransferCounters

logger = logging.getLogger("kvbm_plugin.connector_worker")

LOAD_ORPHAN_TIMEOUT_S = 120.0  # a loading id with no LoadOp seen is returned after this


class RequestProgress:
    """Per-request in-flight counts, fences and the ids TensorRT-LLM waits on (see module)."""

    def __init__(self, rank: int, counters: TransferCounters,
                 load_errors: LoadErrorRecord) -> None:
        self._rank = rank
        self._counters = counters
        self.load_errors = load_errors
        self._lock = threading.Lock()
        self._save_inflight: dict[int, int] = {}  # request -> saves not yet terminal
        self._load_inflight: dict[int, int] = {}  # request -> loads not yet terminal
        self._loads_done: set[int] = set()
        self._fenced: set[int] = set()  # requests whose queued loads must never write
        self._writing: dict[int, int] = {}  # request -> its copies writing device blocks now
        self._save_waiting: set[int] = set()  # ids given as finished_gen_req_ids
        self._load_waiting: dict[int, float] = {}  # ... as started_loading_req_ids, since

    # ------------------------------------------------------------ executor thread

    def expect(self, meta: ConnectorMetadata) -> None:
        """Count this iteration's saves and loads per request (``bind_connector_meta``)."""
        with self._lock:
            for op in meta.saves:  # (a SaveOpRun: its blocks, counted at once)
                self._save_inflight[op.req_id] = self._save_inflight.get(op.req_id, 0) \
                    + save_count(op)
            for load in meta.loads:
                if load.copies:
                    self._load_inflight[load.req_id] = len(load.copies)
                else:
                    self._loads_done.add(load.req_id)

    def fence(self, req_ids: Sequence[int], timeout_s: float) -> None:
        """TensorRT-LLM freed these requests' blocks: their queued loads never write, and the
        copies writing now (a disk block, a host batch) end before this returns, at most
        ``timeout_s`` (then logged). Ids whose loads all ended need nothing."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._fenced.update(r for r in req_ids if self._load_inflight.get(r, 0) > 0)
        while True:
            with self._lock:
                busy = [r for r in req_ids if self._writing.get(r, 0) > 0]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.0002)  # a copy in progress: one block or one batch
        if busy:
            logger.error("rank %d: loads of terminated requests %s still writing after %.0f s",
                         self._rank, busy, timeout_s)
        self._counters.add(loads_fenced=len(req_ids))

    def finished(self, finished_gen_req_ids: Iterable[int],
                 started_loading_req_ids: Iterable[int]) -> tuple[list[int], list[int]]:
        """``get_finished``'s answer: (ids whose offloads are all terminal, ids whose onboarding
        is terminal), each only after it was passed in, and once. A loading id no load op ever
        named comes back after ``LOAD_ORPHAN_TIMEOUT_S`` (logged), so the ranks do not hang."""
        now = time.monotonic()
        with self._lock:
            self._save_waiting.update(finished_gen_req_ids)
            for req_id in started_loading_req_ids:
                self._load_waiting.setdefault(req_id, now)
            saved = [r for r in self._save_waiting if self._save_inflight.get(r, 0) == 0]
            self._save_waiting.difference_update(saved)
            loaded: list[int] = []
            for req_id, since in list(self._load_waiting.items()):
                if req_id in self._loads_done:
                    self._loads_done.discard(req_id)
                    loaded.append(req_id)
                elif (req_id not in self._load_inflight
                      and now - since > LOAD_ORPHAN_TIMEOUT_S):
                    logger.error("rank %d: request %d was marked loading but no load op arrived "
                                 "in %.0f s; returning it so the ranks do not hang",
                                 self._rank, req_id, LOAD_ORPHAN_TIMEOUT_S)
                    loaded.append(req_id)
            for req_id in loaded:
                del self._load_waiting[req_id]
        return sorted(saved), sorted(loaded)

    # ------------------------------------------------------------ transfer threads

    def is_fenced(self, req_id: int) -> bool:
        with self._lock:
            return req_id in self._fenced

    def begin_writing(self, req_id: int, n: int = 1) -> bool:
        """``n`` copies of ``req_id`` start writing device blocks; False (nothing counted) when
        the request is fenced: nothing may write its blocks."""
        with self._lock:
            if req_id in self._fenced:
                return False
            if n > 0:
                self._writing[req_id] = self._writing.get(req_id, 0) + n
            return True

    def written(self, req_ids: Sequence[int]) -> None:
        """Copies of ``req_ids`` (one per entry) stopped writing device blocks."""
        with self._lock:
            count_down(self._writing, req_ids)

    def save_ended(self, req_ids: Sequence[int]) -> None:
        """One save op per entry reached a terminal state."""
        with self._lock:
            count_down(self._save_inflight, req_ids)

    def load_ended(self, req_ids: Sequence[int]) -> None:
        """One load op per entry reached a terminal state (after its load error, if any)."""
        with self._lock:
            drained = count_down(self._load_inflight, req_ids)
            self._loads_done.update(drained)
            self._fenced.difference_update(drained)  # nothing of theirs is left to write

    def load_failed(self, req_id: int, device_blocks: Iterable[int]) -> None:
        """The loads of ``req_id`` into ``device_blocks`` failed: recorded as load errors,
        before their reports. Ignored for a fenced request (its blocks are no longer its);
        the fence check and the record are one step under this lock."""
        blocks = [b for b in device_blocks if b >= 0]
        with self._lock:
            if req_id in self._fenced or not blocks:
                return
            self.load_errors.add(blocks)
        self.load_errors.warn(req_id, len(blocks))

    # ------------------------------------------------------------ any thread

    def inflight(self) -> tuple[int, int]:
        """(save ops, load ops) not yet terminal."""
        with self._lock:
            return sum(self._save_inflight.values()), sum(self._load_inflight.values())

    def busy(self) -> bool:
        with self._lock:
            return bool(self._save_inflight or self._load_inflight)
