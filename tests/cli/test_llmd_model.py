"""The llm-d test model against known answers and against llm-d's own Go tests.

llm-d's Go tests (llm-d-router @ ebab6879) pin no literal block keys: they assert properties
(determinism, chain continuation, key counts, mappings). Those are ported here test by test,
each naming its Go test. The literal known answers are those of the two primitives the token
processor composes: FNV-64a (Go's own ``hash/fnv`` golden values) and canonical CBOR (RFC 8949
Appendix A, and its length-first map order, which ``fxamacker/cbor``'s ``CanonicalEncOptions``
implements). The end-to-end behaviour on the plugin's stream is in test_llmd_stream.py.
"""

from __future__ import annotations

import struct

import msgpack
import pytest

from kvbm_plugin.routers.llmd_model import (
    Cleared,
    GoDecodeError,
    LlmdIndexer,
    MMHash,
    Removed,
    Stored,
    TokenProcessor,
    cbor,
    decode_batch,
    fnv64a,
    fold_cache_salt,
    go_decode,
    hash_as_uint64,
    parse_raw_extra_keys,
    parse_topic,
    realign_extra_features,
)


@pytest.mark.parametrize(("data", "want"), [
    (b"", 0xCBF29CE484222325), (b"a", 0xAF63DC4C8601EC8C), (b"ab", 0x089C4407B545986A),
    (b"abc", 0xE71FA2190541574B)])
def test_fnv64a_known_answers(data: bytes, want: int) -> None:
    assert fnv64a(data) == want  # golang/go src/hash/fnv/fnv_test.go, golden64a


@pytest.mark.parametrize(("value", "hex_"), [
    (0, "00"), (23, "17"), (24, "1818"), (100, "1864"), (1000, "1903e8"),
    (1000000, "1a000f4240"), (1000000000000, "1b000000e8d4a51000"),
    (18446744073709551615, "1bffffffffffffffff"), (-1, "20"), (-1000, "3903e7"),
    ("", "60"), ("a", "6161"), ("IETF", "6449455446"), (b"\x01\x02\x03\x04", "4401020304"),
    ([], "80"), ([1, 2, 3], "83010203"), ([1, [2, 3], [4, 5]], "8301820203820405"),
    ({}, "a0"), ({"a": 1, "b": [2, 3]}, "a26161016162820203"), (None, "f6"),
    # canonical order: the shorter encoded key first, then bytewise
    ({"aa": 1, "b": 2}, "a261620262616101"),
    # length first (fxamacker's SortLengthFirst), not bytewise: -1 (0x20) before 100 (0x1864)
    ({100: 1, -1: 2}, "a22002186401"),
    (MMHash("x"), "a1644861736861" + "78"),
])
def test_canonical_cbor_known_answers(value: object, hex_: str) -> None:
    assert cbor(value).hex() == hex_  # RFC 8949 Appendix A


def test_map_key_order_does_not_change_the_encoding() -> None:
    # TestHash_ExtraMapKeyOrdering
    assert cbor({"lora_id": 42, "medium": "gpu"}) == cbor({"medium": "gpu", "lora_id": 42})
    assert cbor({"outer": {"lora_id": 42, "medium": "gpu"}}) == \
        cbor({"outer": {"medium": "gpu", "lora_id": 42}})


def test_a_block_key_is_fnv64a_of_the_canonical_cbor_of_parent_tokens_extras() -> None:
    tp = TokenProcessor(4, "seed")
    seed = fnv64a(b"seed")
    root = fnv64a(b"\x83\x1b" + seed.to_bytes(8, "big") + b"\xf6\x65model")
    assert tp.root("model") == root
    first = fnv64a(b"\x83\x1b" + root.to_bytes(8, "big") + b"\x84\x01\x02\x03\x04\xf6")
    assert tp.keys(0, [1, 2, 3, 4], "model") == [first]
    tainted = fnv64a(b"\x83\x1b" + root.to_bytes(8, "big") + b"\x84\x01\x02\x03\x04"
                     + b"\x81\xa1\x64Hash\x61s")
    assert tp.keys(0, [1, 2, 3, 4], "model", [[MMHash("s")]]) == [tainted]


