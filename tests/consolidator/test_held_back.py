"""Prefix closure at scale: what a release, a cascade and a removal cost, the compiled loops
while blocks are held back, and the bound on what one source holds back.

Costs are counted, not timed: :func:`lines_run` counts the Python lines the consolidator's
modules execute for one call (a loop over N items runs its body N times), so a cost that grows
with everything held back or tracked shows as a count that grows with it. Both loop
implementations run where the compiled one is built.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator import core as core_module
from kvbm_plugin.consolidator.service import SOURCE_TIERS, ConsolidatorCore, KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    load_consolidator_config,
)

BS = 2
PACKAGE = str(Path(core_module.__file__).parent)
BUILT = _compiled.loops("consolidator", {}) is not None
IMPLEMENTATIONS = [False, True] if BUILT else [False]
needs_compiled = pytest.mark.skipif(not BUILT, reason="the compiled consolidator loops are not "
                                  "built")


def stored(hashes: list[int], parent: int | None = None, medium: str = "GPU",
           first_token: int | None = None) -> dict[str, Any]:
    base = hashes[0] if first_token is None else first_token
    tokens = [t for i in range(len(hashes)) for t in (base + i, base + i)]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "medium": medium}


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def lines_run(fn: Callable[[], object]) -> int:
    """Python lines executed in the consolidator package while ``fn()`` runs."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(PACKAGE) else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
    return count


def hold_back_orphans(core: ConsolidatorCore, count: int, base: int = 10**6) -> None:
    """``count`` blocks stored under parents no source knows: held back for good."""
    for i in range(count):
        core.apply_event(0, stored([base + i], parent=base * 10 + i))


def released_chain_cost(native: bool, orphans: int, length: int) -> tuple[int, ConsolidatorCore]:
    """Lines run by the store that publishes a parent a held-back chain of ``length`` waits for,
    with ``orphans`` unrelated blocks held back too."""
    core = ConsolidatorCore(native=native)
    hold_back_orphans(core, orphans)
    core.apply_event(0, stored([1, 2]))  # parent 1 with child 2
    core.apply_event(0, removed([1]))  # 1 leaves: its child is cut, 1 stays known
    chain = list(range(100, 100 + length))
    core.store(SOURCE_TIERS, "CPU", 0, chain, 1, stored(chain)["token_ids"], BS)
    assert core.stats()["blocks_held_back"] == orphans + 1 + length
    core.take_output()
    cost = lines_run(lambda: core.apply_event(0, stored([1])))
    out = core.take_output()[0]
    published = [h for event in out for h in event["block_hashes"]]
    assert published == [1, *chain]  # the parent, then the chain it released, in order
    return cost, core


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_a_release_costs_its_chain_not_what_else_is_held_back(native: bool) -> None:
    alone, _ = released_chain_cost(native, orphans=0, length=20)
    crowded, core = released_chain_cost(native, orphans=2000, length=20)
    assert crowded == alone  # the held-back index, not a scan of everything held back
    assert core.stats()["released_stores"] == 20
    longer, _ = released_chain_cost(native, orphans=0, length=80)
    assert longer < 4.5 * alone  # linear in the chain's length


def cascade_cost(native: bool, tracked: int, descendants: int) -> int:
    """Lines run by one removal of a block with ``descendants`` below it, ``tracked``
    unrelated blocks alongside."""
    core = ConsolidatorCore(native=native)
    for i in range(tracked):
        core.apply_event(0, stored([10**6 + i]))
    chain = list(range(1, descendants + 2))
    core.apply_event(0, stored(chain))
    core.take_output()
    cost = lines_run(lambda: core.apply_event(0, removed([1])))
    out = core.take_output()[0]
    assert out == [removed(list(reversed(chain)))]  # descendants first, in the same event
    assert core.stats()["cascade_removes"] == descendants
    return cost


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_a_cascade_costs_its_descendants_not_what_is_tracked(native: bool) -> None:
    few = cascade_cost(native, tracked=10, descendants=30)
    many = cascade_cost(native, tracked=3000, descendants=30)
    assert many == few  # walks the block's own children, never the rank's blocks
    assert cascade_cost(native, tracked=10, descendants=120) < 4.5 * few


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_the_cascade_walks_only_live_children(native: bool) -> None:
    """Children recorded per block follow collection: after the chain's tail goes, a cascade
    from its root names only what is left, and a branch point keeps both branches."""
    core = ConsolidatorCore(native=native)
    core.apply_event(0, stored([1, 2, 3]))
    core.apply_event(0, stored([4], parent=1))  # a second child of 1
    core.apply_event(0, removed([3]))  # leaf first: collected
    core.take_output()
    core.apply_event(0, removed([1]))
    (event,) = core.take_output()[0]
    assert event["block_hashes"][-1] == 1 and sorted(event["block_hashes"][:-1]) == [2, 4]
    rank = core._ranks[0]
    published = {b[1]: b for b in rank.blocks.values()}
    assert set(rank.hidden[0].entries) == {published[2][0], published[4][0]}


