"""TensorRT-LLM's V1 block hash, bit-exact: known answers from the C++ ``BlockKeyHasher``
(compiled with g++ from blockKey.cpp's algorithm; libstdc++'s ``std::hash<std::string>``)."""

from __future__ import annotations

import pytest

from kvbm_plugin.naming._hashes import hash32_mix
from kvbm_plugin.naming.names import mm_hash_bytes, std_string_hash, v1_block_hash, v1_chain


def test_plain_chain_matches_the_cpp_hasher() -> None:
    root = v1_block_hash([1, 2, 3, 4])
    assert root == 924206229973855
    assert v1_block_hash([5, 6, 7, 8], root) == 2728178455351807326
    assert v1_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [root, 2728178455351807326]
    assert v1_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, parent=root) == \
        [2728178455351807326]


def test_salt_only_at_the_root_lora_on_every_block_and_task_zero_counts() -> None:
    # A partial block with a negative and a >32-bit-range token, salted, LoRA task 0.
    assert v1_block_hash([-1, 70000, 3], salt=12345, lora_task_id=0) == 10944639344975464553
    root = v1_block_hash([1, 2, 3, 4])
    assert v1_block_hash([9, 9, 9, 9], root, salt=12345, lora_task_id=7) == \
        12808585276775862248
    # below the root the salt is not mixed: the parent carries it
    assert v1_block_hash([9, 9, 9, 9], root, salt=12345) == v1_block_hash([9, 9, 9, 9], root)
    # task 0 is an adapter, unlike no LoRA
    assert v1_block_hash([1, 2, 3, 4], lora_task_id=0) != v1_block_hash([1, 2, 3, 4])


def test_libstdcxx_string_hash() -> None:
    assert std_string_hash("") == 6142509188972423790
    assert std_string_hash("tenant") == 17326526839868665529
    assert std_string_hash("a-longer-salt-of-19") == 12315669077740334204


def test_hash32_mix_wraps_the_golden_add_to_32_bits() -> None:
    # value 0 mixes to 0, so t = 0x9E3779B9 with no carry either way; pick a value whose mix
    # is >= 2**32 - 0x9E3779B9 so that a 64-bit add would differ.
    v = next(x for x in range(1, 10_000) if _mix32(x) + 0x9E3779B9 >= 1 << 32)
    t = (_mix32(v) + 0x9E3779B9) & 0xFFFFFFFF
    assert hash32_mix(v, 0) == t


def _mix32(a: int) -> int:
    a = (((a >> 16) ^ a) * 0x045D9F3B) & 0xFFFFFFFF
    a = (((a >> 16) ^ a) * 0x045D9F3B) & 0xFFFFFFFF
    return (a >> 16) ^ a


def test_multimodal_and_extra_ids_change_the_hash_and_bad_shapes_are_named() -> None:
    digest = mm_hash_bytes([1, 2, 3, 4, 5, 6, 7, -8])
    assert digest[:4] == b"\x00\x00\x00\x01" and digest[-4:] == b"\xff\xff\xff\xf8"
    plain = v1_block_hash([1, 2, 3, 4])
    assert v1_block_hash([1, 2, 3, 4], mm_keys=[(digest, 0)]) != plain
    assert v1_block_hash([1, 2, 3, 4], mm_keys=[(digest, 0)]) != \
        v1_block_hash([1, 2, 3, 4], mm_keys=[(digest, 4)])
    assert v1_block_hash([1, 2, 3, 4], extra_ids=[0, 0, 0, 0]) != plain
    with pytest.raises(ValueError, match="extra_ids"):
        v1_block_hash([1, 2], extra_ids=[0])
    with pytest.raises(ValueError, match="32"):
        v1_block_hash([1], mm_keys=[(b"x", 0)])
    with pytest.raises(ValueError, match="8"):
        mm_hash_bytes([1])
