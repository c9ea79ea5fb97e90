"""The shared tier's object format: a 64-byte header in front of a block's bytes, checked on
every load before the bytes can reach the pool.

Called by each worker's shared-tier I/O (``worker.shared_io``): the writer thread seals a
staging buffer (:func:`seal`) right before its ``put``; the reader thread checks each object it
read into staging (:func:`check`) before anything is copied into the pool. Never the executor
thread. The disk tier's block files carry the same things (``tiers.disk``: magic, layout
digest, key, length, CRC); a shared-tier object is written by other engines too, so everything
is checked, every header byte included.

Header (little-endian, 64 bytes)::

    magic(8) "KVBMSH01" | layout digest(16) | content digest(16) | payload bytes(u32)
    | tail crc32(u32) | word sum(u64) | weighted row sum(u64)

* **layout digest**: blake2b-128 of the key prefix (namespace, model key, TP shard, layer group,
  tokens per block, page bytes, dtype, pool layout): the key's every part but the content
  digest, which follows it. Together they name the key exactly: an object stored under another
  key (a bug, a copy, a deployment sharing the model key with another layout) is refused.
* **checksum**: the payload as little-endian 64-bit words in rows of 64 words (512 bytes):
  ``S = sum(words)`` and ``W = sum((r + 1) * rowsum_r)``, both mod 2**64, plus a CRC-32 of the
  tail that does not fill a row. Any one flipped payload byte changes ``S`` (a byte's change is
  ``d * 256**k``, ``0 < |d| < 256``, never 0 mod 2**64); a swapped or shifted row changes
  ``W``; other wrong bytes (garbage, another block) pass with probability about 2**-64. Not a
  MAC: a writer with store access can still forge a well-formed object with wrong KV (see
  docs/operations.md#security).
* **how it is computed**: by one compiled pass (``_frame_c.c``: eight 64-bit lanes per row,
  which GCC vectorizes at -O3, the GIL released) where it was built, else by torch's integer
  reductions (:func:`_sums_torch`, the reference; ``DYN_KVBM_NATIVE=0`` selects it), plus
  ``zlib.crc32`` of the tail. Both give the same sums (tests/tiers/shared/test_frame_compiled.py),
  so engines on either way read each other's objects. Chosen by measured cost
  (benchmarks/bench_shared_tier.py, "verify" rows: the check's share of onboarding time, target
  <= 10 %; docs/performance.md has the runs): on the 2-core CI host the compiled pass took
  3.2-6.0 % (median 4.1 %), reading the page just read at the memory's speed (18-24 GB/s);
  the torch reductions 6.9-14.7 % (6-9 GB/s, mostly per-call cost: 16 calls of 128 KiB per
  2 MiB page, kept below torch's parallel grain because its intra-op fan-out was 10x slower on
  a busy host); zlib.crc32 17.6-31.8 % (2-4 GB/s). A cheaper formula would still read every
  byte. Overlapping the check with the next read was not needed here (and would contend for
  the same cores); it is the way to hide it behind a store faster than loopback TCP.
  CRC-32 only covers the < 512-byte tail.

A check failure names what was wrong (:class:`Refusal`); the caller counts it, logs it
rate-limited, removes the object if it still holds those bytes, and fails the load.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import struct
import zlib
from types import ModuleType
from typing import TYPE_CHECKING, Final

from kvbm_plugin._util import compiled as _compiled

if TYPE_CHECKING:
    import torch

    from kvbm_plugin.tiers.shared.keys import SharedLayout

MAGIC: Final = b"KVBMSH01"
HEADER: Final = struct.Struct("<8s16s16sIIQQ")
HEADER_BYTES: Final = HEADER.size  # 64: keeps the payload 64-byte aligned in staging
ROW_WORDS: Final = 64
ROW_BYTES: Final = ROW_WORDS * 8
SLICE_WORDS: Final = 16384  # 128 KiB per reduction call (torch's grain size is 32768)
_MASK: Final = (1 << 64) - 1

assert HEADER_BYTES == 64


def layout_digest(layout: SharedLayout) -> bytes:
    """16 bytes naming the key prefix of ``layout`` (everything but the content digest)."""
    return hashlib.blake2b(layout.prefix().encode("utf-8"), digest_size=16,
                           person=b"kvbm-shlay").digest()


class Refusal(Exception):
    """Why an object read from the shared tier is not loaded (one short phrase)."""


class _Weights:
    """The row weights 1..R of a page size, made once per size (reader/writer threads)."""

    def __init__(self) -> None:
        self._by_rows: dict[int, torch.Tensor] = {}

    def get(self, rows: int) -> torch.Tensor:
        w = self._by_rows.get(rows)
        if w is None:
            import torch

            w = torch.arange(1, rows + 1, dtype=torch.int64)
            self._by_rows[rows] = w  # benign race: two threads build equal tensors
        return w


_WEIGHTS = _Weights()


@functools.cache
def _default_loops() -> ModuleType | None:
    """The compiled sums when built and not switched off by ``DYN_KVBM_NATIVE`` (read once,
    on the first checksum; start-up has refused a bad value already)."""
    return _compiled.choose("shared_frame", None, "frame.checksum")


def _sums_torch(words: torch.Tensor) -> tuple[int, int]:
    """(S, W) of ``words`` (int64, a whole number of rows) by torch's integer reductions,
    which wrap mod 2**64: the reference the compiled pass is compared with, and the fallback."""
    import torch

    rows = torch.empty(words.numel() // ROW_WORDS, dtype=torch.int64)
    # In slices below torch's parallel grain: one thread's work (the caller's), never a
    # fan-out to the intra-op pool, which on a busy host cost 10x more than it saved.
    for start in range(0, words.numel(), SLICE_WORDS):
        torch.sum(words[start:start + SLICE_WORDS].view(-1, ROW_WORDS), 1,
                  out=rows[start // ROW_WORDS:(start + SLICE_WORDS) // ROW_WORDS])
    s = int(rows.sum()) & _MASK
    w = int((rows * _WEIGHTS.get(rows.numel())).sum()) & _MASK
    return s, w


def checksum(payload: torch.Tensor, native: bool | None = None) -> tuple[int, int, int]:
    """(word sum, weighted row sum, tail crc32) of ``payload``, a contiguous CPU uint8 tensor.
    ``native``: None = the compiled pass where built and switched on, False = the torch
    reference, True = the compiled pass or ValueError (the tests compare the two)."""
    if payload.element_size() != 1 or not payload.is_cpu or not payload.is_contiguous():
        # The compiled pass reads the memory at data_ptr(): anything else would be misread.
        raise ValueError(f"frame.checksum: payload must be a contiguous CPU byte tensor, got "
                         f"dtype={payload.dtype}, device={payload.device}, "
                         f"contiguous={payload.is_contiguous()}")
    loops = _default_loops() if native is None else \
        _compiled.choose("shared_frame", native, "frame.checksum")
    n = payload.numel()
    whole = n - n % ROW_BYTES
    s = w = 0
    if whole and loops is not None:
        # A view of the tensor's memory through the buffer protocol: ``payload`` (held by
        # the caller) keeps it alive while the GIL is released.
        s, w = loops.sums((ctypes.c_char * whole).from_address(payload.data_ptr()))
    elif whole:
        import torch

        s, w = _sums_torch(payload[:whole].view(torch.int64))
    tail = 0
    if whole < n:
        address = payload.data_ptr() + whole
        tail = zlib.crc32(ctypes.string_at(address, n - whole))
    return s, w, tail


def seal(buf: torch.Tensor, layout: SharedLayout, digest: bytes, lay: bytes) -> None:
    """Write the header of the block in ``buf`` (uint8, HEADER_BYTES + page, payload already
    copied in) for the key ``layout.key(digest)``; ``lay`` is ``layout_digest(layout)``."""
    payload = buf[HEADER_BYTES:]
    s, w, tail = checksum(payload)
    head = HEADER.pack(MAGIC, lay, digest, payload.numel(), tail, s, w)
    ctypes.memmove(buf.data_ptr(), head, HEADER_BYTES)


def check(buf: torch.Tensor, digest: bytes, lay: bytes) -> None:
    """Raise :class:`Refusal` unless ``buf`` (uint8, HEADER_BYTES + page: an object just read)
    holds a well-formed object of the key ``digest`` names under the layout ``lay``."""
    head = ctypes.string_at(buf.data_ptr(), HEADER_BYTES)
    magic, got_lay, got_digest, nbytes, tail, s, w = HEADER.unpack(head)
    if magic != MAGIC:
        raise Refusal("bad magic (not written by this format, or corrupted)")
    if got_lay != lay:
        raise Refusal("written for another model, layout, shard or page size")
    if got_digest != digest:
        raise Refusal("holds another block's key")
    payload = buf[HEADER_BYTES:]
    if nbytes != payload.numel():
        raise Refusal(f"header says {nbytes} payload bytes, expected {payload.numel()}")
    if checksum(payload) != (s, w, tail):
        raise Refusal("checksum mismatch")


def fingerprint(buf: torch.Tensor) -> str:
    """SHA-1 (hex) of the whole object in ``buf``: what a compare-and-delete compares
    (Redis computes the same with ``redis.sha1hex``). Only on a refused object."""
    return hashlib.sha1(ctypes.string_at(buf.data_ptr(), buf.numel())).hexdigest()
