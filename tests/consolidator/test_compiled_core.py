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

import msgpack
import pytest
from _depth import depths, run_examples
from hypothesis import strategies as st

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator.service import SOURCE_ENGINE, SOURCE_TIERS, ConsolidatorCore
from kvbm_plugin.wire.events import MAX_DP_RANKS, WireFormatError

BS = 2
WRAPS_TO_2 = ((1 << 64) + 2) // 3  # 3 * this = 2**64 + 2: 2 in a wrapping 64-bit product
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
                 "token_ids": tokens, "block_size": BS,
                 "lora_id": draw(st.sampled_from([None] * 6 + [0, 3])),
                 "medium": draw(MEDIA), "lora_name": None}
        if draw(st.integers(0, 7)) == 0:  # extra keys (multimodal, salt): part of identity
            event["extra_keys"] = [draw(st.sampled_from([None, ["salt:01"], ["mm", "salt:02"]]))
                                   for _ in range(n)]
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
    if draw(st.integers(0, 9)) == 0:  # a dp rank the core refuses
        return "batch", (draw(st.sampled_from([-1, MAX_DP_RANKS, 1 << 40])),
                         [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}])
    bad = draw(st.sampled_from([
        {"type": "BlockStored", "block_hashes": [1, "x"], "parent_block_hash": None,
         "token_ids": [0, 0, 0, 0], "block_size": BS, "medium": "GPU"},
        # values the output encoder or the router cannot take
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, msgpack.Timestamp(1, 0)], "block_size": BS, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, 1 << 32], "block_size": BS, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, -1], "block_size": BS, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, True], "block_size": BS, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, 0], "block_size": BS, "medium": "GPU",
         "lora_id": msgpack.ExtType(1, b"")},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, 0], "block_size": BS, "medium": "GPU", "lora_id": -1},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, 0], "block_size": BS, "medium": "GPU", "lora_name": 3},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": [0, 0], "block_size": BS, "medium": "GPU", "lora_id": 3,
         "lora_name": "a"},  # valid
        # n * block_size beyond the C integer range: wraps to 0 and to 2 tokens
        {"type": "BlockStored", "block_hashes": [1, 2, 3, 4], "parent_block_hash": None,
         "token_ids": [], "block_size": 1 << 62, "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [1, 2, 3], "parent_block_hash": None,
         "token_ids": [0, 0], "block_size": WRAPS_TO_2, "medium": "GPU"},
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
        # Invariant: no two live blocks publish one hash.
        assert len({b[1] for b in rank.blocks.values()}) == len(rank.blocks)
        out[dp] = (
            {k: show(b) for k, b in rank.blocks.items()},
            [{h: b[0] for h, b in m.items()} for m in rank.known],
            [{h: b[0] for h, b in m.items()} for m in rank.held],
            {b[1]: b[0] for b in rank.blocks.values()},  # published hash -> identity
            {h: b[0] for h, b in rank.unlisted.items()},
            rank.visible,
            [({k: (e[0][0], e[1:]) for k, e in group.entries.items()}, group.waiting,
              group.by_source) for group in rank.hidden],
            {k for k in rank.orphans if k in rank.blocks},
        )
    return out


needs_compiled = pytest.mark.skipif(_compiled.loops("consolidator", {}) is None,
                                  reason="kvbm_plugin._consolidator_c was not built")


@needs_compiled
@depths(quick=80, thorough=500)
def test_compiled_dedup_loops_match_python_loops(examples: int) -> None:
    run_examples(examples, _loops_agree, st.lists(op(), min_size=1, max_size=40))


