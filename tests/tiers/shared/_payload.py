"""Deterministic block bytes for the shared-tier tests (every process knows a key's bytes),
and buffers in one contiguous arena (as a worker's host pool or staging buffer is)."""

from __future__ import annotations

import ctypes
import hashlib


def payload(key: str, size: int) -> bytes:
    """``size`` bytes that only ``key`` has."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


class Arena:
    """``blocks`` buffers of ``size`` bytes; ``buffer(i)`` is ``(address, size)``."""

    def __init__(self, blocks: int, size: int) -> None:
        self.size = size
        self.nbytes = blocks * size
        self._memory = ctypes.create_string_buffer(self.nbytes)
        self.address = ctypes.addressof(self._memory)

    def buffer(self, i: int) -> tuple[int, int]:
        return (self.address + i * self.size, self.size)

    def write(self, i: int, data: bytes) -> None:
        assert len(data) == self.size
        ctypes.memmove(self.address + i * self.size, data, self.size)

    def read(self, i: int) -> bytes:
        return ctypes.string_at(self.address + i * self.size, self.size)

    def clear(self) -> None:
        ctypes.memset(self.address, 0, self.nbytes)
