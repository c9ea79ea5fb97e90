"""One rank's worker counters (bytes and blocks moved, failures), shared by its threads.

Each of the worker's collaborators (the transfer thread, the disk thread, the copy engine, the
op reporter, the load-error record) is handed this object and adds to it from its own thread;
``KvbmConnectorWorker.stats()`` reads a snapshot (any thread). A name must be declared before
it is added to: a misspelt counter fails where it is added, not silently in a dashboard.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

WORKER_COUNTERS = ("bytes_offloaded", "bytes_onboarded", "bytes_demoted", "blocks_offloaded",
                   "blocks_onboarded", "blocks_demoted", "ops_failed", "corrupt_blocks",
                   "copies_issued", "jobs_failed", "loads_fenced", "load_error_blocks")


class TransferCounters:
    """Named integer counters behind one lock (a leaf: no other lock is taken under it)."""

    def __init__(self, names: Iterable[str] = WORKER_COUNTERS) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(names, 0)

    def declare(self, name: str) -> None:
        """Add counter ``name`` (at 0) if it is not there yet (bring-up, main thread)."""
        with self._lock:
            self._values.setdefault(name, 0)

    def add(self, **deltas: int) -> None:
        """Add each delta (any thread); KeyError for an undeclared name."""
        with self._lock:
            values = self._values
            for name, delta in deltas.items():
                values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
