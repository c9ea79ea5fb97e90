"""The tiers' compiled block digests (``tiers/_digests_c.c``'s ``keys``) against their
reference (``tiers/content_keys.py``'s ``_keys_py``) and against hashlib's BLAKE2b block by
block: a block's digest names it in the host and disk tiers (its first 8 bytes) and in the
shared tier (all 16) whichever form runs (an engine restarted with ``DYN_KVBM_NATIVE=0`` keeps
its tiers' names, and two engines of one shared tier agree). No torch: this runs on every
CPython the package supports.
"""

from __future__ import annotations

import hashlib
import random
import struct
from array import array

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.tiers import content_keys
from kvbm_plugin.tiers.content_keys import block_digests, block_keys, chain_digest, key_of
from kvbm_plugin.tiers.shared.keys import chain_digests, content_digest

compiled = _compiled.loops("tier_digests", {})
needs_native = pytest.mark.skipif(compiled is None,
                                  reason="kvbm_plugin.tiers._digests_c was not built")

U32_EDGES = (0, 1, 2**32 - 1, 2**32, -1, 2**31, -2**31, 2**63 - 1, -2**63)
ROOT = bytes(16)


def _by_hashlib(parent: bytes, tokens: list[int], suffix: bytes) -> bytes:
    """A block's digest by its definition (``chain_digest``'s docstring), one hashlib object
    per block: all-u32 tokens as u32 under ``kvbm-blk-u32`` with the parent's digest in
    BLAKE2b's salt field, any other block as int64 after the parent's digest under
    ``kvbm-blk``."""
    if all(0 <= t < 2**32 for t in tokens):
        h = hashlib.blake2b(digest_size=16, person=b"kvbm-blk-u32", salt=parent)
        h.update(struct.pack(f"<{len(tokens)}I", *tokens) + suffix)
    else:
        h = hashlib.blake2b(digest_size=16, person=b"kvbm-blk")
        h.update(parent + struct.pack(f"<{len(tokens)}q", *tokens) + suffix)
    return h.digest()


