"""Parallel copies between CPU tensors, for the worker's transfer thread when the pool is on CPU.

``torch._foreach_copy_`` of a batch of scattered 4 MiB blocks opens one OpenMP region per block
and reaches ~0.8x of one bulk copy of the same bytes; splitting the batch's bytes into one
contiguous share per thread and copying each share with ``memmove`` (``ctypes`` releases the GIL
for the call) reaches the bulk copy's bandwidth. Only plain byte copies qualify (both tensors on
CPU, contiguous, same dtype and size); anything else is copied by torch.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MAX_THREADS = 8  # memory bandwidth is saturated well before this many copy threads
MIN_PARALLEL_BYTES = 1 << 20  # below this, one thread copies (handing off costs more)

_memmove = ctypes.memmove

Span = tuple[int, int, int]  # (dst address, src address, bytes)


def _plain_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    if not (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous()):
        return False
    # Overlapping ranges cut into shares copied concurrently could read bytes already
    # overwritten: leave those to torch.
    size = dst.numel() * dst.element_size()
    return dst.data_ptr() + size <= src.data_ptr() or src.data_ptr() + size <= dst.data_ptr()


def split_spans(spans: Sequence[Span], shares: int) -> list[list[Span]]:
    """Cut ``spans`` into ``shares`` lists of (nearly) equal bytes, in order; a span may be
    split between two shares. Empty shares are dropped."""
    total = sum(n for _, _, n in spans)
    per_share = -(-total // shares) if shares > 0 else total
    out: list[list[Span]] = [[]]
    room = per_share
    for dst, src, n in spans:
        while n > 0:
            if room == 0:
                out.append([])
                room = per_share
            take = min(n, room)
            out[-1].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
    return [share for share in out if share]


def _copy_spans(spans: Sequence[Span]) -> None:
    for dst, src, n in spans:
        _memmove(dst, src, n)


class HostCopier:
    """Copies (dst, src) CPU tensor pairs using ``threads`` threads: the caller's and
    ``threads - 1`` helpers, started on first use. One instance per worker; used from its
    transfer thread only."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, min(threads, MAX_THREADS))
        self._helpers: ThreadPoolExecutor | None = None

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy every pair; returns when all bytes are in place (or raises)."""
        spans: list[Span] = []
        for dst, src in pairs:
            if _plain_bytes(dst, src):
                spans.append((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
            else:
                dst.copy_(src)
        total = sum(n for _, _, n in spans)
        if self.threads == 1 or total < MIN_PARALLEL_BYTES:
            _copy_spans(spans)
            return
        own, *rest = split_spans(spans, self.threads)
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvbm-copy")
        futures = [self._helpers.submit(_copy_spans, share) for share in rest]
        try:
            _copy_spans(own)
        finally:
            wait(futures)  # the tensors must outlive every helper's memmove, even if ours raised
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
            self._helpers = None
