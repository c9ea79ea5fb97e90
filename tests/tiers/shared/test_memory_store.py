"""MemoryStore behaves as the shared tier expects of Mooncake: leases from exists(), first writer
wins, silent eviction of unleased objects only, and a down switch."""

from __future__ import annotations

import ctypes

from _shared_blocks import Clock

from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.shared.store import FAILED, MISSING, OK, UNAVAILABLE


def _buffer(data: bytes) -> tuple[ctypes.Array, tuple[int, int]]:
    buf = ctypes.create_string_buffer(data, len(data))
    return buf, (ctypes.addressof(buf), len(data))


def test_exists_leases_and_only_unleased_objects_are_evicted() -> None:
    clock = Clock()
    store = MemoryStore(lease_s=10.0, clock=clock)
    keep, kb = _buffer(b"k" * 8)
    lose, lb = _buffer(b"l" * 8)
    assert store.put(["keep", "lose"], [kb, lb]) == [OK, OK]
    assert store.lease_end("keep") is None  # a put grants no lease
    assert store.exists(["keep", "nope"]) == [1, 0]
    assert store.lease_end("keep") == clock.now + 10.0
    assert store.evict_unleased() == ["lose"]
    clock.advance(10.0)
    assert store.evict_unleased() == ["keep"]
    assert store.exists(["keep"]) == [0]


def test_first_writer_wins_and_reads_check_the_size() -> None:
    store = MemoryStore(lease_s=5.0)
    first, fb = _buffer(b"a" * 8)
    second, sb = _buffer(b"b" * 8)
    store.put(["k"], [fb])
    assert store.put(["k"], [sb]) == [OK]
    out, ob = _buffer(b"\0" * 8)
    small, smb = _buffer(b"\0" * 4)
    assert store.get_into(["k", "k", "x"], [ob, smb, ob]) == [8, FAILED, MISSING]
    assert out.raw == b"a" * 8


def test_a_down_store_answers_unavailable_to_every_call() -> None:
    store = MemoryStore(lease_s=5.0)
    store.put_bytes("k", b"x")
    store.down = True
    data, db = _buffer(b"y")
    assert store.exists(["k"]) == [UNAVAILABLE]
    assert store.put(["j"], [db]) == [UNAVAILABLE]
    assert store.get_into(["k"], [db]) == [UNAVAILABLE]
    assert store.health() is not None
    store.down = False
    assert store.exists(["k"]) == [1] and store.health() is None
