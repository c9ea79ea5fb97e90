"""The strict router view: each rule a router applies, counted, and the prefix query."""

from __future__ import annotations

import pytest

from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from kvbm_plugin.wire.identity import SALT_TAG

BS = 2


def toks(*blocks: int) -> list[int]:
    """Tokens of blocks whose content is named by one int each: block b = [b, b + 1000]."""
    return [t for b in blocks for t in (b, b + 1000)]


def store(hashes: list[int], parent: int | None, blocks: list[int] | None = None,
          medium: str | None = "GPU", block_size: int = BS) -> BlockStored:
    blocks = hashes if blocks is None else blocks
    return BlockStored(list(hashes), parent, toks(*blocks), block_size, medium=medium)


def batch(seq: int | None, *events, rank: int = 0) -> EventBatch:  # noqa: ANN002
    return EventBatch(seq, 0.0, list(events), rank)


def view_of(*batches: EventBatch) -> RouterView:
    view = RouterView(BS)
    for i, b in enumerate(batches):
        if b.seq is None:
            b.seq = i
        view.apply_batch(b, "w")
    return view


def test_a_chain_is_matched_as_a_contiguous_prefix() -> None:
    view = view_of(batch(None, store([1, 2], None), store([3], 2)))
    assert view.cached_tokens(toks(1, 2, 3, 4)) == 3 * BS
    assert view.cached_tokens(toks(1, 2)) == 2 * BS
    assert view.cached_tokens(toks(2, 3)) == 0  # not from the root
    assert view.cached_tokens(toks(1, 2, 3) + [7]) == 3 * BS  # a partial block is not keyed
    assert view.counts.warnings == 0


def test_queries_key_on_content_not_on_the_published_hash() -> None:
    view = view_of(batch(None, store([101, 102], None, blocks=[1, 2])))
    assert view.cached_tokens(toks(1, 2)) == 2 * BS


def test_a_store_with_an_unknown_parent_is_skipped_whole() -> None:
    view = view_of(batch(None, store([1], None), store([5, 6], 99, blocks=[2, 3])))
    assert view.counts.skipped_stores == 1 and view.counts.skipped_blocks == 2
    assert view.cached_tokens(toks(1, 2)) == BS
    assert view.blocks() == {("w", 0, "GPU"): 1}
    assert view.counts.warnings == 1


def test_a_lower_tier_checks_no_parent_but_an_orphan_there_is_counted() -> None:
    view = view_of(batch(None, store([1], None), store([2], 1, medium="CPU")))
    assert view.counts.skipped_stores == 0 and view.counts.tier_orphan_stores == 1
    # the host tier continues from the device prefix: "this tier or a faster one"
    assert view.match(toks(1, 2))[0].blocks_by_medium == {"GPU": 1, "CPU": 2}
    assert view.by_medium == {"CPU": {"tier_orphan_stores": 1}}
    assert "  CPU: tier_orphan_stores 1" in view.summary_lines()


def test_removing_a_block_cuts_its_subtree() -> None:
    view = view_of(batch(None, store([1, 2, 3], None), store([4], 2, blocks=[9])),
                   batch(None, BlockRemoved([2])))
    assert view.counts.cut_subtrees == 1 and view.counts.cut_blocks == 2
    assert view.cached_tokens(toks(1, 2, 3)) == BS
    assert view.blocks() == {("w", 0, "GPU"): 1}
    # the cut children's hashes stay the worker's: a store under one is accepted silently
    # and never shown, a removal of one passes
    view.apply_batch(batch(2, BlockRemoved([3]), store([5], 4, blocks=[5])), "w")
    assert view.counts.unknown_removes == 0 and view.counts.skipped_stores == 0
    assert view.counts.unreachable_stores == 1
    assert view.blocks() == {("w", 0, "GPU"): 1}
    assert view.counts.warnings == 2


def test_a_cut_edge_forgets_its_rest() -> None:
    view = view_of(batch(None, store([1, 2, 3], None)), batch(None, BlockRemoved([2])),
                   batch(None, store([4], 3, blocks=[4]), BlockRemoved([3])))
    assert view.counts.cut_subtrees == 1
    assert view.counts.skipped_stores == 1 and view.counts.unknown_removes == 1


def test_removing_a_leaf_is_no_warning_and_an_unknown_removal_is() -> None:
    view = view_of(batch(None, store([1, 2], None)), batch(None, BlockRemoved([2]),
                                                         BlockRemoved([2])))
    assert view.counts.cut_subtrees == 0 and view.counts.unknown_removes == 1
    assert view.cached_tokens(toks(1, 2)) == BS


def test_a_removal_must_carry_the_medium_of_its_store() -> None:
    view = view_of(batch(None, store([1], None, medium="CPU")),
                   batch(None, BlockRemoved([1], medium="GPU")))
    assert view.counts.unknown_removes == 1
    assert view.cached_tokens(toks(1)) == BS