TOKENS16 = list(range(1, 17))


def test_init_hash_depends_on_model_and_seed_and_nothing_else() -> None:
    # TestGetInitHash_ConsistentHashesForSameModel / _DifferentHashesForDifferentModels /
    # _DifferentSeedsProduceDifferentHashes / _Deterministic
    tp = TokenProcessor(16, "test-seed")
    assert tp.keys(0, TOKENS16, "test-model") == tp.keys(0, TOKENS16, "test-model")
    models = ["gpt-4", "llama-2-7b", "claude-3", "gemini-pro", "", "a",
              "very-long-model-name-with-special-characters-123!@#"]
    assert len({tp.keys(0, TOKENS16, m)[0] for m in models}) == len(models)
    seeds = ["", "seed1", "seed2", "different-seed", "123456"]
    assert len({TokenProcessor(16, s).keys(0, TOKENS16, "test-model")[0] for s in seeds}) == 5


def test_heterogeneous_block_sizes() -> None:
    # TestHeterogeneousBlockSizeSupport, TestBackwardCompatibility_BlockSize
    tokens = list(range(1, 513))
    k16, k32, k256 = (TokenProcessor(bs, "test-seed").keys(0, tokens, "test-model")
                      for bs in (16, 32, 256))
    assert k32[0] != k16[0]
    assert (len(k256), len(k16)) == (2, 32)
    assert len(TokenProcessor(256, "test-seed").keys(0, tokens[:300], "test-model")) == 1
    assert not set(k256) & set(k16)
    assert TokenProcessor(256, "test-seed").keys(999999, tokens, "test-model")[0] != k256[0]
    assert len(TokenProcessor(8, "test").keys(0, list(range(1, 33)), "test-model")) == 4
    with pytest.raises(ValueError, match="blockSizeTokens must be greater than 0, got -1"):
        TokenProcessor(-1)


def test_a_chain_continues_from_a_parent_key() -> None:
    # TestXXH64_ParentKeyContinuation, for the default algorithm
    tp = TokenProcessor(4, "")
    tokens = list(range(1, 17))
    full = tp.keys(0, tokens, "m")
    assert tp.keys(full[1], tokens[8:], "m") == full[2:]
    assert tp.keys(0, tokens + [99], "m") == full  # the partial block is not keyed


def test_extra_keys_parsing() -> None:
    # TestParseRawExtraKeys_Nil / _NilInnerEntries / _BareStringIdentifiers / _LegacyTuples /
    # _SkipsUnknownEntryTypes
    assert parse_raw_extra_keys(None) is None
    assert parse_raw_extra_keys([None, ["h1", "h2"], [["h3", 5]], [7, {"a": 1}]]) == \
        [None, [MMHash("h1"), MMHash("h2")], [MMHash("h3")], None]
    # every bare string is an MM hash: a salt tag too (what our salted blocks carry)
    assert parse_raw_extra_keys([["dynamo-cache-salt:00ff"]]) == \
        [[MMHash("dynamo-cache-salt:00ff")]]


def test_realign_and_fold_cache_salt() -> None:
    # TestRealignExtraFeatures; foldCacheSalt appends the salt after block 0's MM hashes only
    a, b = [MMHash("a")], [MMHash("b")]
    assert realign_extra_features([a, None, None, b], 2) == [a, b]
    assert realign_extra_features([a, b], 4) == [a, a, b, b]
    assert realign_extra_features([a], 0) is None
    assert fold_cache_salt(None, "tenant", 3) == [[MMHash("tenant")], None, None]
    assert fold_cache_salt([a, b], "t", 2) == [[MMHash("a"), MMHash("t")], b]
    assert fold_cache_salt(None, "", 3) is None and fold_cache_salt(None, "t", 0) is None


def test_topic() -> None:
    # TestVLLMShardingKey
    assert parse_topic("kv@pod-123@llama-2-7b") == ("pod-123", "llama-2-7b")
    assert parse_topic("fallback") == ("fallback", "")
    assert parse_topic("kv@pod@org/model@v2") == ("kv@pod@org/model@v2", "")
    assert parse_topic("") == ("", "")


