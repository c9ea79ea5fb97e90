"""The tier index's views made in one call (``TierRows._views_of``): the compiled loop and
storage (``tiers/_entry_views.c``) against the Python loop and ``_EntryStorage``, their
reference. Each index hands out one view per slot while somebody holds it (``get(k) is
entry``), a new one once nobody does, and both forms do so on the same history.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.tiers import _entry
from kvbm_plugin.tiers._entry import TierEntry, _EntryStorage
from kvbm_plugin.tiers._rows import KeyTable
from kvbm_plugin.tiers.index import TierIndex

compiled = _compiled.loops("tier_keys", {})
needs_native = pytest.mark.skipif(compiled is None or not _entry.COMPILED_VIEWS,
                                  reason="the compiled views are not in use")


def _index(native: bool, capacity: int = 64) -> TierIndex:
    index = TierIndex("host", capacity)
    index._table = (compiled.KeyTable if native else KeyTable)(capacity, index._key)  # noqa: SLF001
    return index


def _history(index: TierIndex, seed: int) -> list[tuple]:
    """Random runs of slots viewed, views dropped and held: for each view handed out, the
    position of the earlier view it is (or None for a new one), its slot and its fields."""
    rng = random.Random(seed)
    held: list[TierEntry] = []
    out = []
    for _ in range(80):
        slots = [rng.randrange(24) for _ in range(rng.randint(0, 9))]
        views = index._views_of(slots)  # noqa: SLF001
        assert len(views) == len(slots)
        for slot, view in zip(slots, views, strict=True):
            same = next((k for k, h in enumerate(held) if h is view), None)
            out.append((same, slot, view.slot, view._index is index, view._snap))  # noqa: SLF001
        held.extend(views)
        if rng.random() < 0.4:  # some views dropped: their slots get new ones next time
            del held[:rng.randrange(len(held) + 1)]
            held = [h for h in held if rng.random() < 0.7]
            held = [h for k, h in enumerate(held) if h not in held[:k]]
    return out


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_compiled_views_are_handed_out_as_the_python_loop_hands_them_out(seed: int) -> None:
    native, python = _index(True), _index(False)
    assert _history(native, seed) == _history(python, seed)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_a_held_view_is_the_one_view_of_its_slot_and_a_dropped_one_is_replaced(
        native: bool) -> None:
    index = _index(native)
    first = index._views_of([3, 5, 3])  # noqa: SLF001
    assert first[0] is first[2] and first[0] is not first[1]
    again = index._views_of([5])  # noqa: SLF001
    assert again[0] is first[1]
    dead = weakref.ref(first[1])
    del first, again
    gc.collect()
    assert dead() is None
    fresh = index._views_of([5])[0]  # noqa: SLF001
    assert fresh.slot == 5 and fresh._snap is None and fresh._index is index  # noqa: SLF001


@needs_native
def test_the_compiled_storage_behaves_as_the_python_one() -> None:
    """Made by ``TierEntry(index, slot)`` or the loop, its three fields read, written and
    deleted like the Python slots, weakly referable, collected in a cycle."""
    assert TierEntry.__mro__[1] is compiled.EntryStorage
    for cls in (TierEntry, _EntryStorage):
        view = cls("ix", 7)
        assert (view._index, view.slot, view._snap) == ("ix", 7, None)  # noqa: SLF001
        view._snap = [1, 2]  # noqa: SLF001
        assert view._snap == [1, 2]  # noqa: SLF001
        del view._snap  # noqa: SLF001
        with pytest.raises(AttributeError):
            view._snap  # noqa: B018, SLF001
        with pytest.raises(AttributeError):
            view.other = 1  # type: ignore[attr-defined]
        assert weakref.ref(view)() is view
        with pytest.raises(TypeError):
            cls("ix")  # type: ignore[call-arg]
    cyclic = TierEntry("ix", 1)
    cyclic._snap = [cyclic]  # noqa: SLF001
    assert gc.is_tracked(cyclic)
    dead = weakref.ref(cyclic)
    del cyclic
    gc.collect()
    assert dead() is None


@needs_native
def test_the_compiled_loop_refuses_what_it_cannot_make() -> None:
    index = _index(True)
    views_of = index._table.views_of  # noqa: SLF001

    class Wider(TierEntry):
        __slots__ = ("extra",)

    for args in (({}, (1, 2), TierEntry, index), ([], [1], TierEntry, index),
                 ({}, [1], _EntryStorage, index), ({}, [1], Wider, index),
                 ({}, [1], int, index), ({1: "not a weakref"}, [1], TierEntry, index)):
        with pytest.raises(TypeError):
            views_of(*args)
    with pytest.raises(TypeError):
        views_of({}, [1], TierEntry)