@pytest.mark.parametrize("event", [store([1, 1], None), store([1, 2], 2)])
def test_a_store_repeating_a_hash_is_dropped(event: BlockStored) -> None:
    view = view_of(batch(None, store([2], None, blocks=[7])) if event.parent_block_hash
                   else batch(None), batch(None, event))
    assert view.counts.duplicate_hash_drops == 1
    assert view.blocks().get(("w", 0, "GPU"), 0) == (1 if event.parent_block_hash else 0)


def test_a_repeated_store_keeps_the_node_and_is_counted() -> None:
    view = view_of(batch(None, store([1], None)), batch(None, store([1, 2], None)))
    assert view.counts.duplicate_stores == 1
    assert view.cached_tokens(toks(1, 2)) == 2 * BS


def test_clear_drops_only_that_dp_rank() -> None:
    view = RouterView(BS)
    view.apply_batch(batch(0, store([1], None), rank=0), "w")
    view.apply_batch(batch(1, store([1], None), store([2], None, medium="DISK"), rank=1), "w")
    view.apply_batch(batch(2, AllBlocksCleared(), rank=1), "w")
    assert view.blocks() == {("w", 0, "GPU"): 1}
    assert view.cached_tokens(toks(1), dp_rank=1) == 0
    assert view.cached_tokens(toks(1), dp_rank=0) == BS
    assert view.counts.clears == 1 and view.counts.warnings == 0


def test_seq_watermark_drops_old_batches_and_counts_gaps() -> None:
    view = RouterView(BS)
    assert view.apply_batch(batch(5, store([1], None)), "w")
    assert not view.apply_batch(batch(5, store([2], None)), "w")
    assert not view.apply_batch(batch(0, store([3], None)), "w")  # a restarted publisher
    assert view.apply_batch(batch(0, store([3], None)), "other")  # per stream
    assert view.counts.stale_batches == 2
    assert view.apply_batch(batch(9, store([4], None)), "w")
    assert view.counts.gaps == 1 and view.counts.missing_batches == 3
    assert view.cached_tokens(toks(2)) == 0 and view.cached_tokens(toks(4), worker="w") == BS


def test_unknown_medium_and_size_mismatch_are_not_indexed() -> None:
    view = view_of(batch(None, store([1], None, medium="gpu"),
                         store([2], None, block_size=BS + 1),
                         BlockStored([3], None, [3], BS)))
    assert view.counts.unknown_medium == 1 and view.counts.size_mismatch == 2
    assert view.blocks() == {}
    assert view.counts.warnings == 3


def test_any_tier_is_the_longest_prefix_over_media_and_workers_are_separate() -> None:
    view = RouterView(BS)
    view.apply_batch(batch(0, store([1], None), store([1, 2, 3], None, medium="CPU")), "a")
    view.apply_batch(batch(0, store([1, 2], None)), "b")
    matches = {m.worker: m for m in view.match(toks(1, 2, 3))}
    assert matches["a"].blocks_by_medium == {"GPU": 1, "CPU": 3}
    assert matches["a"].tokens == 3 * BS and matches["b"].tokens == 2 * BS
    assert view.cached_tokens(toks(1, 2, 3)) == 3 * BS
    assert view.cached_tokens(toks(1, 2, 3), worker="b") == 2 * BS


def test_a_second_name_for_held_content_is_an_alias() -> None:
    view = view_of(batch(None, store([1], None), store([11], None, blocks=[1]),
                         store([2], 11, blocks=[2])))
    assert view.counts.alias_blocks == 1 and view.counts.skipped_stores == 1
    assert view.held() == {(0, 1, "GPU")}  # shown under the first name
    view.apply_batch(batch(1, BlockRemoved([11])), "w")
    assert view.counts.alias_removes == 1 and view.cached_tokens(toks(1)) == BS
    view.apply_batch(batch(2, BlockRemoved([1])), "w")  # the first name ends both
    assert view.cached_tokens(toks(1)) == 0


def test_workers_share_one_name_per_content() -> None:
    view = RouterView(BS)
    view.apply_batch(batch(0, store([1, 2], None)), "a")
    view.apply_batch(batch(0, store([21, 22], None, blocks=[1, 2])), "b")
    assert view.held("b") == {(0, 1, "GPU"), (0, 2, "GPU")}
    assert view.cached_tokens(toks(1, 2), worker="b") == 2 * BS
    view.apply_batch(batch(1, store([23], 22, blocks=[3])), "b")
    assert view.counts.skipped_stores == 1


def test_a_re_stored_hash_moves() -> None:
    view = view_of(batch(None, store([1], None)), batch(None, store([1], None, blocks=[2])),
                   batch(None, BlockRemoved([1])))
    assert view.counts.duplicate_stores == 1
    # the removal took the new position; the old one stays matched
    assert view.cached_tokens(toks(1)) == BS and view.cached_tokens(toks(2)) == 0


