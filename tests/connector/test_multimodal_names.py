"""Multimodal blocks under one name: on TensorRT-LLM's buffered V1 path a multimodal request's
tier copies go out under the V1 hash TensorRT-LLM gives the block (its items' digests and
offsets mixed in) and with the items' digests in ``extra_keys``, as its GPU copy does, so the
consolidator sees one block, not a hash conflict it must rename."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from _engines import prompt
from _kvwire import wait_until

from kvbm_plugin.naming.names import (
    BlockNaming,
    mm_block_keys,
    mm_hash_bytes,
    name_inputs,
    rule_of,
    v1_block_hash,
)
from kvbm_plugin.wire.events import BlockStored, to_signed_int64
from kvbm_plugin.wire.identity import mm_marker
from kvbm_plugin.wire.subscriber import StreamSubscriber

BS = 4
IMAGE_TOKEN = 999  # the placeholder id every image's tokens carry in the prompt
IMAGE_AT, IMAGE_LEN = 5, 7  # prompt positions 5..11: blocks 1 and 2
# The same image's tokens in two runs around a text token at 8 (run metadata: positions 5-7
# and 9-12), as the newest revisions place an item split by framing text.
SPLIT_RUNS = [(5, 3), (9, 4)]


def _parts(seed: int) -> list[int]:
    return [(seed * 0x01010101 + k * 0x11111111) & 0x7FFFFFFF for k in range(8)]


def _request(image: int, tail: int, split: bool = False) -> tuple[list[int], list[Any]]:
    """A prompt with one image and its items (hash parts, runs)."""
    tokens = prompt(7, IMAGE_AT) + [IMAGE_TOKEN] * IMAGE_LEN + prompt(tail, 6)
    if not split:
        return tokens, [(_parts(image), [(IMAGE_AT, IMAGE_LEN)])]
    tokens[8] = 77  # framing text inside the image's span
    tokens.insert(13, IMAGE_TOKEN)  # the image's last token moves one on
    return tokens[:-1], [(_parts(image), SPLIT_RUNS)]


def _names(tokens: list[int], items: list[Any]) -> dict[int, Any]:
    """TensorRT-LLM's V1 hash of each full block -> the digests its key mixes in (the test's
    own reading of ``generateBlockHashExtraKeys``: every run of every item overlapping the
    block, at the offset inside the item of its first overlapping token), spelled as every
    stream spells them (Dynamo's marker form of the first 16 hex digits)."""
    out: dict[int, Any] = {}
    parent = None
    for i in range(len(tokens) // BS):
        lo, hi = i * BS, (i + 1) * BS
        keys = []
        for h, runs in items:
            before = 0  # the item's tokens in its earlier runs
            for p, n in runs:
                if hi > p and lo < p + n:
                    keys.append((mm_hash_bytes(h), before + max(lo, p) - p))
                before += n
        parent = v1_block_hash(tokens[lo:hi], parent, mm_keys=keys)
        out[to_signed_int64(parent)] = tuple(mm_marker(d.hex()) for d, _ in keys)
    return out


def test_the_contiguous_span_rule_matches_upstreams_known_answers() -> None:
    """``generateBlockHashExtraKeys`` for one item at positions 1..2 of a 5-token prompt
    (TensorRT-LLM's ``BlockKeyTest`` contiguous-span cases, stored id 56127538488): a block
    holding its first token has offset 0, one starting inside it the offset of its start,
    one past it nothing."""
    digest = mm_hash_bytes([0x01020304, 0x05060708, 0x11121314, 0x15161718,
                            0x21222324, 0x25262728, 0x31323334, 0x35363738])
    assert digest.hex().startswith("0102030405060708")
    items = [(digest, ((1, 2),))]
    assert mm_block_keys(items, 0, 2) == [(digest, 0)]
    assert mm_block_keys(items, 2, 3) == [(digest, 1)]
    assert mm_block_keys(items, 3, 5) == []
    assert mm_block_keys(items, 0, 1) == []


def test_the_run_rule_matches_upstreams_worked_example() -> None:
    """``generateRunBasedExtraKeys``'s own worked example (``blockKey.cpp``, stored id
    56377047221): item 0's tokens at prompt positions 1-2 and 4-5 (runs [1, 2) and [4, 2)),
    text at 3. A block over [4, 6) mixes the item in at offset 2, one over [5, 6) at 3, one
    over the text position alone not at all."""
    digest = mm_hash_bytes(_parts(9))
    items = [(digest, ((1, 2), (4, 2)))]
    assert mm_block_keys(items, 4, 6) == [(digest, 2)]
    assert mm_block_keys(items, 5, 6) == [(digest, 3)]
    assert mm_block_keys(items, 3, 4) == []
    assert mm_block_keys(items, 0, 6) == [(digest, 0), (digest, 2)]  # one key per run


def _req(**fields: Any) -> Any:
    fields.setdefault("multimodal_hashes", [_parts(1)])
    fields.setdefault("multimodal_positions", [1])
    fields.setdefault("multimodal_lengths", [4])
    return SimpleNamespace(**fields)


def test_a_requests_items_are_read_as_tensorrt_llm_reads_them() -> None:
    """Run metadata where it is complete and valid; otherwise the contiguous spans, as
    ``resolveRunMetadata`` falls back; a form no revision here follows, or a span the newest
    revision refuses, leaves the request unnamed."""
    digest = mm_hash_bytes(_parts(1))
    runs = dict(multimodal_item_run_cu_offsets=[0, 2], multimodal_run_positions=[1, 8],
                multimodal_run_lengths=[2, 2])
    inputs = name_inputs(_req(**runs))
    assert inputs.why_not is None and inputs.mm == ((digest, ((1, 2), (8, 2))),)
    assert inputs.v2_why_not == "multimodal inputs" and rule_of(inputs) == ("none", False, True)
    for bad in (dict(runs, multimodal_item_run_cu_offsets=[0, 3]),  # not the number of runs
                dict(runs, multimodal_run_lengths=[2, 0]),  # an empty run
                dict(runs, multimodal_run_positions=None)):  # incomplete
        assert name_inputs(_req(**bad)).mm == ((digest, ((1, 4),)),)  # the contiguous span
    assert name_inputs(_req(multimodal_hash_positions=[[1, 3]])).why_not == \
        "multimodal inputs placed by hash positions"
    # names learned by tokens: up to the first item's tokens; none where items are unread
    assert inputs.learn_tokens == 1
    assert name_inputs(_req(multimodal_hash_positions=[[1, 3]])).learn_tokens == 0
    assert name_inputs(SimpleNamespace(input_token_extra_ids=[1])).learn_tokens == 0
    # bad values: the reason names the fields and their values
    assert name_inputs(_req(multimodal_lengths=[0])).why_not == \
        "multimodal inputs with an invalid position or length (multimodal_positions=[1], " \
        "multimodal_lengths=[0])"
    assert name_inputs(_req(multimodal_positions=[1, 2])).why_not == \
        "multimodal inputs without one position and length per item (1 multimodal_hashes; " \
        "multimodal_positions=[1, 2], multimodal_lengths=[4])"
    unread = name_inputs(_req(multimodal_hashes=[[1, "x"]]))
    assert unread.why_not.startswith("unreadable multimodal inputs (multimodal_hashes=[[1, "
                                      "'x']]; multimodal_positions=[1], ") and unread.bad_input
    assert not name_inputs(_req(multimodal_hash_positions=[[1, 3]])).bad_input


def test_requests_whose_names_cannot_be_computed_are_counted_and_logged(caplog) -> None:
    stats: dict[str, int] = {}
    naming = BlockNaming(4, stats)
    with caplog.at_level(logging.INFO, logger="kvbm_plugin.naming.names"):
        naming.inputs_of(_req(multimodal_lengths=[0]), 7)
        naming.inputs_of(SimpleNamespace(lora_task_id="x"), 8)  # rate-limited: one key
        naming.inputs_of(SimpleNamespace(input_token_extra_ids=[1]), 9)
        naming.inputs_of(SimpleNamespace(), 10)  # a plain request: nothing to say
    assert stats["requests_names_not_computed"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "request 7: multimodal inputs with an invalid position or " \
        "length (multimodal_positions=[1], multimodal_lengths=[0])" in warnings[0]
    assert len(infos) == 1 and "request 9: prompt-tuning extra ids" in infos[0]


@pytest.mark.parametrize("split", [False, True], ids=["contiguous", "runs"])
def test_multimodal_tier_copies_carry_trtllms_name_and_the_items_digests(
        make_engine, tmp_path, split) -> None:
    engine = make_engine(num_gpu_blocks=6, provide_block_hashes=False,
                         env={"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
                              "DYN_KVBM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/gpu",
                              "DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/gpu-r",
                              "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
                              "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT":
                                  f"ipc://{tmp_path}/out-r",
                              "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "64"})
    leader = engine.leader
    tier_stores: dict[int, Any] = {}  # what the leader told its consolidator the host holds
    register = leader.consolidator.register_store

    def recording(tier, dp_rank, block_hash, parent_hash, token_ids, block_size, **scope):
        tier_stores[to_signed_int64(block_hash)] = scope.get("extra_keys")
        register(tier, dp_rank, block_hash, parent_hash, token_ids, block_size, **scope)

    register_many = leader.consolidator.register_stores

    def recording_many(tier, dp_rank, stores, block_size):
        for block_hash, _, _, _, extra_keys in stores:
            tier_stores[to_signed_int64(block_hash)] = extra_keys
        register_many(tier, dp_rank, stores, block_size)

    leader.consolidator.register_store = recording
    leader.consolidator.register_stores = recording_many
    sub = StreamSubscriber(f"ipc://{tmp_path}/out", f"ipc://{tmp_path}/out-r", start_seq=0)
    names: dict[int, Any] = {}
    batches: list[Any] = []
    try:
        # Two images behind the same placeholder tokens, each asked about twice; the small
        # GPU pool evicts in between, so the second asks load from the host tier.
        for image, tail in ((1, 20), (2, 21), (1, 22), (2, 23), (3, 24)):
            tokens, items = _request(image, tail, split)
            req = engine.submit(tokens, 2, multimodal=items)
            engine.run_until_idle()
            names.update(_names(engine.result(req).tokens, items))
        leader.publish_now()

        def settled() -> bool:
            batches.extend(sub.poll(20))
            return leader.consolidator.wait_idle(0.1) and \
                sub.next_seq == leader.consolidator.stats()["batches_out"]

        wait_until(settled, 10, "the consolidated stream caught up")
    finally:
        sub.close()
    stats = leader.stats()
    assert stats["block_name_mismatches"] == 0 and stats["block_names_computed"] > 0
    assert ("none", False, True) in leader._naming.confirmed  # noqa: SLF001
    assert engine.stats().kv_mismatches == 0
    assert sum(r.host_hit for r in engine._reqs.values()) > 0  # noqa: SLF001
    image_blocks = {h for h, digests in names.items() if digests}
    assert image_blocks & set(tier_stores), "no image block reached the host tier"
    for h, extra in tier_stores.items():
        assert h in names, f"tier STORE {h:#x} is not TensorRT-LLM's name of any block"
        assert tuple(extra or ()) == names[h]  # the items' digests, as its GPU copy has
    # one block, one name: no tier copy renamed, every name on the stream TensorRT-LLM's
    assert leader.consolidator.stats()["hash_conflicts"] == 0
    out = 0
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                extras = event.extra_keys or [None] * len(event.block_hashes)
                for h, extra in zip(event.block_hashes, extras, strict=True):
                    assert names.get(to_signed_int64(h)) == tuple(extra or ())
                    out += 1
    assert out >= len(image_blocks)


def test_names_are_awaited_while_a_rule_in_use_is_neither_confirmed_nor_refuted() -> None:
    naming = BlockNaming(4, {})
    naming.inputs_of(SimpleNamespace(cache_salt_id=7), 1)
    naming.inputs_of(SimpleNamespace(), 2)
    assert naming.rules_in_use == {("id", False, False), ("none", False, False)}
    assert not naming.awaiting_events  # names handed over (no learning): nothing awaited
    naming.learning = True
    assert naming.awaiting_events
    naming.confirmed.add(("none", False, False))
    assert naming.awaiting_events  # the salted request's rule is still open
    naming.refuted.add(("id", False, False))
    assert not naming.awaiting_events