def _chain(parent: bytes, tokens: list[int], bs: int, start: int,
           suffix: bytes) -> list[bytes]:
    out, digest = [], parent
    for k in range(start, len(tokens) // bs):
        digest = _by_hashlib(digest, tokens[k * bs:(k + 1) * bs], suffix)
        out.append(digest)
    return out


def _both(parent: bytes, tokens: object, bs: int, start: int,
          suffix: bytes) -> tuple[list[int], list[bytes]]:
    digests: list[bytes] = []
    keys = compiled.keys(parent, tokens, bs, start, suffix, digests)
    return keys, digests


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_compiled_digests_are_the_reference_and_the_definition(seed: int) -> None:
    """Random chains: block sizes around one 128-byte compression, salts (suffixes) across
    BLAKE2b's block edges, u32's and int64's edges (a block past u32 takes the int64 form, the
    next block the u32 form again), a partial tail that is never read, a start inside the
    prompt and past it; each key is its digest's first 8 bytes."""
    rng = random.Random(seed)
    for _ in range(60):
        bs = rng.choice((1, 2, 3, 13, 31, 32, 33, 64))
        blocks = rng.randrange(6)
        tokens = [rng.choice(U32_EDGES) if rng.random() < 0.03 else rng.randrange(200_000)
                  for _ in range(blocks * bs + rng.randrange(bs))]
        start = rng.randrange(blocks + 2)
        suffix = rng.choice((b"", b"\x00salt\x00", b"\x00salt\x00" + bytes(range(200))))
        parent = rng.choice((ROOT, b"\xff" * 16, rng.randbytes(16)))
        want = _chain(parent, tokens, bs, start, suffix)
        keys = [key_of(d) for d in want]
        ref: list[bytes] = []
        assert content_keys._keys_py(parent, tokens, bs, start, suffix, ref) == keys
        assert ref == want
        assert _both(parent, tokens, bs, start, suffix) == (keys, want)
        assert _both(parent, tuple(tokens), bs, start, suffix) == (keys, want)
        assert compiled.keys(parent, tokens, bs, start, suffix, None) == keys


@needs_native
def test_every_message_length_around_blake2b_blocks() -> None:
    """Both forms' messages from 4 to 400 bytes (the last 128-byte block partial, full and
    one byte over): one token and a suffix of every length up to 384 bytes."""
    pattern = bytes(range(256)) * 2
    for extra in range(385):
        for token in (7, 2**40):  # the u32 form (4 + extra bytes), the int64 (24 + extra)
            suffix = pattern[:extra]
            want = _chain(ROOT, [token], 1, 0, suffix)
            assert _both(ROOT, [token], 1, 0, suffix) == ([key_of(want[0])], want), extra


def test_block_keys_and_the_shared_digests_are_chain_digest_along_the_chain() -> None:
    """Whichever form is in use: block_keys' digests are chain_digest along the chain (salt
    and a start inside the prompt included), its keys their first 8 bytes; the shared tier's
    digests are the same digests (content_digest is chain_digest)."""
    rng = random.Random(3)
    tokens = [rng.randrange(1 << 17) for _ in range(16 * 9 + 5)]
    for salt in (None, "tenant-a", "lora:7"):
        digests, parent = [], None
        for k in range(9):
            parent = chain_digest(parent, tokens[16 * k:16 * (k + 1)], salt)
            digests.append(parent)
        got: list[bytes] = []
        assert block_keys(tokens, 16, salt, digests=got) == [key_of(d) for d in digests]
        assert got == digests == block_digests(tokens, 16, salt)
        assert block_keys(tokens, 16, salt, start=4, parent=digests[3]) == \
            [key_of(d) for d in digests[4:]]
        assert chain_digests(tokens, 16, salt) == digests
        assert chain_digests(tokens, 16, salt, start=5, parent=digests[4]) == digests[5:]
        assert content_digest(digests[0], tokens[16:32], salt) == digests[1]
    assert block_digests(tokens, 16, "tenant-a") != block_digests(tokens, 16, "tenant-b")


def test_the_two_forms_of_a_digest_are_kept_apart() -> None:
    """The u32 form and the int64 form hash under different personalisations: one block's
    tokens read in the other form give another digest, and a token past u32 switches that block
    (only) to the int64 form."""
    tokens = [1, 2]
    u32 = chain_digest(None, tokens)
    assert u32 == _by_hashlib(ROOT, tokens, b"")
    as_i64 = hashlib.blake2b(ROOT + struct.pack("<2q", *tokens), digest_size=16,
                             person=b"kvbm-blk").digest()
    assert u32 != as_i64
    wide = chain_digest(u32, [1, 2**32])
    assert wide == hashlib.blake2b(u32 + struct.pack("<2q", 1, 2**32), digest_size=16,
                                   person=b"kvbm-blk").digest()
    assert block_digests([1, 2, 1, 2**32, 5, 6], 2) == [u32, wide, chain_digest(wide, [5, 6])]


def test_the_digest_is_pinned() -> None:
    """The definition, pinned: a change to it renames every block (the shared tier's objects
    and other engines' announcements too), so it is a decision, not an accident."""
    assert chain_digest(None, [1, 2]).hex() == _by_hashlib(ROOT, [1, 2], b"").hex()
    assert key_of(chain_digest(None, [1, 2])) == int.from_bytes(
        hashlib.blake2b(struct.pack("<2I", 1, 2), digest_size=16, person=b"kvbm-blk-u32",
                        salt=ROOT).digest()[:8], "little")


@needs_native
def test_tokens_of_any_int_form_and_bad_tokens_are_refused_alike() -> None:
    """Bools, ints with ``__index__`` and an int32 array are read as their values; a token past
    int64 or not an integer raises in both forms (and nothing is returned)."""

    class Index:
        def __init__(self, value: int) -> None:
            self.value = value

        def __index__(self) -> int:
            return self.value

    plain = [5, 1, 0, 7, 3, 2**40]
    want = _both(ROOT, plain, 2, 0, b"")
    for form in ([Index(v) for v in plain], tuple(plain),
                 [True if v == 1 else v for v in plain]):
        assert _both(ROOT, form, 2, 0, b"") == want
        ref: list[bytes] = []
        assert (content_keys._keys_py(ROOT, form, 2, 0, b"", ref), ref) == want
    small = [5, 1, 0, 7, -3, 9]
    assert _both(ROOT, array("i", small), 2, 0, b"") == _both(ROOT, small, 2, 0, b"")
    for bad in (2**63, -2**63 - 1, 1.5, "7", None):
        tokens = [1, 2, bad, 4]
        with pytest.raises((OverflowError, TypeError)):
            compiled.keys(ROOT, tokens, 2, 0, b"", None)
        with pytest.raises((struct.error, OverflowError, TypeError)):
            content_keys._keys_py(ROOT, tokens, 2, 0, b"", None)


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
    assert _both(ROOT, tokens, 2, 0, b"")[1] == _chain(ROOT, [1, 3, 2, 4], 2, 0, b"")


@needs_native
def test_bad_arguments_are_refused_with_their_values() -> None:
    with pytest.raises(ValueError, match="block_size 0"):
        compiled.keys(ROOT, [1], 0, 0, b"", None)
    with pytest.raises(ValueError, match="start -1"):
        compiled.keys(ROOT, [1], 1, -1, b"", None)
    with pytest.raises(TypeError, match="suffix"):
        compiled.keys(ROOT, [1], 1, 0, "salt", None)
    with pytest.raises(ValueError, match="16-byte digest"):
        compiled.keys(bytes(8), [1], 1, 0, b"", None)
    with pytest.raises(TypeError, match="digests is a list"):
        compiled.keys(ROOT, [1], 1, 0, b"", ())
    with pytest.raises(TypeError, match="6 arguments"):
        compiled.keys(ROOT, [1], 1, 0, b"")
    with pytest.raises(ValueError, match="parent b'ab'"):
        block_keys([1], 1, parent=b"ab")
    with pytest.raises(ValueError, match="parent 7"):
        block_keys([1], 1, parent=7)  # type: ignore[arg-type]  # a key is not a digest