def _loops_agree(steps: list[tuple[str, Any]]) -> None:
    python, compiled = ConsolidatorCore(native=False), ConsolidatorCore(native=True)
    assert python._compiled is None and compiled._compiled is not None
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
    # Prefix closure: a middle block removed first cascades its descendants (Python), and
    # events touching a held-back block are decided by the Python code.
    "middle block removed, descendants cascade": [
        ("store", (0, stored([1, 2, 3], [1, 1, 2, 2, 3, 3]))),
        ("batch", (0, [removed([2]), stored([4], [4, 4], parent=3), removed([3])])),
        ("store", (0, stored([2], [2, 2], parent=1)))],
    # A store under a parent no source knows is held back; under a known but unpublished
    # parent it is released when the parent comes back.
    "held back and released": [
        ("store", (0, stored([5], [5, 5], parent=99))),
        ("store", (0, stored([1], [1, 1]))), ("remove", (0, removed([1]))),
        ("register", ("CPU", 0, 6, 1, [6, 6])),
        ("store", (0, stored([1], [1, 1])))],
    # A hash repeated along one chain: the compiled loop leaves the chain to Python.
    "hash repeated along a chain": [("store", (0, stored([1, 1], [0, 0, 0, 0])))],
    # While a block is held back the compiled loops go on; a removal reaching a held-back
    # block, or one that cascades, is finished by the Python loop from that hash on.
    "removal stops at a held-back block": [
        ("store", (0, stored([5], [5, 5], parent=99))),
        ("store", (0, stored([1, 2], [1, 1, 2, 2]))),
        ("batch", (0, [removed([2, 5, 1]), stored([7], [7, 7])]))],
    "removal cascades part-way through its event": [
        ("store", (0, stored([1, 2, 3], [1, 1, 2, 2, 3, 3]))),
        ("store", (0, stored([4], [4, 4]))),
        ("batch", (0, [removed([4, 1, 3]), stored([6], [6, 6])]))],
    "stores under and beside a held-back block": [
        ("store", (0, stored([5], [5, 5], parent=99))),
        ("batch", (0, [stored([6], [6, 6], parent=5), stored([7, 8], [7, 7, 8, 8]),
                       stored([9], [9, 9], parent=8)]))],
    # Adapter task 0 is an adapter: its block is not the base model's block of the same
    # tokens, whichever loop takes the store (a falsy lora_id must not read as "none").
    "adapter 0 beside the base model": [
        ("batch", (0, [stored([1], [5, 6]), {**stored([2], [5, 6]), "lora_id": 0},
                       {**stored([3], [5, 6]), "lora_name": "lora-7"}]))],
    "a cut chain stored again": [
        ("store", (0, stored([1, 2, 3], [1, 1, 2, 2, 3, 3]))), ("remove", (0, removed([1]))),
        ("store", (0, stored([1], [1, 1]))),
        ("batch", (0, [stored([1, 2, 3], [1, 1, 2, 2, 3, 3]), stored([4], [4, 4], parent=3)]))],
}


@needs_compiled
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_compiled_loops_match_on_the_rare_branches(name: str) -> None:
    python, compiled = ConsolidatorCore(native=False), ConsolidatorCore(native=True)
    outputs = []
    for step in SCENARIOS[name]:
        result = apply(compiled, step)
        assert result == apply(python, step)
        assert result == "ok" or result.endswith("errors []")
        out = compiled.take_output()
        assert out == python.take_output()
        assert state(compiled) == state(python)
        outputs.append(out)
    assert any(outputs)


@needs_compiled
def test_compiled_blocks_stay_out_of_the_cyclic_collector() -> None:
    import gc

    compiled, python = ConsolidatorCore(native=True), ConsolidatorCore(native=False)
    event = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
             "token_ids": [1, 2, 3, 4], "block_size": BS, "medium": "GPU"}
    for core in (compiled, python):
        core.apply_event(0, dict(event))
    assert not any(gc.is_tracked(b) for b in compiled._ranks[0].blocks.values())
    assert all(gc.is_tracked(b) for b in python._ranks[0].blocks.values())


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_compiled)])
def test_a_hash_within_int64_is_one_int_object_per_block(native: bool) -> None:
    """The published hash and its wire form are the same object when they are equal (a
    second int per block would be heap per block); a hash above INT64_MAX gets its signed
    form."""
    from kvbm_plugin.consolidator.blocks import PUB, WIRE

    core = ConsolidatorCore(native=native)
    core.store(SOURCE_TIERS, "DISK", 0, [12345678901234567, (1 << 64) - 3], None,
               [1, 2, 3, 4], BS)
    core.apply_event(0, {"type": "BlockStored", "block_hashes": [98765432109876543],
                         "parent_block_hash": None, "token_ids": [5, 6], "block_size": BS,
                         "medium": "GPU"})
    blocks = {b[PUB]: b for b in core._ranks[0].blocks.values()}
    assert blocks[12345678901234567][WIRE] is blocks[12345678901234567][PUB]
    assert blocks[98765432109876543][WIRE] is blocks[98765432109876543][PUB]
    assert blocks[(1 << 64) - 3][WIRE] == -3


@needs_compiled
def test_compiled_blocks_are_compact_and_free_a_long_chain_without_recursion() -> None:
    """A compiled core's blocks: the list layout's items in one 96-byte object (a list of 12
    items costs 152), read and written like the list; a chain of 300,000 of them (each
    holding its parent) is freed in a loop: recursion that deep would overflow the C stack."""
    import sys

    from kvbm_plugin.consolidator.blocks import BLOCK_LEN, HELD_BACK, PARENT, TOTAL, slot_of
    from kvbm_plugin.wire.events import MEDIA, MEDIUM_DISK

    core = ConsolidatorCore(native=True)
    n = 300_000
    core.store(SOURCE_TIERS, "DISK", 0, list(range(1, n + 1)), None, [7] * n, 1)
    disk = slot_of(SOURCE_TIERS, MEDIA.index(MEDIUM_DISK))
    leaf = core._ranks[0].held[disk][n]
    assert type(leaf) is not list and len(leaf) == BLOCK_LEN and sys.getsizeof(leaf) <= 96
    assert leaf[TOTAL] == 1 and leaf[PARENT] is core._ranks[0].held[disk][n - 1]
    leaf[HELD_BACK] += 1
    assert leaf[HELD_BACK] == 1 and leaf[-1] == 1 and list(leaf[-2:]) == [None, 1]
    leaf[HELD_BACK] -= 1
    with pytest.raises(IndexError):
        leaf[BLOCK_LEN]  # noqa: B018 - the item raises
    with pytest.raises(OverflowError):
        leaf[TOTAL] = 1 << 40
    del leaf, core  # frees the whole chain, leaf first


