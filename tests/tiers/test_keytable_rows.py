"""The tier index's compiled row loops (``KeyTable.write_rows`` and ``take_run``,
``tiers/_keytable_rows.c``) against their references (``TierIndex._write_run`` and
``take_resident``'s loop): two indexes, one on the compiled key table and one on the Python
one, given the same random history of reserved runs (negative and unsigned hashes, roots and
children, scopes, tokens past int32), commits, matched runs, pins, discards and evictions,
stay alike row for row, bucket for bucket, view for view. An engine restarted with
``DYN_KVBM_NATIVE=0`` must behave as before.
"""

from __future__ import annotations

import random

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.tiers import _entry
from kvbm_plugin.tiers._rows import KeyTable
from kvbm_plugin.tiers.index import TierIndex

compiled = _compiled.loops("tier_keys", {})
needs_native = pytest.mark.skipif(compiled is None,
                                  reason="kvbm_plugin.tiers._keytable_c was not built")


def _pair(capacity: int) -> tuple[TierIndex, TierIndex]:
    native, python = TierIndex("host", capacity), TierIndex("host", capacity)
    native._table = compiled.KeyTable(capacity, native._key)  # noqa: SLF001
    python._table = KeyTable(capacity, python._key)  # noqa: SLF001
    return native, python


def _rows(index: TierIndex) -> tuple:
    columns = [list(c) for c in (index._key, *index._columns())]  # noqa: SLF001
    return (columns, index._table.buckets(), index._rows, list(index._free),  # noqa: SLF001
            len(index), repr(index), index.evictable(), index.evictions,
            sorted((e.key, e.event_hash, e.parent_event_hash, e.parent_key, e.token_ids,
                    e.scope, e.resident, e.pins, e.tick) for e in index.entries()))