@needs_compiled
def test_the_compiled_loops_keep_running_while_blocks_are_held_back(monkeypatch) -> None:
    core = ConsolidatorCore(native=True)
    hold_back_orphans(core, 500)
    python_events: list[Any] = []
    original = core.apply_event
    monkeypatch.setattr(core, "apply_event",
                        lambda dp, raw, *a: (python_events.append(raw), original(dp, raw, *a)))
    batch = [stored([1, 2, 3]), stored([4, 5], parent=3), removed([5, 4]),
             stored([6], first_token=60), removed([6])]
    assert core.apply_events(0, batch, pytest.fail) == len(batch)
    assert python_events == []
    assert core.stats()["blocks_held_back"] == 500 and core.visible_hashes(0) == {1, 2, 3}
    # A store under a held-back block is the Python code's, and only that event; a removal
    # of one is finished by the Python loop from that hash on.
    rest: list[int] = []
    remove_rest = core._remove_rest
    monkeypatch.setattr(core, "_remove_rest",
                        lambda rank, held, hashes, start, wires: (
                            rest.append(start), remove_rest(rank, held, hashes, start, wires))[1])
    under = stored([8], parent=10**6 + 1, first_token=80)
    batch = [removed([7, 10**6]), under, stored([9], first_token=90)]
    core.apply_event(0, stored([7], first_token=70))
    python_events.clear()
    assert core.apply_events(0, batch, pytest.fail) == 3
    assert python_events == [under] and rest == [1]
    assert core.stats()["blocks_held_back"] == 500 and 9 in core.visible_hashes(0)


@needs_compiled
def test_a_leaf_first_removal_stays_in_the_compiled_loop(monkeypatch) -> None:
    """A chain removed leaf first (what every engine sends) never cascades: no block goes
    while it has a child, so no Python code runs for it."""
    core = ConsolidatorCore(native=True)
    core.apply_event(0, stored(list(range(1, 9))))
    calls: list[Any] = []
    for name in ("apply_event", "_remove_rest"):
        original = getattr(core, name)
        monkeypatch.setattr(core, name, lambda *a, _o=original, _n=name: (calls.append(_n),
                                                                          _o(*a))[1])
    assert core.apply_events(0, [removed(list(range(8, 0, -1)))], pytest.fail) == 1
    assert calls == [] and core.stats()["blocks_tracked"] == 0


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_what_one_source_holds_back_is_bounded_and_counted(native: bool) -> None:
    core = ConsolidatorCore(native=native, max_held_back=3)
    hold_back_orphans(core, 5)
    stats = core.stats()
    assert stats["held_back_stores"] == 3 and stats["held_back_dropped"] == 2
    assert stats["blocks_held_back"] == 3 and stats["blocks_held_back_engine"] == 3
    assert stats["blocks_tracked"] == 3  # a refused block is forgotten
    core.apply_event(0, removed([10**6 + 4]))  # a refused one: as if never stored
    assert core.stats()["unknown_removes"] == 1
    # The bound is per source: the tiers hold back their own.
    for i in range(3):
        core.store(SOURCE_TIERS, "CPU", 0, [500 + i], 9000 + i, [i, i], BS)
    stats = core.stats()
    assert stats["blocks_held_back_tiers"] == 3 and stats["held_back_dropped"] == 2
    assert core.take_output() == {}


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_a_chain_past_the_bound_is_refused_from_there_on(native: bool) -> None:
    """The part of a held-back chain within the bound is released with its parent; the rest
    was refused, so it is not, until a source stores it again."""
    core = ConsolidatorCore(native=native, max_held_back=2)
    core.apply_event(0, stored([1, 2]))
    core.apply_event(0, removed([1]))  # 2 is cut (not bounded: it was published)
    core.take_output()
    core.apply_event(0, stored([10, 11, 12, 13], parent=1))
    stats = core.stats()
    assert stats["held_back_dropped"] == 2 and stats["blocks_held_back"] == 3
    core.apply_event(0, stored([1]))
    assert core.visible_hashes(0) == {1, 10, 11}
    core.apply_event(0, stored([12, 13], parent=11, first_token=12))  # stored again
    assert core.visible_hashes(0) == {1, 10, 11, 12, 13}
    assert core.stats()["blocks_held_back"] == 1  # 2, cut, waits for its tokens


def test_a_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_held_back=-1"):
        ConsolidatorCore(max_held_back=-1)


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvh", dir="/tmp")  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_shell_logs_what_the_bound_refuses(ipc_dir, caplog) -> None:
    config = load_consolidator_config({EVENTS_ENDPOINT: f"ipc://{ipc_dir}/ev",
                                       OUTPUT_ENDPOINT: f"ipc://{ipc_dir}/out"})
    consolidator = KvEventConsolidator(config, max_held_back=1)
    consolidator.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvbm_plugin.consolidator.service"):
            for i in range(3):
                consolidator.register_store("CPU", 0, 100 + i, 900 + i, [i, i], BS)
            assert consolidator.wait_idle(10.0)
            stats = consolidator.stats()
    finally:
        consolidator.shutdown(5.0)
    assert stats["held_back_dropped"] == 2 and stats["blocks_held_back_tiers"] == 1
    lines = [r.getMessage() for r in caplog.records if "held-back bound" in r.getMessage()]
    assert lines and "held_back_dropped=" in lines[0] and "forgotten" in lines[0]
