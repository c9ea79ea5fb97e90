"""SharedStore: the interface of one process's client of a shared KV store.

One instance per worker process (its rank's reads and writes) and one in the leader (existence
checks and lease renewal). Every method may do network I/O and is called from the caller's
background threads only, never from TensorRT-LLM's executor thread. Methods never raise for a
store-side failure: each returns per-key codes (below), so one bad key costs no batch.

Buffers are ``(address, size)`` pairs of memory the caller owns and keeps alive for the call
(a tensor's ``data_ptr()``; a ``bytearray`` through ``ctypes``); a store that transfers
zero-copy needs them registered first (:meth:`SharedStore.register`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Final

if TYPE_CHECKING:
    from kvbm_plugin.settings.shared import SharedSettings

# Per-key result codes (besides the byte counts of get_into).
OK: Final = 0
MISSING: Final = -1  # no such object (never written, evicted, its owner's segment gone)
UNAVAILABLE: Final = -2  # the store cannot be reached (or the circuit breaker is open)
FULL: Final = -3  # no room now (eviction has not caught up, or everything is leased)
FAILED: Final = -4  # anything else (a transfer error, a short read, bad parameters)
CODE_NAMES: Final = {OK: "ok", MISSING: "missing", UNAVAILABLE: "unavailable", FULL: "full",
                     FAILED: "failed"}

Buffer = tuple[int, int]  # (address, size)


class SharedStore(ABC):
    """A store client (see the module docstring). Registered as a ``kvbm_plugin.tiers``
    entry point; constructed with the shared-tier settings, it connects in ``__init__`` and
    raises ``ConfigError`` (naming the variable) for unusable settings."""

    name: ClassVar[str] = "shared"

    @abstractmethod
    def __init__(self, settings: SharedSettings) -> None: ...

    @property
    def lease_s(self) -> float | None:
        """How long a successful :meth:`exists` keeps an object from eviction, or None when
        the store grants no lease (then a block can vanish between a check and a read)."""
        return None

    def register(self, address: int, size: int) -> None:  # noqa: B027 - optional hook
        """Make ``[address, address + size)`` usable for zero-copy transfers."""

    def unregister(self, address: int) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`register`."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key: 1 present (leased for :attr:`lease_s` where the store leases), 0 absent,
        or a negative code."""

    @abstractmethod
    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        """Write each buffer under its key: :data:`OK` (also when the key was there: keys name
        content, so the bytes are the same) or a negative code."""

    @abstractmethod
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        """Read each object into its buffer: the bytes read, or a negative code
        (:data:`MISSING`, :data:`FAILED` for an object larger than its buffer)."""

    def get_promised(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        """``get_into`` of blocks already promised to TensorRT-LLM: a circuit breaker
        (:class:`~.breaker.GuardedStore`) tries these even while open; a plain store reads."""
        return self.get_into(keys, buffers)

    def remove_if(self, key: str, fingerprint: str) -> int:
        """Remove ``key``'s object if it still holds the bytes whose SHA-1 (hex) is
        ``fingerprint``: the reader that refused an object (``tiers.shared.frame``) repairs the
        key this way, so the next correct write (first-writer-wins ``put``) replaces it. Returns
        :data:`OK` (removed), :data:`MISSING` (gone, or other bytes now: left alone) or a
        negative code; :data:`FAILED` where the store cannot remove (the object then stays
        until evicted). Rare: only after a refused object."""
        return FAILED

    def remove_if_size_not(self, key: str, size: int) -> int:
        """Remove ``key``'s object if it is not ``size`` bytes (a read found another size:
        another format, or a bad writer): codes as :meth:`remove_if`."""
        return FAILED

    @abstractmethod
    def health(self) -> str | None:
        """None when the store answers, else why not; returns within about a second."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Disconnect; idempotent."""