def test_passthrough_mode_keeps_the_python_loops() -> None:
    assert ConsolidatorCore("passthrough", native=None)._compiled is None


def test_native_true_without_the_extension_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_compiled._built, "consolidator", None)
    with pytest.raises(ValueError, match="native=True"):
        ConsolidatorCore(native=True)
    assert ConsolidatorCore()._compiled is None
    assert SOURCE_ENGINE == 0


class Collides:
    """A dict key (or medium) with the hash of ``name``: a lookup that probes it runs this
    object's ``__eq__`` (``on_eq``, armed after the event is built)."""

    def __init__(self, name: str, equal: bool = False) -> None:
        self.name = name
        self.equal = equal
        self.on_eq: Any = None

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        if self.on_eq is not None:
            self.on_eq()
        return other is self or (self.equal and other == self.name)

    def __repr__(self) -> str:
        return f"Collides({self.name!r})"


def run_both(make: Any) -> list[str]:
    """Both cores (their rank already created) apply ``make()``'s batch (fresh input each);
    output, counters and state must agree. Returns the apply results."""
    results, outputs, states, stats = [], [], [], []
    for native in (False, True):
        core = ConsolidatorCore(native=native)
        core.apply_event(0, stored([50], [5, 5]))
        results.append(apply(core, ("batch", (0, make()))))
        outputs.append(core.take_output())
        states.append(state(core))
        stats.append(core.stats())
    assert results[1] == results[0]
    assert outputs[1] == outputs[0]
    assert states[1] == states[0]
    assert stats[1] == stats[0]
    return results


@needs_compiled
def test_a_key_whose_eq_changes_the_event_runs_the_same_in_both_loops() -> None:
    """A caller's key object in an event map whose ``__eq__`` changes the map when a lookup
    probes it: the compiled loop must not look up in such a map (it holds the fields it read
    borrowed, and it reads them in another order: here block_size before token_ids) but leave
    the event to the Python code."""
    def make() -> list[Any]:
        key = Collides("block_size")
        event: dict[Any, Any] = {key: 0}
        event.update(stored([1], [1, 1], parent=50))
        key.on_eq = lambda: event.__setitem__("token_ids", [9, 9])
        return [event, stored([2], [2, 2], parent=1)]

    assert run_both(make)[0] == "2 applied, errors []"


@needs_compiled
@pytest.mark.parametrize("name", ["type", "block_hashes", "medium", "token_ids"])
def test_a_key_whose_eq_frees_what_the_loop_holds_runs_the_same_in_both_loops(name: str
                                                                              ) -> None:
    """The same with an ``__eq__`` that empties the batch list and the map (a use-after-free
    if the compiled loop looked up in it)."""
    def make() -> list[Any]:
        key = Collides(name)
        event: dict[Any, Any] = {key: 0}
        event.update(stored([1], [1, 1], parent=50))
        events = [stored([3], [3, 3]), event, stored([2], [2, 2], parent=1)]

        def wreck() -> None:
            events.clear()
            event.clear()

        key.on_eq = wreck
        return events

    run_both(make)


@needs_compiled
def test_a_medium_whose_eq_changes_the_event_runs_the_same_in_both_loops() -> None:
    """A medium object equal to "GPU" whose ``__eq__`` empties the event's token list while
    the medium is looked up: the compiled loop looks up only str media."""
    def make() -> list[Any]:
        medium = Collides("GPU", equal=True)
        event = stored([1], [1, 1], parent=50, medium=medium)  # type: ignore[arg-type]
        medium.on_eq = event["token_ids"].clear
        return [event]

    run_both(make)


@needs_compiled
@pytest.mark.parametrize("n, block_size, tokens", [
    (4, 1 << 62, []), (3, WRAPS_TO_2, [0, 0]), (2, 1 << 63, [0] * 4), (1, 1 << 64, [0, 0])])
def test_a_huge_block_size_runs_the_same_in_both_loops(n: int, block_size: int,
                                                       tokens: list[int]) -> None:
    """``n * block_size`` beyond the C integer range must not wrap to the token count."""
    def make() -> list[Any]:
        return [{"type": "BlockStored", "block_hashes": list(range(1, n + 1)),
                 "parent_block_hash": None, "token_ids": tokens, "block_size": block_size,
                 "medium": "GPU"}, stored([2], [2, 2])]

    run_both(make)
