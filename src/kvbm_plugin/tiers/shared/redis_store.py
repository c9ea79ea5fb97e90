"""RedisStore: the shared tier on a Redis server (or anything speaking its protocol), entry
point ``redis`` in ``kvbm_plugin.tiers``; the same keys, codes and callers as MooncakeStore.

Who calls it: as MooncakeStore (each worker's writer and reader threads, the leader's shared
agent; never the executor thread). One redis-py client per process, its connection pool shared
by those threads. ``DYN_KVBM_SHARED_ADDRESS`` is a URL: ``redis://host:port/db``,
``rediss://...`` (TLS), ``unix:///path/redis.sock?db=0``, or a bare ``host:port``.

* Batches are pipelined (one round trip, no MULTI): ``SET key value NX`` per block (the first
  writer's bytes stay: keys name content), ``GET`` per block into the caller's buffer (a value
  of another size than the buffer is FAILED, never a load), ``TOUCH`` per key for exists.
* **No lease** (:attr:`lease_s` is None): Redis evicts by its ``maxmemory-policy`` without
  telling anyone. ``TOUCH`` refreshes a key's LRU/LFU access time, so under ``allkeys-lru`` /
  ``allkeys-lfu`` the blocks a leader keeps re-checking are the last to go, but nothing
  guarantees a checked block is still there at the load: a failed load is possible and counted
  (``shared_loads_failed``). Under ``noeviction`` (or a ``volatile-*`` policy: these keys carry
  no TTL) nothing is evicted and a full server answers puts with OOM: FULL here.
* A refused object (``tiers.shared.frame``: wrong magic, layout, key, length or checksum) is
  removed by :meth:`RedisStore.remove_if`, a compare-and-delete script, so ``SET NX`` of the
  next correct write stores it again: a bad writer does not own a key for its lifetime.
* Errors: a connection that fails or times out is UNAVAILABLE for every key of the batch
  (redis-py retries are off: the circuit breaker decides); an OOM reply is FULL; any other
  error reply is FAILED.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.tiers.shared.store import (
    FAILED,
    FULL,
    MISSING,
    OK,
    UNAVAILABLE,
    Buffer,
    SharedStore,
)

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install 'kvbm-plugin[redis]' (the redis client)"
CONNECT_TIMEOUT_S = 1.0
# Compare-and-delete of a refused object: removed only while it holds the bytes read.
_REMOVE_IF = ("local v = redis.call('GET', KEYS[1]) "
              "if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
              "return 0")
_REMOVE_IF_SIZE_NOT = ("local n = redis.call('STRLEN', KEYS[1]) "
                       "if n > 0 and n ~= tonumber(ARGV[1]) then return redis.call('DEL', KEYS[1]) "
                       "end return 0")
SOCKET_TIMEOUT_S = 5.0


def redis_url(address: str) -> str:
    """The redis-py URL of ``DYN_KVBM_SHARED_ADDRESS`` (ConfigError naming it when empty)."""
    address = address.strip()
    if not address:
        raise ConfigError(f"{cc.SHARED_ADDRESS} is unset: a Redis URL (redis://host:port/db, "
                          "unix:///path/redis.sock)")
    if "://" in address:
        return address
    if address.startswith("/"):
        return f"unix://{address}"
    return f"redis://{address}"


def _view(buffer: Buffer) -> memoryview:
    address, size = buffer
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class RedisStore(SharedStore):
    """A Redis client (see the module docstring). Thread-safe (redis-py's connection pool)."""

    name: ClassVar[str] = "redis"

    def __init__(self, settings: SharedSettings) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigError(f"{cc.SHARED_TIER}='redis' needs the Redis client: {EXTRA_HINT} "
                              f"({exc})") from None
        self.settings = settings
        self._rl = RateLimitedLog(log)  # per client: one client's losses hide no other's
        self._closed = False
        self._errors = redis.exceptions
        url = redis_url(settings.address)
        try:
            self._client: Any = redis.Redis.from_url(
                url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S,
                retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        except ValueError as exc:
            raise ConfigError(f"{cc.SHARED_ADDRESS}={settings.address!r}: not a Redis URL "
                              f"({exc})") from None
        self._remove_if = self._client.register_script(_REMOVE_IF)
        self._remove_if_size_not = self._client.register_script(_REMOVE_IF_SIZE_NOT)
        problem = self.health()
        if problem is not None:
            self._client.close()
            raise ConfigError(f"{cc.SHARED_ADDRESS}={settings.address!r}: no Redis server "
                              f"answers there ({problem})")
        try:
            policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy", "?")
        except self._errors.RedisError:
            policy = "?"  # CONFIG may be disabled on a managed server
        self.eviction_policy = str(policy)
        log.info("Redis shared store at %s (maxmemory-policy %s: %s)", url, policy,
                 "nothing is evicted; a full server refuses puts" if policy in
                 ("noeviction", "volatile-lru", "volatile-lfu", "volatile-random",
                  "volatile-ttl") else "evicts without telling: a checked block may be gone "
                 "at its load")

    def _pipeline(self, what: str, n: int, fill: Any) -> list[Any]:
        """Run one pipelined batch; each entry a reply or a per-key code (int < 0)."""
        if self._closed:
            return [UNAVAILABLE] * n
        pipe = self._client.pipeline(transaction=False)
        fill(pipe)
        try:
            replies = pipe.execute(raise_on_error=False)
        except (self._errors.ConnectionError, self._errors.TimeoutError) as exc:
            self._rl.log(logging.WARNING, f"redis.{what}.down", "Redis %s failed: %s", what, exc)
            return [UNAVAILABLE] * n
        except self._errors.RedisError as exc:
            self._rl.log(logging.ERROR, f"redis.{what}", "Redis %s failed: %s", what, exc)
            return [FAILED] * n
        out: list[Any] = []
        for reply in replies:
            if isinstance(reply, Exception):
                out.append(self._code(what, reply))
            else:
                out.append(reply)
        return out

    def _code(self, what: str, error: Exception) -> int:
        if isinstance(error, (self._errors.ConnectionError, self._errors.TimeoutError)):
            return UNAVAILABLE
        if isinstance(error, self._errors.OutOfMemoryError):  # an "OOM ..." reply
            return FULL
        self._rl.log(logging.ERROR, f"redis.{what}.reply", "Redis %s replied %s", what, error)
        return FAILED

    def exists(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []

        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.touch(key)

        return [r if isinstance(r, int) and r < 0 else (1 if r else 0)
                for r in self._pipeline("exists", len(keys), fill)]

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")
        if not keys:
            return []

        def fill(pipe: Any) -> None:
            for key, buffer in zip(keys, buffers, strict=True):
                pipe.set(key, _view(buffer), nx=True)

        # SET NX: True (written) or None (there already): both OK.
        return [r if isinstance(r, int) and not isinstance(r, bool) and r < 0 else OK
                for r in self._pipeline("put", len(keys), fill)]

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys for {len(buffers)} buffers")
        if not keys:
            return []

        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.get(key)

        out: list[int] = []
        replies = self._pipeline("get_into", len(keys), fill)
        for key, reply, (address, size) in zip(keys, replies, buffers, strict=True):
            if reply is None:
                out.append(MISSING)
            elif isinstance(reply, int):
                out.append(reply)
            elif len(reply) != size:
                self._rl.log(logging.ERROR, "redis.size", "shared-tier object %s has %d bytes, "
                             "expected %d: not loaded", key, len(reply), size)
                out.append(FAILED)
            else:
                ctypes.memmove(address, reply, size)
                out.append(size)
        return out

    def remove_if(self, key: str, fingerprint: str) -> int:
        """Compare-and-delete in one server-side step (a Lua script: ``DEL`` only while the
        value's ``redis.sha1hex`` is still ``fingerprint``), so a correct object written since
        the refused read is never removed."""
        return self._script(self._remove_if, key, fingerprint)

    def remove_if_size_not(self, key: str, size: int) -> int:
        """Compare-and-delete on the value's length (``STRLEN``), in one server-side step."""
        return self._script(self._remove_if_size_not, key, size)

    def _script(self, script: Any, key: str, arg: Any) -> int:
        if self._closed:
            return UNAVAILABLE
        try:
            removed = script(keys=[key], args=[arg])
        except (self._errors.ConnectionError, self._errors.TimeoutError) as exc:
            self._rl.log(logging.WARNING, "redis.remove.down", "Redis remove failed: %s", exc)
            return UNAVAILABLE
        except self._errors.RedisError as exc:
            return self._code("remove", exc)
        return OK if removed else MISSING

    def health(self) -> str | None:
        if self._closed:
            return "the Redis client is closed"
        try:
            self._client.ping()
        except self._errors.RedisError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def info(self) -> dict[str, Any]:
        """What the server reports (for ``doctor``): version, memory, policy, keys."""
        info = self._client.info()
        return {"redis_version": info.get("redis_version"),
                "used_memory_human": info.get("used_memory_human"),
                "maxmemory_human": info.get("maxmemory_human"),
                "maxmemory_policy": info.get("maxmemory_policy"),
                "evicted_keys": info.get("evicted_keys"),
                "keys": self._client.dbsize()}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
