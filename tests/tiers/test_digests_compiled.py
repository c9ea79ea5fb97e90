"""The tiers' compiled chained digests and content keys (``tiers/_digests_c.c``) against their
references (``tiers/content_keys.py``'s ``_chained_py``, ``_keys_py``) and against hashlib's
BLAKE2b block by block:
the tier content keys and the shared tier's digests name the same blocks whichever form runs
(an engine restarted with ``DYN_KVBM_NATIVE=0`` keeps its tiers' names, and two engines of one
shared tier agree). No torch: this runs on every CPython the package supports.
"""

from __future__ import annotations

import hashlib
import random
import struct
from array import array

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.tiers import content_keys
from kvbm_plugin.tiers.content_keys import _chained_py, block_keys, chain_key
from kvbm_plugin.tiers.shared.keys import chain_digests, content_digest

compiled = _compiled.loops("tier_digests", {})
needs_native = pytest.mark.skipif(compiled is None,
                                  reason="kvbm_plugin.tiers._digests_c was not built")

I64_EDGES = (0, 1, -1, 2**31 - 1, -2**31, 2**32, 2**63 - 1, -2**63)


def _by_hashlib(digest_size: int, person: bytes, first: bytes, tokens: list[int],
                block_size: int, start: int, before: bytes, after: bytes) -> list[bytes]:
    """The definition, one hashlib object per block (no shared packing or keyed copy)."""
    out, digest = [], first
    for k in range(start, len(tokens) // block_size):
        block = tokens[k * block_size:(k + 1) * block_size]
        h = hashlib.blake2b(digest_size=digest_size, person=person)
        h.update(digest + before + struct.pack(f"<{block_size}q", *block) + after)
        digest = h.digest()
        out.append(digest)
    return out


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_compiled_digests_are_the_reference_and_the_definition(seed: int) -> None:
    """Random chains: every digest size and personalisation length, message lengths on and
    around BLAKE2b's 128-byte blocks, a partial tail that is never read, int64's edges."""
    rng = random.Random(seed)
    for _ in range(40):
        digest_size = rng.choice((1, 8, 16, 32, 64))
        person = bytes(rng.randrange(256) for _ in range(rng.randrange(17)))
        block_size = rng.choice((1, 2, 3, 13, 14, 15, 16, 31, 32, 64))
        blocks = rng.randrange(6)
        tokens = [rng.choice(I64_EDGES) if rng.random() < 0.2 else rng.randrange(-2**63, 2**63)
                  for _ in range(blocks * block_size + rng.randrange(block_size))]
        start = rng.randrange(blocks + 2)
        before = bytes(rng.randrange(256) for _ in range(rng.choice((0, 4, 9, 120))))
        after = bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 7, 128, 200))))
        first = bytes(rng.randrange(256) for _ in range(digest_size))
        args = (digest_size, person, first, tokens, block_size, start, before, after)
        want = _by_hashlib(*args)
        assert _chained_py(*args) == want
        assert compiled.chained(*args, False) == want
        assert compiled.chained(*args, False) == compiled.chained(*args[:3], tuple(tokens),
                                                                  *args[4:], False)
        if digest_size == 8:
            assert compiled.chained(*args, True) == [int.from_bytes(d, "little") for d in want]


@needs_native
def test_every_message_length_around_blake2b_blocks() -> None:
    """Messages of 16 to 416 bytes (the last 128-byte block partial, full, and one byte over)."""
    pattern = bytes(range(256)) * 2
    for extra in range(401):
        args = (8, b"kvbm-blk", bytes(range(8)), [extra - 200], 1, 0, pattern[:extra], b"")
        assert compiled.chained(*args, False) == _by_hashlib(*args), extra


def test_the_tier_keys_and_shared_digests_are_their_definitions() -> None:
    """Whichever form is in use: block_keys is chain_key along the chain (salt and a start
    inside the prompt included), chain_digests is content_digest along the chain."""
    rng = random.Random(3)
    tokens = [rng.randrange(1 << 17) for _ in range(16 * 9 + 5)]
    for salt in (None, "tenant-a"):
        keys, parent = [], None
        for k in range(9):
            parent = chain_key(parent, tokens[16 * k:16 * (k + 1)], salt)
            keys.append(parent)
        assert block_keys(tokens, 16, salt) == keys
        assert block_keys(tokens, 16, salt, start=4, parent=keys[3]) == keys[4:]
    for scope in (None, "lora:7"):
        digests, parent_digest = [], None
        for k in range(9):
            parent_digest = content_digest(parent_digest, tokens[16 * k:16 * (k + 1)], scope)
            digests.append(parent_digest)
        assert chain_digests(tokens, 16, scope) == digests
        assert chain_digests(tokens, 16, scope, start=5, parent=digests[4]) == digests[5:]


