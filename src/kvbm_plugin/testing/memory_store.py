"""MemoryStore: an in-process :class:`~kvbm_plugin.tiers.shared.store.SharedStore` for tests.

It behaves as Mooncake Store does where the shared tier depends on it (observed with
``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 on a loopback master; in Mooncake's source,
``mooncake-store/src/master_service.cpp``, ``MasterService::ExistKey`` and ``GetReplicaList``
call ``GrantLease(default_kv_lease_ttl_)``, which only ever extends a lease): ``put`` of a
present key keeps the first bytes and grants no lease; ``exists`` and ``get_into`` grant a lease
of ``lease_s`` from the call; a leased object is never evicted; eviction is silent (the key is
just gone). Unlike Mooncake it evicts only when told (:meth:`evict_unleased`, :meth:`evict`),
so a test decides when, and its clock is the caller's (a settable one in tests). ``down``
makes every call answer :data:`~kvbm_plugin.tiers.shared.store.UNAVAILABLE` at once, as the
circuit breaker does while the store cannot be reached.

Thread-safe (one lock; buffers are copied with ``ctypes.memmove`` under it). One instance is
one store: give it to several agents and workers in one process to simulate engines sharing it.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvbm_plugin.tiers.shared.store import FAILED, MISSING, OK, UNAVAILABLE, Buffer, SharedStore

if TYPE_CHECKING:
    from kvbm_plugin.settings.shared import SharedSettings

__all__ = ["MemoryStore"]


class MemoryStore(SharedStore):
    """A dict of objects with simulated leases (see the module docstring)."""

    name = "memory"

    def __init__(self, settings: SharedSettings | None = None, *, lease_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s is None:
            lease_s = settings.lease_s if settings is not None else 10.0
        if not lease_s > 0:
            raise ValueError(f"MemoryStore lease_s {lease_s!r} must be > 0")
        self._lease_s = float(lease_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._leases: dict[str, float] = {}  # key -> when its lease ends
        self.down = False
        self.calls: dict[str, int] = {"exists": 0, "exists_keys": 0, "put": 0, "get_into": 0,
                                      "health": 0}
        self.closed = False

    @property
    def lease_s(self) -> float:
        return self._lease_s

    def exists(self, keys: Sequence[str]) -> list[int]:
        with self._lock:
            self.calls["exists"] += 1
            self.calls["exists_keys"] += len(keys)
            if self.down:
                return [UNAVAILABLE] * len(keys)
            until = self.clock() + self._lease_s
            out = []
            for key in keys:
                if key in self._objects:
                    self._lease(key, until)
                    out.append(1)
                else:
                    out.append(0)
            return out

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"MemoryStore.put: {len(keys)} keys but {len(buffers)} buffers")
        with self._lock:
            self.calls["put"] += 1
            if self.down:
                return [UNAVAILABLE] * len(keys)
            out = []
            for key, (address, size) in zip(keys, buffers, strict=True):
                if not key or size <= 0:
                    out.append(FAILED)
                    continue
                if key not in self._objects:  # first writer wins: keys name content
                    self._objects[key] = ctypes.string_at(address, size)
                out.append(OK)
            return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"MemoryStore.get_into: {len(keys)} keys but {len(buffers)} "
                             "buffers")
        with self._lock:
            self.calls["get_into"] += 1
            if self.down:
                return [UNAVAILABLE] * len(keys)
            until = self.clock() + self._lease_s
            out = []
            for key, (address, size) in zip(keys, buffers, strict=True):
                data = self._objects.get(key)
                if data is None:
                    out.append(MISSING)
                elif len(data) > size:
                    out.append(FAILED)
                else:
                    ctypes.memmove(address, data, len(data))
                    self._lease(key, until)
                    out.append(len(data))
            return out

    def remove_if(self, key: str, fingerprint: str) -> int:
        """Remove ``key`` if its bytes still have this SHA-1 (Redis's compare-and-delete)."""
        import hashlib

        with self._lock:
            self.calls["remove_if"] = self.calls.get("remove_if", 0) + 1
            if self.down:
                return UNAVAILABLE
            data = self._objects.get(key)
            if data is None or hashlib.sha1(data).hexdigest() != fingerprint:
                return MISSING
            del self._objects[key]
            self._leases.pop(key, None)
            return OK

    def remove_if_size_not(self, key: str, size: int) -> int:
        with self._lock:
            if self.down:
                return UNAVAILABLE
            data = self._objects.get(key)
            if data is None or len(data) == size:
                return MISSING
            del self._objects[key]
            self._leases.pop(key, None)
            return OK

    def replace_bytes(self, key: str, data: bytes) -> None:
        """Overwrite ``key`` whatever it holds (a test's corruption of a stored object)."""
        with self._lock:
            self._objects[key] = bytes(data)

    def health(self) -> str | None:
        with self._lock:
            self.calls["health"] += 1
            return "MemoryStore is down" if self.down else None

    def close(self) -> None:
        self.closed = True

    # ---- what a test does to the store ---------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (first writer wins), as another engine's worker would."""
        with self._lock:
            self._objects.setdefault(key, bytes(data))

    def get_bytes(self, key: str) -> bytes | None:
        with self._lock:
            return self._objects.get(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._objects)

    def lease_end(self, key: str) -> float | None:
        """When ``key``'s lease ends (clock time), or None without one."""
        with self._lock:
            return self._leases.get(key)

    def evict_unleased(self) -> list[str]:
        """Evict every object whose lease ended (or that never had one); returns their keys."""
        with self._lock:
            now = self.clock()
            gone = [k for k in self._objects if self._leases.get(k, now) <= now]
            for key in gone:
                del self._objects[key]
                self._leases.pop(key, None)
            return gone

    def evict(self, keys: Sequence[str]) -> None:
        """Remove these objects whatever their leases (an owner's segment died, the master
        restarted)."""
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)
                self._leases.pop(key, None)

    def clear(self) -> None:
        """Everything gone (a master restart)."""
        with self._lock:
            self._objects.clear()
            self._leases.clear()

    def _lease(self, key: str, until: float) -> None:
        if until > self._leases.get(key, float("-inf")):
            self._leases[key] = until
