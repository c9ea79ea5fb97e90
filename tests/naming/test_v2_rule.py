"""The leader's V2 names where TensorRT-LLM's own stream is the source (``BlockNaming.v2_extend``):
computed for every request, used only once the stream named one block as computed, dropped for
good where the stream names a block otherwise under an agreeing parent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbm_plugin.consolidator.engine_forms import WireScopes
from kvbm_plugin.leader.requests import RequestState
from kvbm_plugin.naming.names import BlockNaming, name_inputs
from kvbm_plugin.wire.identity import cache_salt_id

BS = 4


def _naming() -> tuple[BlockNaming, WireScopes, dict[str, int]]:
    stats: dict[str, int] = {}
    naming = BlockNaming(BS, stats)
    naming.salt_blind = naming.v2_stream = True  # as the leader sets them for that stream
    naming.scope_sink = WireScopes()
    return naming, naming.scope_sink, stats


def _state(req_id: int, tokens: list[int], salt: str | None = None) -> RequestState:
    obj = SimpleNamespace(cache_salt=salt, lora_task_id=None)
    return RequestState(req_id, scope=(None, None if salt is None else cache_salt_id(salt)),
                        tokens=list(tokens), keys=[req_id * 100 + i for i in range(2)],
                        name_inputs=name_inputs(obj))


def _stored(hashes: list[int], tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lora_id": None}


def _head(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


@pytest.mark.parametrize("width", [8, 4])
def test_computed_names_are_used_once_the_stream_confirms_them(width: int) -> None:
    naming, scopes, stats = _naming()
    tokens = list(range(1, 9))
    plain, salted = _state(1, tokens), _state(2, tokens, salt="tenant-A")
    for state in (plain, salted):
        naming.v2_extend(state)
    # computed under both token widths until the stream shows which one the engine uses
    assert sorted(plain.v2_keys) == [4, 8]
    assert len(plain.v2_keys[width]) == len(salted.v2_keys[width]) == 2
    assert plain.v2_keys[width] != salted.v2_keys[width] and plain.v2_keys[4] != plain.v2_keys[8]
    assert stats["v2_names_computed"] == 4  # blocks, not blocks x widths
    assert len(scopes) == 8  # the salted blocks only, under both truncations and widths
    assert naming.hash_of(salted, 0) is None  # not confirmed yet: it waits
    naming.names.observe(0, [_stored([_head(k) for k in plain.v2_keys[width]], tokens)])
    naming.refresh([plain, salted])
    assert naming.v2_wire == ("head", width)
    assert naming.hash_of(plain, 1) == _head(plain.v2_keys[width][1])
    # the salt's rule is used only once TensorRT-LLM stored a block under it (a revision
    # deriving the salt otherwise never names a tier copy)
    assert naming.hash_of(salted, 1) is None
    assert naming.names.hash_of_key(salted.keys[0]) is None
    naming.names.observe(0, [_stored([_head(salted.v2_keys[width][0])], tokens[:BS])])
    naming.refresh([plain])  # the salted request is gone by then: its blocks still get named
    assert naming.hash_of(salted, 1) == _head(salted.v2_keys[width][1])
    # a tier block that waits under its content key is named by the computed name
    assert naming.names.hash_of_key(salted.keys[1]) == _head(salted.v2_keys[width][1])
    # once the width is known, only it is computed (and the other one is dropped)
    more = _state(3, list(range(20, 28)), salt="tenant-A")
    naming.v2_extend(more)
    assert sorted(more.v2_keys) == [width]
    assert naming.hash_of(more, 1) == _head(more.v2_keys[width][1])


@pytest.mark.parametrize("width", [8, 4])
def test_a_stream_that_names_a_block_otherwise_turns_the_computed_names_off(
        expect_errors, width: int) -> None:
    naming, _, stats = _naming()
    tokens = list(range(1, 9))
    plain, salted = _state(1, tokens), _state(2, tokens, salt="tenant-A")
    for state in (plain, salted):
        naming.v2_extend(state)
    naming.names.observe(0, [_stored([_head(plain.v2_keys[width][0]), 12345], tokens)])
    naming.refresh([plain, salted])
    assert naming.v2_refuted and naming.v2_wire is None
    assert stats["v2_rule_mismatches"] == 1
    assert naming.hash_of(salted, 0) is None  # salted blocks wait for a name again
    more = _state(3, list(range(9, 17)), salt="tenant-B")
    naming.v2_extend(more)
    assert more.v2_keys == {}  # nothing computed once refuted
    assert any("not the V2 radix key the leader computed" in m
               for m in expect_errors.messages())  # logged once, at ERROR
