"""The compiled dedup block loops against the Python ones: same output, counters and state.

Hypothesis draws sequences of engine events and tier registrations over a tiny universe of
hashes and contents, so that the rare branches are common: a hash reused for other content
(release of the previous block, derived published hash), one block under two hashes (aliases),
unknown parents, hash-only stores, signed and unsigned forms, clears and resyncs, two dp ranks,
malformed and unhashable input. Both cores take the same sequence; after every step their
output, counters, visible sets and internal maps must be equal.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbm_plugin import _native
from kvbm_plugin.consolidator import SOURCE_ENGINE, SOURCE_TIERS, ConsolidatorCore
from kvbm_plugin.events import WireFormatError

BS = 2
HASHES = st.sampled_from([1, 2, 3, 4, 5, (1 << 64) - 1, -1, 1 << 63])
TOKEN = st.sampled_from([0, 1, 2])
MEDIA = st.sampled_from(["GPU", "gpu", "CPU", "DISK"])


@st.composite
def op(draw: st.DrawFn) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["store"] * 5 + ["register"] * 3 + ["remove"] * 3
                                + ["unregister"] * 2 + ["batch"] * 4
                                + ["clear", "resync", "bad"]))
    if kind == "batch":  # one input batch: ConsolidatorCore.apply_events
        dp = draw(st.integers(0, 1))
        events = [draw(op().filter(lambda o: o[0] in ("store", "remove", "bad")))[1][1]
                  for _ in range(draw(st.integers(1, 5)))]
        if draw(st.integers(0, 9)) == 0:
            events.insert(draw(st.integers(0, len(events))), {"type": "AllBlocksCleared"})
        return kind, (dp, events)
    dp = draw(st.integers(0, 1))
    if kind in ("store", "register"):
        n = draw(st.integers(1, 3))
        hashes = [draw(HASHES) for _ in range(n)]
        tokens: list[Any] = [draw(TOKEN) for _ in range(n * BS)]
        if draw(st.integers(0, 19)) == 0:
            tokens = []  # hash-only store
        parent = draw(st.one_of(st.none(), HASHES))
        if kind == "register":
            tier = draw(st.sampled_from(["CPU", "DISK"]))
            return kind, (tier, dp, hashes[0], parent, tokens[:BS] or [0] * BS)
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                 "token_ids": tokens, "block_size": BS, "lora_id": None,
                 "medium": draw(MEDIA), "lora_name": None}
        return kind, (dp, event)
    if kind in ("remove", "unregister"):
        hashes = draw(st.lists(HASHES, min_size=1, max_size=4))
        if kind == "unregister":
            return kind, (draw(st.sampled_from(["CPU", "DISK"])), dp, hashes)
        return kind, (dp, {"type": "BlockRemoved", "block_hashes": hashes,
                           "medium": draw(MEDIA)})
    if kind == "clear":
        return kind, (dp, draw(st.sampled_from([None, "CPU", "DISK"])))
    if kind == "resync":
        return kind, (dp,)
    bad = draw(st.sampled_from([
        {"type": "BlockStored", "block_hashes": [1, "x"], "parent_block_hash": None,
         "token_ids": [0, 0, 0, 0], "block_size": BS, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [[0], 1], "block_size": BS, "medium": "GPU"},  # unhashable token
        {"type": "BlockRemoved", "block_hashes": [2, None], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": (3, 4), "medium": "GPU"},
    ]))
    return kind, (dp, bad)


def apply(core: ConsolidatorCore, step: tuple[str, Any]) -> str:
    kind, args = step
    if kind == "batch":
        errors: list[str] = []
        applied = core.apply_events(args[0], args[1], lambda exc: errors.append(str(exc)))
        return f"{applied} applied, errors {errors}"
    try:
        if kind in ("store", "remove", "bad"):
            core.apply_event(args[0], args[1])
        elif kind == "register":
            tier, dp, h, parent, tokens = args
            core.store(SOURCE_TIERS, tier, dp, [h], parent, tokens, BS)
        elif kind == "unregister":
            core.remove(SOURCE_TIERS, *args)
        elif kind == "clear":
            dp, tier = args
            if tier is None:
                core.apply_event(dp, {"type": "AllBlocksCleared"})
            else:
                core.clear(SOURCE_TIERS, tier, dp)
        else:
            core.resync(args[0])
    except (WireFormatError, TypeError) as exc:
        return type(exc).__name__
    return "ok"


def state(core: ConsolidatorCore) -> dict[int, Any]:
    """Every rank's maps, blocks by identity (a block list shows its parent by identity)."""
    def show(block: list[Any] | None) -> Any:
        if block is None:
            return None
        return (block[0], block[1], block[2], block[3] and block[3][0], *block[4:])

    out = {}
    for dp, rank in core._ranks.items():
        out[dp] = (
            {k: show(b) for k, b in rank.blocks.items()},
            [{h: b[0] for h, b in m.items()} for m in rank.known],
            [{h: b[0] for h, b in m.items()} for m in rank.held],
            {h: b[0] for h, b in rank.published.items()},
            rank.visible,
        )
    return out