def _go_uint64(n: int) -> bytes:
    """How vmihailenco's Marshal writes a Go uint64 (full width, 0xcf)."""
    return b"\xcf" + struct.pack(">Q", n)


def test_a_go_encoded_batch_decodes_as_in_llm_ds_test() -> None:
    # TestVLLMParseMessage_Valid: uint64 hashes (written full width by Go), []uint32 tokens
    event = (b"\x99\xabBlockStored\x92" + _go_uint64(100) + _go_uint64(101) + _go_uint64(99)
             + b"\x93\xce\x00\x00\x00\x01\xce\x00\x00\x00\x02\xce\x00\x00\x00\x03"
             + b"\x10\xc0\xa3gpu\xc0\xc0")
    payload = b"\x93\xcb" + struct.pack(">d", 1234567890.0) + b"\x91" + event + b"\xc0"
    ts, events, rank = decode_batch(payload)
    assert ts == 1234567890.0 and rank is None
    assert events == [Stored([100, 101], 99, [1, 2, 3], 16, medium="gpu")]


def test_hashes_llm_d_accepts_and_rejects() -> None:
    # getHashAsUint64: uint64, int64 (cast) and bytes (last 8, big-endian); vmihailenco types
    # a fixint int8, 0xcc uint8, 0xce uint32, 0xd2 int32: each of those fails
    assert hash_as_uint64(go_decode(msgpack.packb(-(1 << 40)))) == (1 << 64) - (1 << 40)
    assert hash_as_uint64(go_decode(msgpack.packb((1 << 63) + 5))) == (1 << 63) + 5
    assert hash_as_uint64(go_decode(b"\xc4\x0a" + bytes(range(10)))) == \
        int.from_bytes(bytes(range(2, 10)), "big")
    assert hash_as_uint64(b"\x01\x02") == 0x0102
    for small, go in ((5, "int8"), (200, "uint8"), (70000, "uint32"), (-40000, "int32")):
        decoded = go_decode(msgpack.packb(small))
        assert decoded.go == go
        with pytest.raises(GoDecodeError, match=f"unsupported hash type: {go}"):
            hash_as_uint64(decoded)


def test_small_hashes_fail_the_whole_batch() -> None:
    idx = LlmdIndexer(block_size=2)
    big = -(1 << 40)  # msgpack writes int64: accepted
    ok = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [big], "parent_block_hash":
                               None, "token_ids": [1, 2], "block_size": 2}], 0])
    idx.receive([b"kv@p@m", struct.pack(">Q", 0), ok])
    assert idx.counts["stores"] == 1 and idx.counts["parse_errors"] == 0
    for small in (7, 300, 70000, -40000):
        bad = msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [small]}], 0])
        idx.receive([b"kv@p@m", struct.pack(">Q", 1), bad])
    assert idx.counts["parse_errors"] == 4
    assert "unsupported hash type" in (idx.last_error or "")


def test_the_subscriber_rules_topic_filter_and_frames() -> None:
    idx = LlmdIndexer(block_size=2)
    good = msgpack.packb([0.0, [], 0])
    idx.receive([b"", struct.pack(">Q", 0), good])  # the plugin's default topic
    idx.receive([b"kv-events", struct.pack(">Q", 0), good])
    assert idx.counts["topic_filtered"] == 2 and idx.counts["batches"] == 0
    idx.receive([b"kv@p@m", good])  # 2 frames
    idx.receive([b"kv@p@m", b"\x00", good])  # short seq
    assert idx.counts["malformed_frames"] == 2
    idx.receive([b"kv@p@m", struct.pack(">Q", 0), good])
    assert idx.counts["batches"] == 1


