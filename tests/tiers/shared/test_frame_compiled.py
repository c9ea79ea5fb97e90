"""The shared tier's compiled word sums (``tiers/shared/_frame_c.c``) against their references:
a bytes-only statement of the definition (needs no torch: CI's CPython 3.10 run compares the
compiled pass with it) and the torch reductions ``frame.checksum`` falls back to, on random
and adversarial input, aligned or not, short or many rows.

Both ways must give the same (S, W, tail) for every input: an object sealed by an engine on
one way is checked by engines on the other (a peer built without a compiler, or run with
``DYN_KVBM_NATIVE=0``).
"""

from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

import pytest
from _depth import depths, run_examples
from hypothesis import strategies as st

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.tiers.shared import frame

compiled = _compiled.loops("shared_frame", {})
needs_native = pytest.mark.skipif(compiled is None,
                                  reason="kvbm_plugin.tiers.shared._frame_c was not built")
MASK = (1 << 64) - 1
ROW = frame.ROW_BYTES


def spec_sums(data: bytes) -> tuple[int, int]:
    """(S, W) as frame.py's docstring defines them, word by word in Python."""
    assert len(data) % ROW == 0
    words = array("Q", data)
    if sys.byteorder == "big":
        words.byteswap()
    s = w = 0
    for r in range(len(words) // frame.ROW_WORDS):
        row = sum(words[r * frame.ROW_WORDS:(r + 1) * frame.ROW_WORDS])
        s += row
        w += (r + 1) * row
    return s & MASK, w & MASK


def adversarial() -> list[bytes]:
    """Inputs where a wrong lane, carry, weight or byte order would show."""
    top = struct.pack("<Q", MASK)
    high = struct.pack("<Q", 1 << 63)
    one_byte = [bytes(k) + b"\x01" + bytes(ROW - k - 1) for k in (0, 1, 7, 8, 63, 64, 511)]
    return [
        b"",
        bytes(ROW),
        b"\xff" * ROW,  # every word 2**64 - 1: the sum wraps on every add
        b"\xff" * (ROW * 300),  # (r + 1) * rowsum wraps too
        high * (ROW // 8) * 5,  # only the top bit: carries out of every lane
        bytes(range(256)) * 2 * 7,
        *one_byte,  # one byte at a lane's edge, a word's edge, the row's edge
        (top + bytes(ROW - 8)) * 3 + bytes(ROW - 8) + top,  # first and last word of rows
        b"\xff" * ROW + bytes(ROW),  # row order matters to W only
        bytes(ROW) + b"\xff" * ROW,
    ]


@needs_native
def test_the_compiled_sums_match_the_definition_on_adversarial_and_misaligned_input() -> None:
    for data in adversarial():
        assert compiled.sums(data) == spec_sums(data), len(data)
        for offset in (1, 3, 8):  # the buffer's start not 8-aligned, or 8 but not 16
            raw = bytearray(offset) + bytearray(data)
            assert compiled.sums(memoryview(raw)[offset:]) == spec_sums(data), offset


@needs_native
@depths(quick=150, thorough=1500)
def test_the_compiled_sums_match_the_definition_on_random_input(examples: int) -> None:
    def agree(rows: int, seed_bytes: bytes, offset: int) -> None:
        data = (seed_bytes * (rows * ROW // max(1, len(seed_bytes)) + 1))[:rows * ROW] \
            if seed_bytes else bytes(rows * ROW)
        raw = bytearray(offset) + bytearray(data)
        assert compiled.sums(memoryview(raw)[offset:]) == spec_sums(data)

    run_examples(examples, agree, st.integers(0, 40), st.binary(max_size=3 * ROW),
                 st.integers(0, 15))


@needs_native
def test_the_compiled_sums_refuse_a_partial_row_and_a_strided_buffer() -> None:
    with pytest.raises(ValueError, match=r"buffer length 513 is not a whole number of 512"):
        compiled.sums(bytes(ROW + 1))
    with pytest.raises(BufferError):
        compiled.sums(memoryview(bytearray(2 * ROW))[::2])
    with pytest.raises(TypeError):
        compiled.sums("not bytes")


def _tensor(data: bytes, tail: bytes = b"") -> Any:
    torch = pytest.importorskip("torch")
    return torch.frombuffer(bytearray(data + tail) or bytearray(1), dtype=torch.uint8)[
        :len(data) + len(tail)]


@needs_native
def test_the_compiled_checksum_matches_the_torch_reference_on_adversarial_input() -> None:
    for data in adversarial():
        for tail in (b"", b"\x01", b"\xff" * (ROW - 1)):
            payload = _tensor(data, tail)
            ours = frame.checksum(payload, native=True)
            assert ours == frame.checksum(payload, native=False), (len(data), len(tail))
            assert ours[:2] == spec_sums(data)


@needs_native
@depths(quick=60, thorough=600)
def test_the_compiled_checksum_matches_the_torch_reference_on_random_input(
        examples: int) -> None:
    torch = pytest.importorskip("torch")

    def agree(seed: int, n: int) -> None:
        g = torch.Generator().manual_seed(seed)
        payload = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert frame.checksum(payload, native=True) == frame.checksum(payload, native=False)

    # Past the torch path's 128 KiB slices (its own seams) and the 2 MiB page it serves.
    run_examples(examples, agree, st.integers(0, 2**32 - 1),
                 st.one_of(st.integers(0, 4 * ROW), st.integers(0, 300 << 10),
                           st.just(2 << 20)))


def test_native_true_without_the_compiled_sums_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_compiled._built, "shared_frame", None)
    with pytest.raises(ValueError, match=r"frame\.checksum: native=True"):
        frame.checksum(_tensor(bytes(ROW)), native=True)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
def test_a_payload_the_pass_would_misread_is_an_error_either_way(native: bool) -> None:
    """The compiled pass reads raw memory: a strided or wider-typed tensor is refused by name
    (never summed as if contiguous bytes), the same on both ways."""
    torch = pytest.importorskip("torch")
    whole = torch.zeros(4 * ROW, dtype=torch.uint8)
    for bad, what in ((whole[::2], "contiguous=False"), (whole.view(torch.int64), "int64")):
        with pytest.raises(ValueError, match=rf"frame\.checksum: payload must be .*{what}"):
            frame.checksum(bad, native=native)
