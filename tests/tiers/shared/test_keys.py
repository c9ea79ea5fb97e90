"""Shared-tier keys: every SharedLayout field and every part of the reuse scope is in the key,
so a block of another model, shard, layout, tenant, adapter or image is another object."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from kvbm_plugin.tiers.shared.keys import (
    DIGEST_BYTES,
    SharedLayout,
    chain_digests,
    content_digest,
)
from kvbm_plugin.wire.identity import request_scope

BASE = SharedLayout("kvbm", "llama-3.1-8b@rev1", 2, 0, 0, 32, 65536, "bfloat16", "v1pool")
DIGEST = content_digest(None, list(range(32)), None)

CHANGED = {"namespace": "other", "model_key": "llama-3.1-8b@rev2", "world": 4, "rank": 1,
           "layer_group": 1, "tokens_per_block": 64, "bytes_per_page": 131072,
           "dtype": "float16", "layout": "v2page"}


def test_the_key_grammar() -> None:
    key = BASE.key(DIGEST)
    assert key == f"kvbm/llama-3.1-8b@rev1/w2r0/lg0/t32b65536/bfloat16.v1pool/{DIGEST.hex()}"
    assert re.fullmatch(r"[^/]+(/[^/]+){6}", key)
    assert len(DIGEST) == DIGEST_BYTES == 16


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SharedLayout)])
def test_every_layout_field_changes_the_key(field: str) -> None:
    assert set(CHANGED) == {f.name for f in dataclasses.fields(SharedLayout)}
    other = dataclasses.replace(BASE, **{field: CHANGED[field]})
    assert other.key(DIGEST) != BASE.key(DIGEST)
    assert not other.key(DIGEST).startswith(BASE.prefix())


def test_replicated_pages_are_one_key_for_every_rank() -> None:
    replicated = dataclasses.replace(BASE, rank=None)
    assert replicated.shard == "replicated"
    assert replicated.for_rank(1).key(DIGEST) == replicated.key(DIGEST)
    assert replicated.key(DIGEST) not in {BASE.for_rank(r).key(DIGEST) for r in range(2)}
    assert BASE.for_rank(1).key(DIGEST) != BASE.key(DIGEST)


def _scope(**fields: object) -> str | None:
    return request_scope(SimpleNamespace(**fields))


SCOPES = {
    "base": _scope(),
    "salt a": _scope(cache_salt="tenant-a"),
    "salt b": _scope(cache_salt="tenant-b"),
    "lora 0": _scope(lora_task_id=0),
    "lora 1": _scope(lora_task_id=1),
    "mm x": _scope(multimodal_hashes=[[1, 2, 3]]),
    "mm y": _scope(multimodal_hashes=[[1, 2, 4]]),
    "salt a + lora 0": _scope(cache_salt="tenant-a", lora_task_id=0),
    "salt a + mm x": _scope(cache_salt="tenant-a", multimodal_hashes=[[1, 2, 3]]),
}


def test_every_scope_part_changes_the_digest() -> None:
    """Salt, LoRA task id (0 is an adapter, not the base model) and multimodal keys."""
    assert SCOPES["base"] is None and SCOPES["lora 0"] is not None
    tokens = list(range(96))
    chains = {name: tuple(chain_digests(tokens, 32, scope)) for name, scope in SCOPES.items()}
    for i, a in enumerate(chains.values()):
        for b in list(chains.values())[i + 1:]:
            assert not set(a) & set(b)  # no block of one scope is a block of another


def test_the_digest_chains_over_the_prefix() -> None:
    a = chain_digests(list(range(96)), 32, None)
    b = chain_digests([7] + list(range(1, 96)), 32, None)  # first token differs
    assert len(a) == 3 and all(x != y for x, y in zip(a, b, strict=True))
    assert chain_digests(list(range(96)), 32, None, start=2, parent=a[1]) == a[2:]
    assert chain_digests(list(range(95)), 32, None) == a[:2]  # partial block: no digest


def test_chain_digests_are_content_digests_along_the_chain() -> None:
    """chain_digests packs a request's tokens once; every digest is still content_digest's
    (the definition every engine's object keys are made by)."""
    import random

    rng = random.Random(11)
    for _ in range(40):
        bs = rng.choice([1, 4, 32])
        tokens = [rng.randrange(-(1 << 63), 1 << 63) if rng.random() < 0.05
                  else rng.randrange(0, 200_000) for _ in range(rng.randrange(0, 7 * bs))]
        scope = rng.choice([None, "", "salt:tenant", "lora:0", "ü" * 3])
        start = rng.randrange(0, 3)
        parent = rng.choice([None, bytes(DIGEST_BYTES), DIGEST])
        expected, digest = [], parent
        for i in range(start, len(tokens) // bs):
            digest = content_digest(digest, tokens[i * bs:(i + 1) * bs], scope)
            expected.append(digest)
        assert chain_digests(tokens, bs, scope, start=start, parent=parent) == expected
    # pinned: the tiers' one block digest (content_keys.chain_digest), which announcements
    # of version 3 carry; the shared tier's own earlier form read f5deca61835dafc351aa4d8d559f7bc9
    assert DIGEST.hex() == "3ec134face07e9982a51bf4f1ac9d970"