@needs_native
def test_tokens_of_any_int_form_and_bad_tokens_are_refused_alike() -> None:
    """Bools, ints with ``__index__`` and an int32 array are read as their values; a token past
    int64 or not an integer raises in both forms (and nothing is returned)."""

    class Index:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    plain = [5, 1, 0, 7, -3, 9]
    args = (8, b"p", bytes(8))
    want = compiled.chained(*args, plain, 2, 0, b"", b"", False)
    for form in ([Index(v) for v in plain], array("i", plain), tuple(plain),
                 [True if v == 1 else v for v in plain]):
        assert compiled.chained(*args, form, 2, 0, b"", b"", False) == want
        assert _chained_py(*args, form, 2, 0, b"", b"") == want
    for bad in (2**63, -2**63 - 1, 1.5, "7", None):
        tokens = [1, 2, bad, 4]
        with pytest.raises((OverflowError, TypeError)):
            compiled.chained(*args, tokens, 2, 0, b"", b"", False)
        with pytest.raises((struct.error, OverflowError, TypeError)):
            _chained_py(*args, tokens, 2, 0, b"", b"")


@needs_native
def test_a_token_whose_index_changes_the_list_is_read_safely() -> None:
    """A token's ``__index__`` that empties the list mid-read (never in the engine) neither
    crashes nor reads freed memory: the list is read as it was when the call began."""
    tokens: list = []

    class Emptying:
        def __index__(self) -> int:
            tokens.clear()
            tokens.extend(object() for _ in range(1000))
            return 3

    tokens.extend([1, Emptying(), 2, 4])
    snapshot = [1, 3, 2, 4]
    assert compiled.chained(8, b"", bytes(8), tokens, 2, 0, b"", b"", False) == \
        _by_hashlib(8, b"", bytes(8), snapshot, 2, 0, b"", b"")


@needs_native
def test_bad_arguments_are_refused_with_their_values() -> None:
    ok = (8, b"kvbm-blk", bytes(8), [1, 2], 1, 0, b"", b"", False)

    def call(i: int, value: object) -> None:
        args = list(ok)
        args[i] = value
        compiled.chained(*args)

    with pytest.raises(ValueError, match="digest_size 65"):
        call(0, 65)
    with pytest.raises(ValueError, match="17 bytes"):
        call(1, bytes(17))
    with pytest.raises(ValueError, match="first is 7 bytes"):
        call(2, bytes(7))
    with pytest.raises(ValueError, match="block_size 0"):
        call(4, 0)
    with pytest.raises(ValueError, match="as_u64"):
        compiled.chained(16, b"", bytes(16), [1], 1, 0, b"", b"", True)
    with pytest.raises(TypeError):
        call(6, "text")
    with pytest.raises(TypeError, match="9 arguments"):
        compiled.chained(*ok[:8])


def _key_by_hashlib(parent: int, tokens: list[int], suffix: bytes) -> int:
    """A tier content key by its definition (``chain_key``'s docstring), one hashlib object
    per block: all-u32 tokens as u32 under ``kvbm-blk-u32`` with the parent in BLAKE2b's salt
    field, any other block as int64 after the parent under ``kvbm-blk``."""
    if all(0 <= t < 2**32 for t in tokens):
        h = hashlib.blake2b(digest_size=8, person=b"kvbm-blk-u32",
                            salt=parent.to_bytes(8, "little"))
        h.update(struct.pack(f"<{len(tokens)}I", *tokens) + suffix)
    else:
        h = hashlib.blake2b(digest_size=8, person=b"kvbm-blk")
        h.update(struct.pack(f"<Q{len(tokens)}q", parent, *tokens) + suffix)
    return int.from_bytes(h.digest(), "little")


U32_EDGES = (0, 1, 2**32 - 1, 2**32, -1, 2**63 - 1, -2**63)


