"""The tier index's compiled key table (``tiers/_keytable_c.c``) against its reference
(``tiers/_rows.py``'s ``KeyTable``): the same churn of inserts and deletes, with keys chosen to
share home buckets (long clusters, wrap-around at the table's end), leaves both tables bucket for
bucket alike and every find answering alike. The leader's tier index and the shared directory
use whichever is in use (``key_table``); an engine restarted with ``DYN_KVBM_NATIVE=0`` must
behave as before.
"""

from __future__ import annotations

import random
from array import array

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.tiers._rows import _GOLDEN, U64_MASK, KeyTable, key_table

compiled = _compiled.loops("tier_keys", {})
needs_native = pytest.mark.skipif(compiled is None,
                                  reason="kvbm_plugin.tiers._keytable_c was not built")


def _clustered_keys(rng: random.Random, capacity: int, n: int) -> list[int]:
    """``n`` distinct u64 keys whose home buckets crowd a few places, the last bucket
    included (so clusters wrap round the table's end)."""
    bits = max(3, (2 * capacity).bit_length())
    shift = 64 - bits
    homes = {0, (1 << bits) - 1, (1 << bits) // 2}
    keys: set[int] = set()
    while len(keys) < n:
        key = rng.getrandbits(64)
        if rng.random() < 0.7 and ((key * _GOLDEN) & U64_MASK) >> shift not in homes:
            continue
        keys.add(key)
    return sorted(keys, key=lambda _: rng.random())


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_compiled_key_table_matches_the_python_one_under_churn(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([1, 3, 8, 61, 200])
    pool = _clustered_keys(rng, capacity, 4 * capacity + 8)
    column: array[int] = array("Q")
    python, native = KeyTable(capacity, column), compiled.KeyTable(capacity, column)
    assert native.buckets() == python.buckets()
    live: dict[int, int] = {}  # key -> slot
    free: list[int] = []
    for _ in range(40 * capacity + 100):
        if live and (len(live) == capacity or rng.random() < 0.45):
            key = rng.choice(list(live))
            python.delete(key)
            native.delete(key)
            free.append(live.pop(key))  # the column keeps the key until the slot is reused
        else:
            key = rng.choice([k for k in pool if k not in live])
            if free:
                slot = free.pop()
                column[slot] = key
            else:
                slot = len(column)
                column.append(key)  # may move the column: read afresh by every call
            python.insert(key, slot)
            native.insert(key, slot)
            live[key] = slot
        assert native.buckets() == python.buckets()
        probe = rng.choice(pool)
        assert native.find(probe) == python.find(probe) == live.get(probe, -1)
    for key, slot in live.items():
        assert native.find(key) == slot
    native.clear()
    python.clear()
    assert native.buckets() == python.buckets()
    assert native.find(pool[0]) == -1


@needs_native
@pytest.mark.parametrize("seed", range(3))
def test_both_tables_find_digests_alike(seed: int) -> None:
    """``find_digests`` (the shared directory's run lookups): a digest is found where its
    first 8 bytes are a key and its last 8 are in ``hi`` at ``stride * slot``; a digest whose
    second half differs, an absent one, and one that is not 16 bytes are -1, in both forms."""
    rng = random.Random(seed)
    n, stride = 200, 4
    lo = array("Q", (rng.getrandbits(64) for _ in range(n)))
    hi = array("Q", (rng.getrandbits(64) for _ in range(stride * n)))
    tables = [KeyTable(n, lo), compiled.KeyTable(n, lo)]
    for table in tables:
        for slot in range(n):
            table.insert(lo[slot], slot)
    present = [lo[s].to_bytes(8, "little") + hi[stride * s].to_bytes(8, "little")
               for s in range(n)]
    wrong_half = [d[:8] + bytes(8) for d in present[:20]]
    absent = [rng.randbytes(16) for _ in range(20)]
    odd = [b"short", present[0] + b"x", bytearray(present[1]), None, 7]
    digests = present + wrong_half + absent + odd
    rng.shuffle(digests)
    want = [present.index(d) if d in present and type(d) is bytes else -1 for d in digests]
    for table in tables:
        assert table.find_digests(digests, hi, stride) == want
        assert table.find_digests([], hi, stride) == []
    with pytest.raises(TypeError, match="must be a list"):
        tables[1].find_digests(tuple(digests), hi, stride)
    with pytest.raises(ValueError, match="stride 0"):
        tables[1].find_digests(digests, hi, 0)
    with pytest.raises(TypeError, match=r"array\('Q'\)"):
        tables[1].find_digests(digests, array("q", [0] * len(hi)), stride)


@needs_native
def test_compiled_key_table_refuses_what_the_python_one_never_gets() -> None:
    column = array("Q", [5])
    table = compiled.KeyTable(4, column)
    table.insert(5, 0)
    assert table.find(-1) == -1 and table.find(1 << 64) == -1  # no u64: in no table
    with pytest.raises(TypeError, match="key must be an int"):
        table.find("5")
    with pytest.raises(ValueError, match="slot -2 is not a row"):
        table.insert(6, -2)
    with pytest.raises(KeyError, match="not in the table"):
        table.delete(7)
    with pytest.raises(TypeError, match=r"array\('Q'\)"):
        compiled.KeyTable(4, array("q", [5])).find(5)
    with pytest.raises(IndexError, match="outside the key column"):
        broken = compiled.KeyTable(4, array("Q"))
        broken.insert(9, 3)  # a slot the column does not have: the owner's bug, said
        broken.find(9)
    small = compiled.KeyTable(0, array("Q", range(8)))
    for slot in range(8):
        small.insert(slot, slot)
    with pytest.raises(RuntimeError, match="full"):
        small.insert(8, 0)


def test_key_table_follows_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_KVBM_NATIVE", "0")
    assert type(key_table(4, array("Q"))) is KeyTable
    assert type(key_table(4, array("Q"), native=False)) is KeyTable
    if compiled is not None:
        assert type(key_table(4, array("Q"), native=True)) is compiled.KeyTable
        monkeypatch.delenv("DYN_KVBM_NATIVE")
        assert type(key_table(4, array("Q"))) is compiled.KeyTable
