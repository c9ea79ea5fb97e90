"""The consolidated output as routers read it (wire/router_forms.py): salts by the string a
client sends, hashes in the width llm-d's decoder accepts. llm-d is its test model
(routers/llmd_model.py); Dynamo's own reading is tests/interop/test_dynamo_indexer.py."""

from __future__ import annotations

import struct

import msgpack
import pytest

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.llmd_model import LlmdIndexer
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.wire.events import EventBatch, decode_event, encode_payload
from kvbm_plugin.wire.identity import SALT_TEXTS, cache_salt_id, salt_extra_key, salt_of
from kvbm_plugin.wire.router_forms import FORM_CLIENT, FORM_ID, spell_for_routers, wide_hash

BS = 4
TOKENS = list(range(1, 13))


@pytest.fixture(autouse=True)
def _fresh_texts() -> None:
    SALT_TEXTS.clear()


def _salted(salt: int, hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [[salt_extra_key(salt)] for _ in hashes]}


def _frames(events: list[dict], seq: int = 0) -> list[bytes]:
    return [b"kv@pod@m", struct.pack(">Q", seq), encode_payload(0.0, events, 0)]


def test_a_salt_seen_as_a_string_goes_out_as_that_string() -> None:
    salt = salt_of(type("Req", (), {"cache_salt": "tenant-a"})())  # the leader saw the string
    assert salt == cache_salt_id("tenant-a") and SALT_TEXTS.get(salt) == "tenant-a"
    root = _salted(salt, [1 << 40, (1 << 40) + 1], None, TOKENS[:8])
    child = _salted(salt, [(1 << 40) + 2], (1 << 40) + 1, TOKENS[8:])
    out = spell_for_routers([root, child], FORM_CLIENT)
    assert [e["cache_salt"] for e in out] == ["tenant-a", "tenant-a"]  # Dynamo: every event
    assert out[0]["extra_keys"] == [["tenant-a"], None]  # llm-d / vLLM: the first block only
    assert "extra_keys" not in out[1]
    # llm-d credits the tenant asking with its own salt string, and nobody else
    llmd = LlmdIndexer(block_size=BS)
    llmd.receive(_frames(out))
    assert llmd.counts["stores"] == 2 and llmd.counts["unknown_parent_stores"] == 0
    assert llmd.cached_tokens(TOKENS, "m", "tenant-a") == 12
    assert llmd.cached_tokens(TOKENS, "m", "tenant-b") == 0
    assert llmd.cached_tokens(TOKENS, "m") == 0
    # the plugin's strict view (Dynamo's rules) reads the same namespace from cache_salt
    view = RouterView(BS)
    view.apply_batch(EventBatch(0, 0.0, [decode_event(e) for e in msgpack.unpackb(
        encode_payload(0.0, out, 0))[1]], 0))
    assert view.cached_tokens(TOKENS, namespace="tenant-a") == 12
    assert view.cached_tokens(TOKENS, namespace=None) == 0


def test_a_salt_known_only_by_its_id_goes_out_as_the_ids_hex() -> None:
    salt = salt_of({"cache_salt_id": 77})  # a revision that gives the connector the id only
    out = spell_for_routers([_salted(salt, [1 << 40], None, TOKENS[:4])], FORM_CLIENT)
    assert out[0]["cache_salt"] == f"{77:016x}" and out[0]["extra_keys"] == [[f"{77:016x}"]]
    llmd = LlmdIndexer(block_size=BS)
    llmd.receive(_frames(out))
    assert llmd.cached_tokens(TOKENS[:4], "m", f"{77:016x}") == 4  # no client sends this
    assert llmd.cached_tokens(TOKENS[:4], "m") == 0  # but no other tenant gets it either


def test_the_id_form_keeps_the_internal_spelling() -> None:
    salt = salt_of({"cache_salt": "tenant-a"})
    event = _salted(salt, [1 << 40], None, TOKENS[:4])
    out = spell_for_routers([dict(event)], FORM_ID, wide_hashes=False)
    assert out == [event]


def test_a_store_naming_two_salts_is_split_chained() -> None:
    a, b = salt_of({"cache_salt": "a"}), salt_of({"cache_salt": "b"})
    event = _salted(a, [1 << 40, (1 << 40) + 1], None, TOKENS[:8])
    event["extra_keys"][1] = [salt_extra_key(b), "f" * 64]  # a multimodal key stays
    out = spell_for_routers([event], FORM_CLIENT, wide_hashes=False)
    assert [(e["block_hashes"], e["parent_block_hash"], e["cache_salt"]) for e in out] == [
        ([1 << 40], None, "a"), ([(1 << 40) + 1], 1 << 40, "b")]
    # the multimodal key in Dynamo's marker form (its first 16 hex digits, then 48 zeros)
    assert out[1]["extra_keys"] == [["f" * 16 + "0" * 48]]
    assert out[1]["token_ids"] == TOKENS[4:8]