@needs_native
@pytest.mark.parametrize("seed", range(4))
def test_compiled_tier_keys_are_the_reference_and_the_definition(seed: int) -> None:
    """Random chains of tier content keys (``_digests_c.keys`` against ``_keys_py`` and
    hashlib): block sizes around one 128-byte compression, salts, u32's and int64's edges (a
    block past u32 takes the int64 form, the next block the u32 form again)."""
    rng = random.Random(seed)
    for _ in range(60):
        bs = rng.choice((1, 2, 3, 31, 32, 33, 64))
        blocks = rng.randrange(6)
        tokens = [rng.choice(U32_EDGES) if rng.random() < 0.02 else rng.randrange(200_000)
                  for _ in range(blocks * bs + rng.randrange(bs))]
        start = rng.randrange(blocks + 2)
        suffix = rng.choice((b"", b"\x00salt\x00", b"\x00salt\x00" + bytes(range(200))))
        parent = rng.choice((0, 2**64 - 1, rng.getrandbits(64)))
        want, key = [], parent
        for k in range(start, len(tokens) // bs):
            key = _key_by_hashlib(key, tokens[k * bs:(k + 1) * bs], suffix)
            want.append(key)
        assert content_keys._keys_py(parent, tokens, bs, start, suffix) == want
        assert compiled.keys(parent, tokens, bs, start, suffix) == want
        assert compiled.keys(parent, tuple(tokens), bs, start, suffix) == want


def test_the_two_forms_of_a_tier_key_are_kept_apart() -> None:
    """The u32 form and the int64 form hash under different personalisations: one block's
    tokens read in the other form give another key, and a token past u32 switches that block
    (only) to the int64 form."""
    tokens = [1, 2]
    u32 = chain_key(None, tokens)
    assert u32 == _key_by_hashlib(0, tokens, b"")
    as_i64 = hashlib.blake2b(struct.pack("<Q2q", 0, *tokens), digest_size=8, person=b"kvbm-blk")
    assert u32 != int.from_bytes(as_i64.digest(), "little")
    wide = chain_key(u32, [1, 2**32])
    assert wide == int.from_bytes(hashlib.blake2b(
        struct.pack("<Q2q", u32, 1, 2**32), digest_size=8, person=b"kvbm-blk").digest(), "little")
    assert block_keys([1, 2, 1, 2**32, 5, 6], 2) == [u32, wide, chain_key(wide, [5, 6])]


@needs_native
def test_tier_keys_refuse_bad_tokens_and_arguments_as_the_reference_does() -> None:
    """Ints with ``__index__`` and bools are read as their values; a token past int64 or not
    an integer raises in both forms; bad arguments name themselves."""

    class Index:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    plain = [5, 1, 0, 7, 3, 2**40]
    want = compiled.keys(7, plain, 2, 0, b"")
    for form in ([Index(v) for v in plain], tuple(plain), [True if v == 1 else v for v in plain]):
        assert compiled.keys(7, form, 2, 0, b"") == want
        assert content_keys._keys_py(7, form, 2, 0, b"") == want
    for bad in (2**63, -2**63 - 1, 1.5, "7", None):
        tokens = [1, 2, bad, 4]
        with pytest.raises((OverflowError, TypeError)):
            compiled.keys(0, tokens, 2, 0, b"")
        with pytest.raises((struct.error, OverflowError, TypeError)):
            content_keys._keys_py(0, tokens, 2, 0, b"")
    with pytest.raises(ValueError, match="block_size 0"):
        compiled.keys(0, [1], 0, 0, b"")
    with pytest.raises(ValueError, match="start -1"):
        compiled.keys(0, [1], 1, -1, b"")
    with pytest.raises(TypeError, match="suffix"):
        compiled.keys(0, [1], 1, 0, "salt")
    with pytest.raises(OverflowError):
        compiled.keys(-1, [1], 1, 0, b"")
    with pytest.raises(TypeError, match="5 arguments"):
        compiled.keys(0, [1], 1, 0)


def test_the_form_in_use_follows_the_switch() -> None:
    """``DYN_KVBM_NATIVE`` (read at import) picks the form: the compiled one wherever it
    was built and the switch is on, hashlib's otherwise."""
    expected = _compiled.loops("tier_digests")
    assert content_keys._COMPILED is expected
