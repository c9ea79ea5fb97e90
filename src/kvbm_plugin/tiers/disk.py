"""Disk tier (G3): one file per slot per rank, written atomically, with a checksum.

File layout (little-endian): a 32-byte header ``magic(8) key(u64) nbytes(u64) crc32(u32)
reserved(u32)`` followed by the block's raw bytes. A write goes to a temporary file in the same
directory and is renamed over the slot's file, so a reader sees the old block or the new one,
never a mixture. A read checks magic, key, length and CRC-32 before the bytes are used; a
missing, torn, truncated or corrupted file reads as absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import threading
import zlib
from typing import TYPE_CHECKING

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.tiers.base import (
    TIER_DISK,
    OffloadTier,
    TierSpec,
    WriteResult,
    block_path,
    stat_signature,
)
from kvbm_plugin.wire.events import MEDIUM_DISK

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAGIC = b"KVBMBLK1"
_HEADER = struct.Struct("<8sQQII")


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no copy, no numpy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")


class DiskTier(OffloadTier):
    """Block files under ``{directory}/rank{rank}/``; called from the worker's disk thread."""

    name = TIER_DISK
    medium = MEDIUM_DISK

    def __init__(self, spec: TierSpec) -> None:
        super().__init__(spec)
        if spec.directory is None:
            raise ValueError("disk tier needs a directory")
        if spec.capacity <= 0:
            raise ValueError(f"disk tier capacity {spec.capacity} must be > 0")
        self.directory = spec.directory
        self._made_dir = False
        self._tmp_counter = 0
        self._lock = threading.Lock()
        self.corrupt_reads = 0
        self.write_failures = 0
        self.dirs_recreated = 0
        self._log = RateLimitedLog(logger)  # a failing disk must not flood the log

    def path(self, slot: int) -> str:
        return block_path(self.directory, self.spec.rank, slot)

    def write(self, slot: int, key: int, block: torch.Tensor) -> WriteResult:
        path = self.path(slot)
        with self._lock:
            self._tmp_counter += 1
            tmp = f"{path}.tmp{os.getpid()}_{self._tmp_counter}"
        try:
            if not self._made_dir:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self._made_dir = True
            payload = byte_view(block.contiguous())
            header = _HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload), 0)
            try:
                f = open(tmp, "wb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                # The directory was removed while running (e.g. a cache cleaner): recreate it.
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.dirs_recreated += 1
                self._log.log(logging.WARNING, "recreated", "disk tier: %s was removed; "
                              "recreated it (%d times so far)", os.path.dirname(path),
                              self.dirs_recreated)
                f = open(tmp, "wb")  # noqa: SIM115 - closed below
            with f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)  # atomic: readers see the old file or the new one
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.write_failures += 1
            return WriteResult(False, error=f"{type(exc).__name__}: {exc}")
        signature = stat_signature(path)
        return WriteResult(signature is not None, signature)

    def read(self, slot: int, key: int, out: torch.Tensor) -> bool:
        path = self.path(slot)
        view = byte_view(out)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return self._corrupt(path, "short header")
                magic, file_key, nbytes, crc, _ = _HEADER.unpack(head)
                if magic != MAGIC:
                    return self._corrupt(path, "bad magic")
                if file_key != key:
                    return self._corrupt(path, f"holds key {file_key:#x}, expected {key:#x}")
                if nbytes != len(view):
                    return self._corrupt(path, f"{nbytes} bytes, expected {len(view)}")
                got = f.readinto(view)
                if got != nbytes or f.read(1):
                    return self._corrupt(path, "torn or trailing bytes")
        except FileNotFoundError:
            return False
        except OSError as exc:
            return self._corrupt(path, f"{type(exc).__name__}: {exc}")
        if zlib.crc32(view) != crc:
            return self._corrupt(path, "checksum mismatch")
        return True

    def _corrupt(self, path: str, why: str) -> bool:
        self.corrupt_reads += 1
        self._log.log(logging.WARNING, "corrupt", "disk tier: %s is unusable (%s); treated as "
                      "absent (%d unusable reads so far)", path, why, self.corrupt_reads)
        return False
