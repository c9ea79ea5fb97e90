"""RedisStore against a private redis-server: byte-exact round trips over the unix socket and
TCP, two processes, foreign keys, a full server, silent eviction, the server stopped and
restarted behind the circuit breaker, and start-up errors."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import _peer
import pytest
from _payload import Arena, payload
from _require import unavailable

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.consolidator_config import ConfigError
from kvbm_plugin.settings.shared import SharedSettings
from kvbm_plugin.tiers.shared.breaker import GuardedStore
from kvbm_plugin.tiers.shared.keys import SharedLayout, chain_digests
from kvbm_plugin.tiers.shared.store import FAILED, FULL, MISSING, OK, UNAVAILABLE

BLOCK = 64 << 10
LAYOUT = SharedLayout("kvbm", "test-model", 2, 1, 0, 32, BLOCK, "bfloat16", "v1pool")


def _keys(n: int, layout: SharedLayout = LAYOUT, salt: str | None = None) -> list[str]:
    tokens = list(range(n * layout.tokens_per_block))
    return [layout.key(d) for d in chain_digests(tokens, layout.tokens_per_block, salt)]


def _fill(arena: Arena, keys: list[str]) -> list[tuple[int, int]]:
    for i, key in enumerate(keys):
        arena.write(i, payload(key, arena.size))
    return [arena.buffer(i) for i in range(len(keys))]


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_round_trip_is_byte_exact(redis_server: Any, redis_store_factory: Any,
                                  via: str) -> None:
    store = redis_store_factory(redis_server.unix_address if via == "unix"
                                else redis_server.address)
    keys = _keys(8)
    src, dst = Arena(8, BLOCK), Arena(9, BLOCK)
    assert store.put(keys, _fill(src, keys)) == [OK] * 8
    assert store.exists(keys + ["absent"]) == [1] * 8 + [0]
    got = store.get_into(keys + ["absent"], [dst.buffer(i) for i in range(9)])
    assert got == [BLOCK] * 8 + [MISSING]
    assert [dst.read(i) for i in range(8)] == [payload(k, BLOCK) for k in keys]
    assert dst.read(8) == bytes(BLOCK)
    src.write(0, bytes(BLOCK))  # a second put of a key keeps the first bytes
    assert store.put(keys[:1], [src.buffer(0)]) == [OK]
    assert store.get_into(keys[:1], [dst.buffer(0)]) == [BLOCK]
    assert dst.read(0) == payload(keys[0], BLOCK)
    assert store.lease_s is None
    assert store.health() is None


def test_a_read_of_another_size_is_failed(redis_server: Any, redis_store_factory: Any,
                                          expect_errors: Any) -> None:
    store = redis_store_factory(redis_server.unix_address)
    key = _keys(1)[0]
    assert store.put([key], _fill(Arena(1, BLOCK), [key])) == [OK]
    assert store.get_into([key], [Arena(1, 2 * BLOCK).buffer(0)]) == [FAILED]
    assert expect_errors.wait_for("expected 131072")


def test_another_layouts_key_never_loads(redis_server: Any, redis_store_factory: Any) -> None:
    store = redis_store_factory(redis_server.unix_address)
    keys = _keys(3)
    arena = Arena(3, BLOCK)
    assert store.put(keys, _fill(arena, keys)) == [OK] * 3
    other = SharedLayout("kvbm", "other-model", 2, 1, 0, 32, BLOCK, "bfloat16", "v1pool")
    assert store.exists(_keys(3, other)) == [0] * 3
    assert store.exists(_keys(3, LAYOUT.for_rank(0))) == [0] * 3
    assert store.get_into(_keys(1, other), [arena.buffer(0)]) == [MISSING]


def test_two_processes_read_each_others_writes(redis_server: Any,
                                               redis_store_factory: Any) -> None:
    store = redis_store_factory(redis_server.address)
    mine, theirs = _keys(4), _keys(4, salt="mm:ab")
    arena = Arena(8, BLOCK)
    assert store.put(mine, _fill(arena, mine)) == [OK] * 4
    peer = _peer.start("redis", redis_server.unix_address, theirs, mine, BLOCK)
    try:
        report = _peer.report(peer)
        assert report == {"put": [OK] * 4, "read": [BLOCK] * 4, "exact": True}
    finally:
        peer.stdin.close()
        assert peer.wait(30) == 0
    assert store.get_into(theirs, [arena.buffer(4 + i) for i in range(4)]) == [BLOCK] * 4
    assert [arena.read(4 + i) for i in range(4)] == [payload(k, BLOCK) for k in theirs]


def test_a_full_noeviction_server_is_full(redis_server_factory: Any,
                                          redis_store_factory: Any) -> None:
    server = redis_server_factory(maxmemory="4mb", policy="noeviction")
    store = redis_store_factory(server.unix_address)
    keys = _keys(200, salt="full")
    arena = Arena(1, BLOCK)
    codes = []
    for key in keys:
        arena.write(0, payload(key, BLOCK))
        codes.append(store.put([key], [arena.buffer(0)])[0])
        if codes[-1] != OK:
            break
    assert codes[-1] == FULL and set(codes[:-1]) == {OK}
    assert store.exists(keys[:len(codes) - 1]) == [1] * (len(codes) - 1)  # nothing evicted


def test_an_lfu_server_evicts_silently_but_touched_keys_last(
        redis_server_factory: Any, redis_store_factory: Any) -> None:
    """allkeys-lfu: puts never fail, old blocks vanish (MISSING); the block a leader keeps
    re-checking (exists = TOUCH, an access) outlives them. No lease: a hint, not a guarantee.
    (Under allkeys-lru the same holds only across seconds: Redis's LRU clock ticks once a
    second.)"""
    server = redis_server_factory(maxmemory="4mb", policy="allkeys-lfu",
                                  extra_args=["--lfu-log-factor", "0",
                                              "--maxmemory-samples", "10"])
    store = redis_store_factory(server.unix_address)
    kept = _keys(1, salt="kept")[0]
    keys = _keys(300, salt="lru")
    arena = Arena(1, BLOCK)
    arena.write(0, payload(kept, BLOCK))
    assert store.put([kept], [arena.buffer(0)]) == [OK]
    for i, key in enumerate(keys):
        arena.write(0, payload(key, BLOCK))
        assert store.put([key], [arena.buffer(0)]) == [OK]
        if i % 4 == 0:
            assert store.exists([kept]) == [1], f"the touched block was evicted at put {i}"
    # Untouched keys share one LFU counter, so Redis evicts among them by sampling: which old
    # ones survive is chance (one of the first ten did, about one run in ten). What holds is
    # that most are gone without a put failing, and the touched block never was.
    assert store.exists(keys).count(0) >= len(keys) // 2
    assert store.get_into([kept], [arena.buffer(0)]) == [BLOCK]
    assert arena.read(0) == payload(kept, BLOCK)


def test_server_stopped_and_restarted(redis_server: Any, redis_store_factory: Any) -> None:
    """Calls fail fast (UNAVAILABLE, counted, the breaker opens) while Redis is down, and the
    client recovers by itself when it is back (its data gone: nothing persists)."""
    guarded = GuardedStore(redis_store_factory(redis_server.unix_address), threshold=2,
                           backoff_s=0.05, max_backoff_s=0.2)
    keys = _keys(2)
    arena = Arena(2, BLOCK)
    assert guarded.put(keys, _fill(arena, keys)) == [OK, OK]
    redis_server.stop()
    started = time.monotonic()
    for _ in range(20):
        assert guarded.exists(keys) == [UNAVAILABLE] * 2
    assert time.monotonic() - started < 2
    assert not guarded.available
    stats = guarded.stats()
    assert stats["opened"] == 1 and stats["exists_unavailable"] == 40
    assert stats["short_circuited"] >= 15
    redis_server.restart()
    deadline = time.monotonic() + 10
    while guarded.exists(keys) == [UNAVAILABLE] * 2:
        assert time.monotonic() < deadline, "the client never came back"
        time.sleep(0.02)  # the breaker's next probe is due within max_backoff_s
    assert guarded.available and guarded.stats()["closed"] == 1
    assert guarded.exists(keys) == [0, 0]  # nothing persisted
    assert guarded.put(keys, _fill(arena, keys)) == [OK, OK]


def test_no_server_is_a_config_error(tmp_path: Path) -> None:
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        unavailable(f"the redis client is not installed ({exc})")
    from kvbm_plugin.tiers.shared.redis_store import RedisStore

    address = f"unix://{tmp_path}/none.sock"
    with pytest.raises(ConfigError, match=f"{cc.SHARED_ADDRESS}='{address}': no Redis server"):
        RedisStore(SharedSettings(store="redis", model_key="m", address=address))
    with pytest.raises(ConfigError, match=f"{cc.SHARED_ADDRESS} is unset"):
        RedisStore(SharedSettings(store="redis", model_key="m", address=""))
