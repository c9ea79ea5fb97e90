"""A worker thread's job queue that knows whether a taken job still runs.

Used by the transfer thread and the disk thread (``worker/transfer_thread.py``,
``worker/disk_io.py``): the producer calls :meth:`JobQueue.put`, the thread :meth:`get` and,
after the job, :meth:`done`; :meth:`idle` (any thread: tests, benchmarks, the router probe) is
true only when no job is queued or running. "The queue is empty" was true while a taken job
still ran, and a demotion belongs to no request, so no request counter saw it either.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class JobQueue:
    """Jobs queued or running, counted (module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._unfinished = 0
        self._lock = threading.Lock()

    def put(self, job: tuple[Any, ...]) -> None:
        with self._lock:
            self._unfinished += 1
        self._jobs.put(job)

    def put_stop(self) -> None:
        """The thread's stop marker (not counted: nothing to finish)."""
        self._jobs.put(("stop",))

    def get(self, timeout: float) -> tuple[Any, ...]:
        """The next job (raises ``queue.Empty`` after ``timeout`` s)."""
        return self._jobs.get(timeout=timeout)

    def done(self) -> None:
        """A job taken by :meth:`get` is finished (the worker thread)."""
        with self._lock:
            self._unfinished -= 1

    def idle(self) -> bool:
        return self._unfinished == 0
