"""The event sink names the LoRA adapter of stores whose events name none (TensorRT-LLM's
serializer writes no ``lora_id``): the leader names each request's first block, a chain takes
its parent's adapter, and a chain nobody named is withheld and counted, never guessed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from _loops import both_implementations
from test_event_sink import Capture, removed, sink_with, stored

from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.naming.names import LoraNames

ingest_loop = both_implementations("event_sink")  # every test: compiled and Python loops

SYS = [11, 12]


def names(cap: Any) -> dict[int, tuple[Any, Any]]:
    """Each published block's (lora_id, lora_name), over every batch; a block published twice
    under different names fails."""
    out: dict[int, tuple[Any, Any]] = {}
    for _, events in cap.batches:
        for e in events:
            if type(e).__name__ == "BlockStored":
                for h in e.block_hashes:
                    assert out.setdefault(h, (e.lora_id, e.lora_name)) == (e.lora_id,
                                                                            e.lora_name)
    return out


def removed_hashes(cap: Any) -> list[int]:
    return [h for _, events in cap.batches for e in events
            if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]


@pytest.mark.parametrize("closed", [True, False])
def test_adapter_stores_are_named_by_their_root_and_parent(closed: bool) -> None:
    sink, cap = sink_with(prefix_closed=closed)
    # Base model, adapter 0 and adapter 1 with the same tokens: three chains for TRT-LLM.
    for root, task in ((100, None), (200, 0), (300, 1)):
        sink.name_lora_root(root, task)
    sink.ingest([stored(None, (100, SYS)), stored(None, (200, SYS)), stored(None, (300, SYS))])
    sink.flush()
    # The decode steady state: one-block stores under a parent (the compiled loop's case).
    sink.ingest([stored(100, (101, [13, 14])), stored(200, (201, [13, 14])),
                 stored(300, (301, [13, 14])), stored(301, (302, [15, 16]), (303, [17, 18]))])
    sink.flush()
    assert names(cap) == {
        100: (None, None), 101: (None, None),
        200: (0, "lora-0"), 201: (0, "lora-0"),
        300: (1, "lora-1"), 301: (1, "lora-1"), 302: (1, "lora-1"), 303: (1, "lora-1")}
    stats = sink.stats()
    assert stats["lora_named_blocks"] == 6
    assert stats["lora_unnamed_blocks"] == 0


def test_a_removed_adapter_block_stored_again_is_named_again() -> None:
    sink, cap = sink_with(prefix_closed=True)
    sink.name_lora_root(200, 0)
    sink.ingest([stored(None, (200, SYS), (201, [13, 14]))])
    sink.ingest([removed(201), removed(200)])
    sink.ingest([stored(None, (200, SYS)), stored(200, (201, [13, 14]))])
    sink.flush()
    assert names(cap) == {200: (0, "lora-0"), 201: (0, "lora-0")}
    assert removed_hashes(cap) == [201, 200]
    stored_runs = [e for _, evs in cap.batches for e in evs if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored_runs) == 4


def test_a_chain_nobody_named_is_withheld_with_its_removals_and_counted() -> None:
    sink, cap = sink_with(prefix_closed=True)
    sink.name_lora_root(200, 0)  # an adapter was seen: an unnamed root may be anyone's
    sink.ingest([stored(None, (500, SYS)), stored(500, (501, [13, 14])),
                 stored(None, (200, SYS))])
    sink.ingest([removed(501, 500), removed(200)])
    sink.flush()
    assert names(cap) == {200: (0, "lora-0")}
    assert removed_hashes(cap) == [200]
    stats = sink.stats()
    assert stats["lora_unnamed_blocks"] == 2
    assert stats["lora_unnamed_removes"] == 2
    assert stats["orphan_stores_dropped"] == 0  # withheld, not lost
    assert stats["unknown_removes_suppressed"] == 0


def test_events_that_name_their_adapter_are_trusted_and_inherited() -> None:
    sink, cap = sink_with(prefix_closed=True)
    sink.name_lora_root(100, None)
    sink.name_lora_root(900, 9)  # what the leader says is overridden by the event itself
    named = stored(None, (700, SYS))
    named["data"]["blocks"][0]["lora_id"] = 7  # a serializer that writes it, per block
    sink.ingest([named, stored(700, (701, [13, 14])), stored(None, (100, SYS))])
    sink.flush()
    assert names(cap) == {700: (7, "lora-7"), 701: (7, "lora-7"), 100: (None, None)}


def test_nothing_is_annotated_before_an_adapter_and_the_callers_dicts_stay() -> None:
    sink, cap = sink_with(prefix_closed=True)
    sink.name_lora_root(100, None)
    events = [stored(None, (500, SYS)), stored(None, (100, SYS))]
    sink.ingest(events)
    sink.name_lora_root(200, 0)
    later = [stored(None, (200, SYS)), stored(200, (201, [13, 14]))]
    before = copy.deepcopy(later)
    sink.ingest(later)
    sink.flush()
    assert later == before  # annotated copies, not the caller's dicts
    assert names(cap) == {500: (None, None), 100: (None, None), 200: (0, "lora-0"),
                          201: (0, "lora-0")}


def test_dp_ranks_keep_their_own_adapter_blocks() -> None:
    sink, cap = sink_with(prefix_closed=True, max_dp_ranks=2)
    sink.name_lora_root(200, 0)
    sink.ingest([stored(None, (200, SYS), rank=0), stored(None, (200, SYS), rank=1)])
    sink.ingest([removed(200, rank=1), stored(200, (201, [13, 14]), rank=0)])
    sink.flush()
    by_rank = {rank: [(e.block_hashes, e.lora_name) for e in evs
                      if type(e).__name__ == "BlockStored"] for rank, evs in cap.batches}
    assert by_rank[0] == [([200, 201], "lora-0")]
    assert by_rank[1] == [([200], "lora-0")]


def test_a_refused_dp_rank_gets_no_adapter_map() -> None:
    # Not strict: a refused rank is counted, not raised.
    sink = KvEventSink(Capture(), block_size=2, prefix_closed=True, max_dp_ranks=2)
    sink.name_lora_root(200, 0)
    sink.ingest([stored(None, (200, SYS), rank=5), stored(None, (200, SYS), rank=1)])
    assert sink.stats()["unknown_dp_rank_events"] == 1
    assert set(sink._lora._blocks) == {1}  # state only for the ranks the sink keeps


def test_bounded_maps_count_what_they_forget() -> None:
    counters: dict[str, int] = {}
    names_ = LoraNames(counters, max_entries=2)
    for h in range(4):
        names_.name_root(h, 0)
    assert counters["lora_names_evicted"] == 2
    with pytest.raises(ValueError, match="max_entries=0"):
        LoraNames({}, max_entries=0)


def test_block_names_learn_each_adapter_apart() -> None:
    from kvbm_plugin.naming.names import BlockNames

    sink, _ = sink_with(prefix_closed=True)
    learned_by: dict[Any, list[int]] = {}
    names_ = BlockNames(2)
    sink.on_flush = names_.observe
    for root, task in ((100, None), (200, 0), (300, 1)):
        sink.name_lora_root(root, task)
    sink.ingest([stored(None, (h, SYS), (h + 1, [13, 14])) for h in (100, 200, 300)])
    sink.flush()
    for task in (None, 0, 1):
        learned_by[task] = []
        names_.extend(SYS + [13, 14], [7, 8], learned_by[task], task)
    # The same tokens under three scopes: three chains, each learned whole.
    assert learned_by == {None: [100, 101], 0: [200, 201], 1: [300, 301]}


def test_v2_stored_block_data_names_its_adapter() -> None:
    from types import SimpleNamespace

    def block(h: int, tokens: list[int], lora: int | None) -> SimpleNamespace:
        return SimpleNamespace(block_hash=h, tokens=[SimpleNamespace(token_id=t) for t in tokens],
                               lora_id=lora, mm_keys=None, cache_salt=None)

    sink, cap = sink_with()
    sink.add_stored_event(None, [block(100, SYS, None), block(101, [13, 14], None)])
    sink.add_stored_event(None, [block(200, SYS, 0), block(201, [13, 14], 0)])
    sink.add_stored_event(300, [block(301, [13, 14], 1)])
    sink.flush()
    assert names(cap) == {100: (None, None), 101: (None, None), 200: (0, "lora-0"),
                          201: (0, "lora-0"), 301: (1, "lora-1")}
