"""Copies from a host staging buffer into the device pool that a worker thread waits for.

The disk thread (:class:`DiskStaging`) and the shared tier's reader thread
(worker/shared_io.py) each read into host staging, copy it into device blocks and must know
the copy finished before the next read reuses the buffer. :func:`wait_for_copy` is that wait:
it polls the copy's CUDA event (``query()`` does not block, so the thread keeps its own
deadline, which ``event.synchronize()`` could not) until it fires or ``timeout_s`` passes.
On a timeout the copy may still run some day, so the caller gives later reads a buffer of
their own (torch's pinned allocator keeps the old one until its pending copy is done).
On CPU the copy is synchronous and nothing waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvbm_plugin.worker.layer_group_copies import GroupPages

OP_TIMEOUT_S = 60.0  # a copy not completed by then is failed (GPU hang, etc.)
POLL_S = 0.0002  # between two queries of the event: a fraction of one block's copy


class CopyEvent(Protocol):
    """What :func:`wait_for_copy` needs of an event: ``torch.cuda.Event`` or a stand-in."""

    def query(self) -> bool: ...


def wait_for_copy(event: CopyEvent, timeout_s: float, *,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], Any] = time.sleep) -> bool:
    """True once ``event`` fired; False if ``timeout_s`` passed first (the caller's thread
    waits: never the executor thread)."""
    deadline = clock() + timeout_s
    while not event.query():
        if clock() > deadline:
            return False
        sleep(POLL_S)
    return True


class DiskStaging:
    """The disk thread's staging block and its copy into the device pool.

    ``buffer`` is where a disk read lands (pinned on CUDA, a tier slot's shape);
    :meth:`to_device` copies it into one device block, or, with several layer groups, into every
    group's live page of that block, and returns once the copy is done. On CUDA the copy runs
    on a stream of its own; the disk thread is its only caller.
    """

    def __init__(self, pool: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype,
                 groups: GroupPages | None, side_stream: Any) -> None:
        import torch

        self._pool = pool
        self._groups = groups
        self._cuda = pool.is_cuda
        self._side_stream = side_stream  # the copy engine's: a page's earlier save waits there
        self.stream: Any = torch.cuda.Stream(device=pool.device) if self._cuda else None
        self.buffer: torch.Tensor = torch.empty(block_shape, dtype=dtype, pin_memory=self._cuda)
        self.timeout_s = OP_TIMEOUT_S

    def to_device(self, device_block: int, pages: Sequence[int] = ()) -> bool:
        """Copy ``buffer`` into ``device_block`` (several groups: into ``pages``, every
        group's page of it) and wait; False when the copy did not finish within ``timeout_s``
        (``buffer`` is then a new one).

        With several groups the disk stream first waits for what the side stream holds now:
        a sliding page can come back to another request (this load) while an earlier
        iteration's save of it still waits there, behind the forward or other copies; that
        save was issued before this load reached the disk thread (job order), so it reads
        the page first."""
        staging, groups = self.buffer, self._groups
        if not self._cuda:
            if groups is None:
                self._pool[device_block].copy_(staging)
            else:
                groups.scatter(staging, pages or (device_block,))
            return True
        import torch

        with torch.cuda.stream(self.stream):
            if groups is None:
                self._pool[device_block].copy_(staging, non_blocking=True)
            else:
                self.stream.wait_stream(self._side_stream)
                groups.scatter(staging, pages or (device_block,), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        if wait_for_copy(event, self.timeout_s):
            return True
        self.buffer = torch.empty(staging.shape, dtype=staging.dtype, pin_memory=True)
        return False