@needs_native
def test_the_row_flags_are_the_index_s() -> None:
    """The C file names the flags it writes; they are tiers/_entry.py's."""
    source = (__import__("pathlib").Path(_entry.__file__).parent / "_keytable_rows.c").read_text()
    for name, value in (("F_USED", _entry._USED), ("F_EH_NEG", _entry._EH_NEG),  # noqa: SLF001
                        ("F_PEH_NEG", _entry._PEH_NEG),  # noqa: SLF001
                        ("F_RESIDENT", _entry._RESIDENT),  # noqa: SLF001
                        ("F_QUEUED", _entry._QUEUED),  # noqa: SLF001
                        ("F_PEH_NONE", _entry._PEH_NONE)):  # noqa: SLF001
        assert f"#define {name} {value}\n" in source


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_compiled_row_writes_leave_the_index_as_the_python_ones(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([5, 16, 40, 97])
    width = 4
    native, python = _pair(capacity)
    chains: list[list[int]] = []
    evicted: tuple[list, list] = ([], [])
    held: list[tuple] = []
    runs: list[tuple] = []  # (native's entries, python's, the tokens): reserved, uncommitted
    next_key = 1
    for _ in range(60):
        op = rng.random()
        if op < 0.55 or not chains:
            n = rng.randint(1, 12)
            keys = list(range(next_key, next_key + n))
            if rng.random() < 0.05 and chains:
                keys[rng.randrange(n)] = rng.choice(chains)[0]  # a key that is here: refused
            next_key += n
            hashes = [rng.choice([-(1 << 63), -rng.getrandbits(62), rng.getrandbits(64), 0])
                      for _ in keys]
            if rng.random() < 0.2:  # a block reserved under its content key: unnamed
                unnamed = rng.randrange(n)
                hashes[unnamed] = keys[unnamed]
            tokens: list | tuple = [rng.getrandbits(31) for _ in range(n * width)]
            if rng.random() < 0.3:  # the int32 bounds (and a bool) fit the column
                tokens[rng.randrange(len(tokens))] = rng.choice([(1 << 31) - 1, -(1 << 31),
                                                                 True])
            if rng.random() < 0.1:  # past int32 either way: the Python way
                tokens[rng.randrange(len(tokens))] = rng.choice([1 << 40, 1 << 31,
                                                                 -(1 << 31) - 1])
            if rng.random() < 0.2:
                tokens = tuple(tokens)
            parent = rng.choice(chains)[-1] if chains and rng.random() < 0.6 else None
            parent_hash = None if parent is None or rng.random() < 0.2 else rng.choice(
                [rng.getrandbits(63), parent])  # (the parent's key: its name not known)
            scope = rng.choice([None, (None, None), (3, None), (None, 77)])
            results, made = [], []
            for k, index in enumerate((native, python)):
                if parent is not None and parent not in index:
                    results.append("no parent")
                    continue
                try:
                    entries = index.reserve_chain(
                        keys, hashes, parent_hash, tokens, width, parent,
                        lambda ix, slot, k=k: evicted[k].append(ix.evicting(slot)), scope)
                except RuntimeError as exc:
                    results.append(str(exc))
                    continue
                results.append([(e.key, e.slot) for e in entries])
                made.append(entries)
                if k == 0:
                    held.append(tuple(entries[:2]))
            assert results[0] == results[1]
            if isinstance(results[0], list) and results[0]:
                chains.append([key for key, _ in results[0]])
                runs.append((*made, list(tokens)))
        elif op < 0.7 and runs:  # a run every rank wrote: committed in one call
            run = runs.pop(rng.randrange(len(runs)))
            if rng.random() < 0.3:
                pinned = rng.randrange(len(run[0]))  # pinned meanwhile (a load's): no order
                for entry in (*run[0][:pinned], *run[1][:pinned]):
                    entry._index.pin(entry)  # noqa: SLF001
            stores = [index.commit_named(entries, run[2], width)
                      for index, entries in ((native, run[0]), (python, run[1]))]
            assert stores[0] == stores[1]
        elif op < 0.8:
            key = rng.choice(rng.choice(chains))
            for index in (native, python):
                entry = index.get(key)
                if entry is not None and entry.parent_key is None or (
                        entry is not None and index.get(entry.parent_key).resident):
                    index.commit(key)
        elif op < 0.85:  # the match's run: pinned, touched, out of the eviction order
            chain = rng.choice(chains)
            if rng.random() < 0.5:  # resident up to its leaf, which is then evictable
                for index in (native, python):
                    for key in chain:
                        entry = index.get(key)
                        if entry is None or not (entry.parent_key is None
                                                 or index.get(entry.parent_key).resident):
                            break
                        index.commit(key)
            start = rng.randrange(len(chain))
            keys = [rng.getrandbits(70), *chain] if rng.random() < 0.1 else chain
            stop = rng.randint(start, len(keys))
            taken = [index.take_resident(keys, start, stop) for index in (native, python)]
            assert [(e.key, e.slot) for e in taken[0]] == [(e.key, e.slot) for e in taken[1]]
            held.append(tuple(taken[0]))
        elif op < 0.9:
            key = rng.choice(rng.choice(chains))
            for index in (native, python):
                entry = index.lookup(key)
                if entry is not None:
                    index.pin(entry)
        else:
            key = rng.choice(rng.choice(chains))
            assert len(native.discard(key)) == len(python.discard(key))
        assert evicted[0] == evicted[1]
        assert _rows(native) == _rows(python)


@needs_native
def test_a_run_the_token_column_cannot_hold_is_not_written_by_the_compiled_loop() -> None:
    """``write_rows`` returns None and writes nothing when a token is not an int32 (past its
    range, or not an int): the index then writes the run the Python way."""
    native, _ = _pair(8)
    before = _rows(native)
    for bad in (1 << 31, -(1 << 31) - 1, 2.0, "3"):
        got = native._table.write_rows(  # noqa: SLF001
            [0, 1], [11, 12], [5, 6], -1, 0, _entry._PEH_NONE, [1, 2, 3, bad], 2,  # noqa: SLF001
            native._columns())  # noqa: SLF001
        assert got is None
        assert _rows(native) == before


@needs_native
@pytest.mark.parametrize("bad", [None, 3, 64, 100, 149])
def test_a_run_longer_than_the_warmed_chunk_and_a_bad_key_anywhere(bad: int | None) -> None:
    """The compiled run walk reads its keys 64 at a time (their lookups warmed together):
    over a 150-block chain it takes what the Python loop takes, stops where it stops, and a
    key that is no u64 int stops it (past 2**64) or raises (not an int) only when reached."""
    native, python = _pair(200)
    keys = [(1 << 40) + 7 * i for i in range(150)]
    for index in (native, python):
        index.reserve_chain(keys, keys, None, [1] * 4 * len(keys), 4, None,
                            lambda *_: None)
        for key in keys:
            index.commit(key)
    for odd, stop_at in ((1 << 64, None), ("x", TypeError)):
        run = list(keys)
        if bad is not None:
            run[bad] = odd
        outcomes = []
        for index in (native, python):
            try:
                outcomes.append([e.key for e in index.take_resident(run, 0, len(run))])
            except TypeError as exc:
                outcomes.append(type(exc))
        assert outcomes[0] == outcomes[1]
        if bad is None:
            assert outcomes[0] == keys
        elif stop_at is TypeError:
            assert outcomes[0] is TypeError
        else:
            assert outcomes[0] == keys[:bad]
        if bad is not None and bad > 100:  # a block not here at 100: the walk stops there
            stops_first = list(keys)
            stops_first[100], stops_first[bad] = 5, odd
            got = [[e.key for e in index.take_resident(stops_first, 0, 150)]
                   for index in (native, python)]
            assert got[0] == got[1] == keys[:100]
