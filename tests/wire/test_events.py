"""The wire codec: strict encoding, tolerant decoding, clear errors."""

from __future__ import annotations

import msgpack
import pytest

from kvbm_plugin.wire.events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    WireFormatError,
    decode_event,
    decode_message,
    encode_batch,
    normalize_medium,
    to_signed_int64,
    to_unsigned_u64,
)


@pytest.mark.parametrize(("unsigned", "signed"), [(0, 0), (2**63 - 1, 2**63 - 1),
                                                  (2**63, -(2**63)), (2**64 - 1, -1)])
def test_signed_unsigned_round_trip(unsigned: int, signed: int) -> None:
    assert to_signed_int64(unsigned) == signed
    assert to_signed_int64(signed) == signed
    assert to_unsigned_u64(signed) == unsigned
    assert to_unsigned_u64(unsigned) == unsigned


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
def test_out_of_range_hash(bad: int) -> None:
    with pytest.raises(WireFormatError, match=str(bad)):
        to_signed_int64(bad)
    with pytest.raises(WireFormatError, match=str(bad)):
        to_unsigned_u64(bad)


def test_encode_is_three_frames_with_maps_and_signed_hashes() -> None:
    frames = encode_batch(b"kv", 2**40, 1.5, [BlockStored([2**64 - 1], 2**63, [1, 2], 2),
                                              BlockRemoved([3])], 4)
    assert frames[0] == b"kv" and frames[1] == (2**40).to_bytes(8, "big")
    ts, events, rank = msgpack.unpackb(frames[2])
    assert (ts, rank) == (1.5, 4)
    assert events[0] == {"type": "BlockStored", "block_hashes": [-1],
                         "parent_block_hash": -(2**63), "token_ids": [1, 2], "block_size": 2,
                         "lora_id": None, "medium": "GPU", "lora_name": None}
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    assert END_SEQ == b"\xff" * 8


def test_decode_legacy_arrays_two_frames_and_aliases() -> None:
    payload = msgpack.packb([0.5, [["BlockStored", [-1], None, [7, 8], 2, None, "cpu_pinned"],
                                   ["BlockRemoved", [5], "nvme"], ["AllBlocksCleared"]]])
    batch = decode_message([b"", payload])
    assert batch.seq is None and batch.data_parallel_rank is None
    stored, removed, _ = batch.events
    assert stored.block_hashes == [2**64 - 1] and stored.medium == "CPU"
    assert removed.medium == "DISK"
    assert [normalize_medium(m) for m in ("device", "CPU_TIER1", "cpu_tier2", "Storage")] == [
        "GPU", "CPU", "DISK", "DISK"]


@pytest.mark.parametrize(("raw", "needle"), [
    ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1,
      "medium": "TAPE"}, "'TAPE'"),
    ({"type": "BlockMoved"}, "'BlockMoved'"),
    ({"type": "BlockRemoved", "block_hashes": ["x"]}, "'x'"),
    ({"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}, "0"),
    (42, "42"),
])
def test_decode_errors_name_the_value(raw, needle: str) -> None:
    with pytest.raises(WireFormatError, match=needle):
        decode_event(raw)


@pytest.mark.parametrize("frames", [[b"a"], [b"", b"123", b"\x90"], [b"", b"\x00" * 8, b"\xc1"],
                                    [b"", b"\x00" * 8, msgpack.packb([1.0])]])
def test_decode_message_errors(frames) -> None:
    with pytest.raises(WireFormatError):
        decode_message(frames)