def test_media_map_to_tiers_as_a_router_maps_them() -> None:
    events = [store([1], None, medium="DEVICE"), store([2], None, blocks=[2], medium="CPU_PINNED"),
              store([3], None, blocks=[3], medium="NVME"),
              store([4], None, blocks=[4], medium="REMOTE"),
              store([5], None, blocks=[5], medium="gpu")]
    view = RouterView(BS)
    for e in events:
        view.apply_event(e, "w")
    assert view.blocks() == {("w", 0, "GPU"): 1, ("w", 0, "CPU"): 1, ("w", 0, "DISK"): 1,
                             ("w", 0, "EXTERNAL"): 1}
    assert view.counts.unknown_medium == 1


def test_summary_names_trees_and_rules() -> None:
    view = view_of(batch(None, store([1], None), store([2], 9)))
    text = "\n".join(view.summary_lines())
    assert "tree w dp=0 GPU: 1 blocks, 1 roots" in text
    assert "rule warnings: 1, skipped_stores 1" in text


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size=0"):
        RouterView(0)


def test_tree_subscriber_feeds_the_view_in_order(ctx, tmp_path) -> None:  # noqa: ANN001
    import time

    import zmq

    pub = ctx.socket(zmq.PUB)
    endpoint = f"ipc://{tmp_path}/s"
    pub.bind(endpoint)
    sub = TreeSubscriber(endpoint, context=ctx, view=RouterView(BS))
    try:
        deadline = time.monotonic() + 10
        seq = 0
        while sub.view.counts.batches == 0 and time.monotonic() < deadline:
            pub.send_multipart(encode_batch(b"", seq, 0.0, [store([seq + 1], None,
                                                                  blocks=[1])], 0))
            seq += 1
            sub.poll(20)
        assert sub.view.counts.batches >= 1
        assert sub.view.cached_tokens(toks(1), worker=endpoint) == BS
    finally:
        sub.close()


def test_subscribe_tree_prints_summaries_and_rule_counts(ctx, tmp_path, capsys) -> None:  # noqa: ANN001
    import threading

    import zmq

    from kvbm_plugin.cli.subscribe import main_subscribe

    endpoint = f"ipc://{tmp_path}/tree"
    pub = ctx.socket(zmq.PUB)
    pub.bind(endpoint)
    stop = threading.Event()

    def publish() -> None:
        seq = 0
        while not stop.is_set():
            # a root, then a store whose parent nobody announced (one warning per pair)
            pub.send_multipart(encode_batch(b"", seq, 0.0, [store([2 * seq + 1], None)], 0))
            pub.send_multipart(encode_batch(b"", seq + 1, 0.0,
                                            [store([2 * seq + 2], 10**9)], 0))
            seq += 2
            stop.wait(0.01)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    try:
        assert main_subscribe([endpoint, "--tree", "--count", "40", "--interval", "0.05",
                               "--duration", "60"]) == 0
    finally:
        stop.set()
        thread.join(5)
    out = capsys.readouterr().out
    assert out.count("rule warnings:") >= 2  # at least one periodic summary and the final one
    final = out[out.index("# final"):]
    assert "block size 2" in final and f"tree {endpoint} dp=0 GPU:" in final
    assert "skipped_stores" in final


def test_a_namespace_scopes_a_block_to_its_tenant() -> None:
    salted = BlockStored([1, 2], None, toks(1, 2), BS,
                         extra_keys=[[SALT_TAG + "a"], [SALT_TAG + "a"]])
    view = view_of(batch(None, salted, store([3], None, blocks=[1])))
    assert view.cached_tokens(toks(1, 2), namespace="a") == 2 * BS
    assert view.cached_tokens(toks(1, 2), extra_keys=[[SALT_TAG + "a"]]) == 2 * BS
    assert view.cached_tokens(toks(1, 2), namespace="b") == 0
    assert view.cached_tokens(toks(1, 2)) == BS  # the unsalted copy of block 1 only
    assert view.counts.warnings == 0


def test_only_the_first_entry_names_the_namespace() -> None:
    view = view_of(batch(None, BlockStored([1, 2], None, toks(1, 2), BS,
                                           extra_keys=[[SALT_TAG + "a"], None])))
    assert view.cached_tokens(toks(1, 2), namespace="a") == 2 * BS


@pytest.mark.parametrize("second", [
    {"extra_keys": [["salt:a"]]},  # a bare string is not a namespace
    {"lora_id": 7},  # a router ignores lora_id
])
def test_identity_a_router_ignores_makes_an_alias(second: dict) -> None:
    view = view_of(batch(None, store([1], None),
                         BlockStored([2], None, toks(1), BS, **second)))
    assert view.counts.alias_blocks == 1


@pytest.mark.parametrize("second", [
    {"lora_name": "lora-7"}, {"extra_keys": [["ab" * 32]]}, {"extra_keys": [[[5, 0]]]},
])
def test_lora_name_and_multimodal_hashes_are_content(second: dict) -> None:
    view = view_of(batch(None, store([1], None),
                         BlockStored([2], None, toks(1), BS, **second)))
    assert view.counts.alias_blocks == 0 and len(view.held()) == 2
