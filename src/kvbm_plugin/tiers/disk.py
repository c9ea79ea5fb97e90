"""Disk tier (G3): one file per slot per rank, written atomically, with a checksum.

File layout (little-endian): a 48-byte header ``magic(8) key(u64) nbytes(u64) crc32(u32)
reserved(u32) layout(16)`` followed by the block's raw bytes. ``layout`` is a digest of what
the bytes mean: the model and layout identity the worker passes (``TierSpec.identity``), the
pool's dtype and per-block shape, and the rank. A write goes to a temporary file in the same
directory and is renamed over the slot's file, so a reader sees the old block or the new one,
never a mixture. A read checks magic, layout, key, length and CRC-32 before the bytes are
used; a missing, torn, truncated, corrupted or foreign file (another model, dtype, layout or
rank wrote it) reads as absent.

One engine per directory: :func:`claim_directory` takes an exclusive ``flock`` on a lock file
in it, which the kernel drops when the owning process ends however it ends; the leader claims
``DYN_KVBM_DISK_CACHE_DIR`` at start-up, so a second process pointed at the same directory is
refused there, with one line naming the directory and its owner.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import socket
import struct
import threading
import time
import zlib
from typing import TYPE_CHECKING

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.consolidator_config import DISK_CACHE_DIR, ConfigError
from kvbm_plugin.tiers.base import OffloadTier, TierSpec, WriteResult
from kvbm_plugin.tiers.content_keys import TIER_DISK, block_path, stat_signature
from kvbm_plugin.wire.events import MEDIUM_DISK

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAGIC = b"KVBMBLK2"
_HEADER = struct.Struct("<8sQQII16s")
LOCK_NAME = ".kvbm-owner-dp{dp_rank}.lock"


def layout_digest(spec: TierSpec) -> bytes:
    """16 bytes naming what a block file's bytes mean: model/layout identity, dtype, per-block
    shape and rank. Two engines that differ in any of them never read each other's files."""
    text = (f"identity={spec.identity}\0dtype={spec.dtype}\0"
            f"shape={tuple(spec.block_shape)}\0rank={spec.rank}")
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16, person=b"kvbm-lay").digest()


class DirectoryClaim:
    """An exclusive claim on a disk cache directory for this process (see
    :func:`claim_directory`). :meth:`release` (idempotent) or the process's end drops it."""

    def __init__(self, directory: str, path: str, fd: int) -> None:
        self.directory = directory
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the flock; the file stays (removing it would race a claimer)

    def __repr__(self) -> str:
        return f"DirectoryClaim({self.directory!r}, held={self._fd is not None})"


def claim_directory(directory: str, dp_rank: int = 0) -> DirectoryClaim:
    """Claim ``directory`` for this process's leader of attention-DP rank ``dp_rank``.

    Called by the leader's constructor (start-up, any thread, before any block is written).
    Takes a non-blocking exclusive ``flock`` on ``{directory}/.kvbm-owner-dp{dp_rank}.lock``
    and writes the owner (pid, host, time) into it. A flock belongs to the open file, so the
    kernel drops it when the owner exits, even on SIGKILL: a stale lock file never blocks.
    Raises ConfigError, one line naming the directory and its owner, when another process (or
    another leader in this one) holds it.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME.format(dp_rank=dp_rank))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            owner = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise ConfigError(f"{DISK_CACHE_DIR}={directory!r} is in use by another engine "
                          f"({owner}); each engine needs its own disk cache directory") from None
    except BaseException:
        os.close(fd)
        raise
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    owner = f"pid {os.getpid()} on {socket.gethostname()}, since {since}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner.encode("utf-8") + b"\n", 0)
    return DirectoryClaim(directory, path, fd)


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
        self._layout = layout_digest(spec)
        self.corrupt_reads = 0
        self.foreign_reads = 0  # files another model, dtype, layout or rank wrote
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
            header = _HEADER.pack(MAGIC, key, len(payload), zlib.crc32(payload), 0,
                                  self._layout)
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
                magic, file_key, nbytes, crc, _, layout = _HEADER.unpack(head)
                if magic != MAGIC:
                    return self._corrupt(path, "bad magic")
                if layout != self._layout:
                    self.foreign_reads += 1
                    return self._corrupt(path, "written by another model, dtype, layout or rank")
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