def test_a_native_multimodal_digest_goes_out_in_dynamos_marker_form() -> None:
    """Dynamo 1.6.1 reads a 64-hex extra key as a multimodal hash only as 16 hex digits and
    48 zeros; a native digest is spelled so (in either salt form), the marker form and every
    other item are left as they are, and an entry is replaced, not changed in place."""
    native, marker = "0123456789abcdef" * 4, "0123456789abcdef" + "0" * 48
    entry = [native, [native, 3], "lora-x", marker]
    for form in (FORM_CLIENT, FORM_ID):
        event = {"type": "BlockStored", "block_hashes": [1 << 40], "parent_block_hash": None,
                 "token_ids": TOKENS[:4], "block_size": 4, "lora_id": None, "medium": "GPU",
                 "extra_keys": [entry]}
        out = spell_for_routers([event], form, wide_hashes=False)
        assert out[0]["extra_keys"] == [[marker, [native, 3], "lora-x", marker]]
        assert entry[0] == native


def test_unsalted_events_pass_unchanged_but_for_the_hash_width() -> None:
    removed = {"type": "BlockRemoved", "block_hashes": [1 << 40], "medium": "GPU"}
    stored = {"type": "BlockStored", "block_hashes": [1 << 40], "parent_block_hash": None,
              "token_ids": TOKENS[:4], "block_size": BS, "lora_id": None, "medium": "GPU",
              "lora_name": None}
    assert spell_for_routers([dict(removed), dict(stored)], FORM_CLIENT) == [removed, stored]


@pytest.mark.parametrize("small", [0, 5, 200, 70000, -1, -40000, (1 << 32) - 1, -(1 << 31)])
def test_hashes_that_fit_32_bits_go_out_as_int64_which_llm_d_accepts(small: int) -> None:
    raw = wide_hash(small)
    assert bytes(raw) == b"\xd3" + struct.pack(">q", small)
    stored = {"type": "BlockStored", "block_hashes": [small, small + 1],
              "parent_block_hash": None, "token_ids": TOKENS[:8], "block_size": BS}
    removed = {"type": "BlockRemoved", "block_hashes": [small]}
    child = {"type": "BlockStored", "block_hashes": [small + 2], "parent_block_hash": small + 1,
             "token_ids": TOKENS[8:], "block_size": BS}
    events = spell_for_routers([stored, child, removed], FORM_CLIENT)
    llmd = LlmdIndexer(block_size=BS)
    llmd.receive(_frames(events))
    assert llmd.counts["parse_errors"] == 0, llmd.last_error
    assert llmd.counts["stores"] == 2 and llmd.counts["unknown_parent_stores"] == 0
    # every reader decodes the same integers
    decoded = msgpack.unpackb(encode_payload(0.0, events, 0))[1]
    assert decoded[0]["block_hashes"] == [small, small + 1]
    assert decoded[1]["parent_block_hash"] == small + 1
    # without widening llm-d drops the batch (llm-d's own rule, test_llmd_model.py)
    narrow = LlmdIndexer(block_size=BS)
    narrow.receive(_frames([{**stored, "block_hashes": [small, small + 1]}]))
    assert narrow.counts["parse_errors"] == 1


def test_full_width_hashes_are_left_as_they_are() -> None:
    for big in (1 << 32, -(1 << 31) - 1, (1 << 63) - 1, -(1 << 63)):
        assert wide_hash(big) is big or wide_hash(big) == big


@pytest.mark.parametrize("value", ["", "CLIENT", "id"])
def test_the_salt_form_setting(value: str) -> None:
    settings = cc.load_publisher_settings({cc.SALT_FORM: value})
    assert settings.salt_form == (value.lower() or "client")


def test_a_bad_salt_form_is_refused_by_name() -> None:
    with pytest.raises(cc.ConfigError, match=r"DYN_KVBM_KV_EVENTS_SALT_FORM='hex'"):
        cc.load_publisher_settings({cc.SALT_FORM: "hex"})


def test_an_adapter_goes_out_under_the_name_the_setting_gives() -> None:
    names = dict(cc.load_publisher_settings({cc.LORA_NAMES: "0=adapter-a, 7=b"}).lora_names)
    assert names == {0: "adapter-a", 7: "b"}
    assert dict(cc.load_publisher_settings({cc.LORA_NAMES: "5=lora-5"}).lora_names) == {
        5: "lora-5"}  # its own default name: allowed
    events = [{"type": "BlockStored", "block_hashes": [1 << 40], "parent_block_hash": None,
               "token_ids": TOKENS[:4], "block_size": BS, "lora_id": lora,
               "lora_name": None if lora is None else f"lora-{lora}"} for lora in (0, 7, 3, None)]
    events.append({**events[0], "lora_name": "given-upstream"})  # a name the engine gave
    out = spell_for_routers(events, FORM_CLIENT, False, names)
    assert [e["lora_name"] for e in out] == ["adapter-a", "b", "lora-3", None, "given-upstream"]
    llmd = LlmdIndexer(block_size=BS)
    llmd.receive(_frames(out[:1]))
    assert llmd.cached_tokens(TOKENS[:4], "adapter-a") == 4  # the name requests use
    assert llmd.cached_tokens(TOKENS[:4], "lora-0") == 0


