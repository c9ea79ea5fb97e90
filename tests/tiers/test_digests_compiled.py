"""The tiers' compiled chained digests (``tiers/_digests_c.c``) against their reference
(``tiers/content_keys.py``'s ``_chained_py``) and against hashlib's BLAKE2b block by block:
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


def test_the_form_in_use_follows_the_switch() -> None:
    """``DYN_KVBM_NATIVE`` (read at import) picks the form: the compiled one wherever it
    was built and the switch is on, hashlib's otherwise."""
    expected = _compiled.loops("tier_digests")
    assert content_keys._COMPILED is expected