def _engine_keys(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


TOKENS = list(range(1, 257))


def test_many_to_one_and_one_to_many_mappings() -> None:
    # TestCanonicalWritePath_ManyToOne / _OneToMany (with its eviction)
    idx = LlmdIndexer(block_size=64, hash_seed="test")
    ek = _engine_keys(8, 100)
    idx.process_batch([Stored(ek, 0, TOKENS[:128], 16)], "pod-a", "test-model")
    ck = idx.tokens.keys(0, TOKENS[:128], "test-model")
    assert len(ck) == 2 and all(idx.data[k] for k in ck)
    assert [idx.engine_to_request[k][-1] for k in ek] == [ck[i // 4] for i in range(8)]

    idx = LlmdIndexer(block_size=64, hash_seed="test")
    ek = _engine_keys(2, 200)
    idx.process_batch([Stored(ek, 0, TOKENS, 128)], "pod-b", "test-model")
    ck = idx.tokens.keys(0, TOKENS, "test-model")
    assert [idx.engine_to_request[k][-1] for k in ek] == [ck[1], ck[3]]
    idx.process_batch([Removed([ek[0]])], "pod-b", "test-model")
    assert [k in idx.data for k in ck] == [False, False, True, True]


def test_offload_without_tokens_and_clear() -> None:
    # TestBlockStoredEvent_OffloadingEmptyTokens / _OffloadingUnknownEngineKeys,
    # TestAllBlocksCleared_Dispatch
    idx = LlmdIndexer(block_size=16, hash_seed="test")
    ek = _engine_keys(4, 600)
    idx.process_batch([Stored(ek, 0, TOKENS[:64], 16)], "pod-a", "test-model")
    idx.process_batch([Stored(ek, 0, [], 16, medium="CPU")], "pod-a", "test-model")
    ck = idx.tokens.keys(0, TOKENS[:64], "test-model")
    assert all({e.tier for e in idx.data[k]} == {"gpu", "cpu"} for k in ck)
    idx.process_batch([Stored(_engine_keys(4, 900), 0, [], 16, medium="CPU")], "pod-x", "m")
    assert idx.counts["unkeyed_stores"] == 1
    idx.process_batch([Stored(_engine_keys(4, 500), 0, TOKENS[:64], 16)], "pod-kept",
                      "test-model")
    idx.process_batch([Cleared()], "pod-a", "test-model")
    assert all({e.pod for e in idx.data[k]} == {"pod-kept"} for k in ck)


def test_duplicate_store_survives_the_first_remove_and_the_scorer_weights() -> None:
    # TestPool_DuplicateStoreSurvivesFirstRemove; LongestPrefixScorer with the default weights
    idx = LlmdIndexer(block_size=4)
    store = Stored([11, 12], 0, TOKENS[:8], 4)
    idx.process_batch([store, store], "p", "m")
    idx.process_batch([Removed([11, 12])], "p", "m")
    assert idx.cached_tokens(TOKENS[:8], "m") == 8
    idx.process_batch([Removed([11, 12])], "p", "m")
    assert idx.cached_tokens(TOKENS[:8], "m") == 0
    idx.process_batch([Stored([21], 0, TOKENS[:4], 4, medium="CPU"),
                       Stored([22], 21, TOKENS[4:8], 4, medium="DISK")], "p", "m")
    match = idx.match(TOKENS[:8], "m")["p"]
    assert match.blocks == 2 and match.score == pytest.approx(0.8 + 1.0)  # disk: weight 1.0
    assert idx.tiers_held("p") == {"cpu": 1, "disk": 1}


def test_a_store_with_an_unknown_parent_is_skipped_whole() -> None:
    idx = LlmdIndexer(block_size=4)
    idx.process_batch([Stored([5, 6], 99, TOKENS[:8], 4)], "p", "m")
    assert idx.counts["unknown_parent_stores"] == 1 and not idx.data


def test_lora_name_and_salt_decide_the_keys() -> None:
    idx = LlmdIndexer(block_size=4)
    idx.process_batch([Stored([1, 2], 0, TOKENS[:8], 4, lora_name="adapter-a"),
                       Stored([3, 4], 0, TOKENS[:8], 4, extra_keys=[["tenant-1"], None])],
                      "p", "base")
    assert idx.cached_tokens(TOKENS[:8], "adapter-a") == 8
    assert idx.cached_tokens(TOKENS[:8], "base") == 0  # the salted chain only
    assert idx.cached_tokens(TOKENS[:8], "base", cache_salt="tenant-1") == 8
    assert idx.cached_tokens(TOKENS[:8], "base", cache_salt="tenant-2") == 0