needs_native = pytest.mark.skipif(_native.loops("consolidator", {}) is None,
                                  reason="kvbm_plugin._consolidator_c was not built")


@needs_native
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op(), min_size=1, max_size=40))
def test_compiled_dedup_loops_match_python_loops(steps: list[tuple[str, Any]]) -> None:
    python, compiled = ConsolidatorCore(native=False), ConsolidatorCore(native=True)
    assert python._native is None and compiled._native is not None
    for step in steps:
        assert apply(compiled, step) == apply(python, step)
        assert compiled.take_output() == python.take_output()
        assert compiled.stats() == python.stats()
        assert state(compiled) == state(python)
        for dp in (0, 1):
            assert compiled.visible_hashes(dp) == python.visible_hashes(dp)


def stored(hashes: list[int], tokens: list[int], medium: str = "GPU",
           parent: int | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "medium": medium}


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


SCENARIOS = {
    # One block under two hashes (engine and disk); the second alias must go with it.
    "alias forgotten on the last removal": [
        ("store", (0, stored([1], [5, 6]))), ("register", ("DISK", 0, 2, None, [5, 6])),
        ("remove", (0, removed([1]))), ("unregister", ("DISK", 0, [2]))],
    # The middle block of a chain is visible already: the chain's output is two runs.
    "run broken by an already visible block": [
        ("store", (0, stored([1, 2], [1, 1, 2, 2], medium="CPU"))),
        ("remove", (0, removed([1], medium="CPU"))),
        ("store", (0, stored([1, 2, 3], [1, 1, 2, 2, 3, 3])))],
    # A hash that named other content in the slot: released mid-chain, REMOVE in between.
    "hash reused for other content": [
        ("store", (0, stored([7], [9, 9]))),
        ("store", (0, stored([6, 7], [1, 1, 2, 2])))],
    # The same hash for other content in another slot: a derived published hash.
    "published hash clash": [
        ("store", (0, stored([7], [9, 9]))), ("register", ("CPU", 0, 7, None, [8, 8]))],
}


@needs_native
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_compiled_loops_match_on_the_rare_branches(name: str) -> None:
    python, compiled = ConsolidatorCore(native=False), ConsolidatorCore(native=True)
    outputs = []
    for step in SCENARIOS[name]:
        assert apply(compiled, step) == apply(python, step) == "ok"
        out = compiled.take_output()
        assert out == python.take_output()
        assert state(compiled) == state(python)
        outputs.append(out)
    assert any(outputs)


@needs_native
def test_compiled_blocks_stay_out_of_the_cyclic_collector() -> None:
    import gc

    compiled, python = ConsolidatorCore(native=True), ConsolidatorCore(native=False)
    event = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": BS, "medium": "GPU"}
    for core in (compiled, python):
        core.apply_event(0, dict(event))
    assert not any(gc.is_tracked(b) for b in compiled._ranks[0].blocks.values())
    assert all(gc.is_tracked(b) for b in python._ranks[0].blocks.values())


def test_passthrough_mode_keeps_the_python_loops() -> None:
    assert ConsolidatorCore("passthrough", native=None)._native is None


def test_native_true_without_the_extension_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_native._built, "consolidator", None)
    with pytest.raises(ValueError, match="native=True"):
        ConsolidatorCore(native=True)
    assert ConsolidatorCore()._native is None
    assert SOURCE_ENGINE == 0