@pytest.mark.parametrize("value", ["a=x", "1", "1=", "1=x,1=y", "1=x,2=x", "-1=x",
                                   f"{1 << 64}=x", "\u00b2=x", "\u0663=x", "3=lora-5"])
def test_a_bad_lora_names_setting_is_refused_by_name(value: str) -> None:
    with pytest.raises(cc.ConfigError, match=r"DYN_KVBM_LORA_NAMES="):
        cc.load_publisher_settings({cc.LORA_NAMES: value})


def test_a_salt_string_forgotten_at_the_bound_is_counted_and_spelled_by_its_id() -> None:
    from kvbm_plugin.wire.identity import SaltTexts
    texts = SaltTexts(capacity=2)
    for i, name in enumerate(("a", "b", "c")):
        texts.remember(i, name)
    assert texts.evicted == 1 and texts.get(0) is None and texts.get(2) == "c"


def test_a_string_next_to_an_id_is_remembered_only_when_it_is_that_ids_string() -> None:
    sid = cache_salt_id("tenant-a")
    assert salt_of({"cache_salt_id": sid, "cache_salt": "tenant-b"}) == sid
    assert SALT_TEXTS.get(sid) is None  # a string that is not the id's names nothing
    assert salt_of({"cache_salt_id": sid, "cache_salt": "tenant-a"}) == sid
    assert SALT_TEXTS.get(sid) == "tenant-a"


def test_past_the_bound_the_oldest_salt_string_is_forgotten_first_and_counted() -> None:
    # The leader remembers each new request's salt on TensorRT-LLM's executor thread; past the
    # bound the oldest is forgotten (its cost stays flat: benchmarks/bench_salt_texts.py).
    from kvbm_plugin.wire.identity import SaltTexts
    texts = SaltTexts(capacity=4)
    for i in range(4):
        texts.remember(i, f"t{i}")
    texts.remember(2, "t2")  # already known: nothing moves
    for i in range(4, 7):
        texts.remember(i, f"t{i}")
    assert texts.evicted == 3
    assert [texts.get(i) for i in range(7)] == [None, None, None, "t3", "t4", "t5", "t6"]


@pytest.mark.parametrize("text", ["s" * 257, "\u20ac" * 86],  # 257 and 258 UTF-8 bytes
                         ids=["ascii", "multibyte"])
def test_a_salt_string_over_256_bytes_is_not_kept_and_goes_out_by_its_id(text: str) -> None:
    # A client picks its salt's length: kept, 65,536 salts of 1 MB would hold 64 GB in the
    # leader, and every salted STORE of the output would carry its megabyte.
    from kvbm_plugin.wire.identity import remember_salt_text
    before = SALT_TEXTS.too_long
    salt = salt_of({"cache_salt": text})
    remember_salt_text(type("RequestData", (), {"cache_salt": text})())
    assert salt == cache_salt_id(text)  # the engine's identity is untouched
    assert SALT_TEXTS.get(salt) is None and SALT_TEXTS.too_long == before + 2
    out = spell_for_routers([_salted(salt, [1 << 40], None, TOKENS[:4])], FORM_CLIENT)
    assert out[0]["cache_salt"] == f"{salt:016x}"
    assert out[0]["extra_keys"] == [[f"{salt:016x}"]]
    kept = "k" * 256  # at the bound: kept
    assert SALT_TEXTS.get(salt_of({"cache_salt": kept})) == kept


def test_an_empty_salt_string_goes_out_by_its_id_not_as_no_salt() -> None:
    # TensorRT-LLM salts a request whose cache_salt is "" (get_cache_salt_id("")); Dynamo
    # reads an empty cache_salt as none (tests/interop/test_dynamo_salt_spellings.py), so
    # spelled "" those blocks would be credited to every unsalted request.
    salt = salt_of({"cache_salt": ""})
    assert salt == cache_salt_id("") and SALT_TEXTS.get(salt) == ""
    out = spell_for_routers([_salted(salt, [1 << 40], None, TOKENS[:4])], FORM_CLIENT)
    assert out[0]["cache_salt"] == f"{salt:016x}"
    assert out[0]["extra_keys"] == [[f"{salt:016x}"]]
