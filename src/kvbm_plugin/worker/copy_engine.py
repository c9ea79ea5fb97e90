"""A worker's batched block copies between the device pool and host memory, and their
completion.

The transfer thread hands :meth:`CopyEngine.issue` a batch of (dst, src) tensor pairs and a
``done(ok)`` callback. On CPU the batch is copied right there (``tiers.copies.HostCopier``,
several threads) and ``done`` runs before ``issue`` returns. On CUDA the copies are enqueued on
the engine's side stream behind the forward pass's event, an event is recorded after them and
the engine's completion thread sleeps on it (blocking sync, no polling) and calls ``done(True)``
the moment it fires; the transfer thread calls :meth:`fail_overdue` between jobs, which fails a
batch still unfinished after ``timeout_s`` (a GPU hang). Whoever pops a batch's entry first
(completion or timeout) finishes it, exactly once. Never used from the executor thread.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbm_plugin.connector.metrics import Metrics
from kvbm_plugin.tiers.copies import HostCopier
from kvbm_plugin.wire.events import MEDIUM_CPU
from kvbm_plugin.worker.device_copy import OP_TIMEOUT_S

logger = logging.getLogger("kvbm_plugin.connector_worker")

COPY_BATCH_BYTES = 64 << 20  # host copies complete and report in batches of about this size


class CopyEngine:
    """One rank's device ↔ host copy batches (see the module docstring)."""

    def __init__(self, device: Any, cuda: bool, block_bytes: int, rank: int,
                 metrics: Metrics) -> None:
        import torch

        self._cuda = cuda
        self._rank = rank
        self._metrics = metrics
        self.timeout_s = OP_TIMEOUT_S
        self.side_stream: Any = torch.cuda.Stream(device=device) if cuda else None
        self._host_copier = None if cuda else HostCopier(torch.get_num_threads())
        # Each ~COPY_BATCH_BYTES batch completes and is reported on its own on CUDA: the
        # leader hears of early blocks while later ones still copy. (On CPU the copy is
        # synchronous on the transfer thread, so batches would only add hand-offs: 0, one.)
        self.batch_blocks = max(1, COPY_BATCH_BYTES // max(1, block_bytes)) if cuda else 0
        self._lock = threading.Lock()
        # Batches in flight, in issue order: id -> (deadline, done). Under _lock.
        self._pending: dict[int, tuple[float, Callable[[bool], None]]] = {}
        self._completions: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        if cuda:
            self._thread = threading.Thread(target=self._completion_loop,
                                            name=f"kvbm-completion-r{rank}", daemon=True)
            self._thread.start()

    def issue(self, copies: Sequence[tuple[Any, Any]], wait_event: Any,
              done: Callable[[bool], None], direction: str) -> None:
        """Copy each (dst, src) pair (transfer thread); on CUDA behind ``wait_event``. The
        batch's latency (issue to completion, so on CUDA it includes waiting for the forward
        pass) and bytes go to the ``kvbm_transfer_*`` histograms."""
        started = time.perf_counter()
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        finish = done

        def observed(ok: bool) -> None:
            finish(ok)
            if ok:
                self._metrics.observe_transfer(direction, MEDIUM_CPU,
                                               time.perf_counter() - started, nbytes)

        import torch

        try:
            if not self._cuda:
                assert self._host_copier is not None
                self._host_copier.copy(copies)
            else:
                stream = self.side_stream
                with torch.cuda.stream(stream):
                    if wait_event is not None:
                        stream.wait_event(wait_event)
                    for dst, src in copies:
                        dst.copy_(src, non_blocking=True)
                    # Blocking sync: the completion thread sleeps instead of spinning a core.
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
        except Exception:
            # A copy that cannot be issued (shape mismatch, CUDA error) fails its ops now;
            # otherwise they would never be reported and their request ids never returned.
            logger.exception("rank %d: %s copy of %d blocks failed", self._rank, direction,
                             len(copies))
            observed(False)
            return
        if not self._cuda:
            observed(True)
            return
        self._track(event, observed)

    def _track(self, event: Any, done: Callable[[bool], None]) -> None:
        """Hand a recorded batch to the completion thread, with its deadline."""
        copy_id = next(self._ids)
        with self._lock:
            self._pending[copy_id] = (time.monotonic() + self.timeout_s, done)
        self._completions.put((copy_id, event))

    def has_pending(self) -> bool:
        return bool(self._pending)

    def fail_overdue(self, now: float) -> None:
        """Fail the batches whose deadline is before ``now`` (``math.inf``: all left)."""
        with self._lock:
            overdue = [copy_id for copy_id, (deadline, _) in self._pending.items()
                       if now > deadline]
            finish = [self._pending.pop(copy_id)[1] for copy_id in overdue]
        if finish:
            logger.error("rank %d: %d copy batch(es) did not complete in time (timeout %.1f s); "
                         "failing their ops", self._rank, len(finish), self.timeout_s)
        for done in finish:
            done(False)

    def _completion_loop(self) -> None:
        """CUDA only. Sleeps on each batch's event in issue order (the side stream runs them in
        that order) and finishes the batch when it fires. The wait has no timeout of its own:
        a hung GPU keeps this thread waiting, and ``fail_overdue`` fails the batch instead."""
        while (item := self._completions.get()) is not None:
            copy_id, event = item
            try:
                event.synchronize()
                ok = True
            except Exception:  # a CUDA error: fail the ops rather than lose the thread
                logger.exception("rank %d: waiting for a copy failed; failing its ops",
                                 self._rank)
                ok = False
            with self._lock:
                entry = self._pending.pop(copy_id, None)
            if entry is not None:
                entry[1](ok)

    def finish_issued(self) -> None:
        """The transfer thread stops: the completion thread finishes what was issued, then
        stops too."""
        self._completions.put(None)

    def close(self, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for the completion thread, fail any batch
        still pending, release the host copier. After the transfer thread stopped."""
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                logger.warning("rank %d: %s did not stop in time", self._rank,
                               self._thread.name)
        self.fail_overdue(math.inf)  # only left when a copy outlived the timeout
        if self._host_copier is not None:
            self._host_copier.close()
