"""Blocks and a settable clock for the shared-tier directory and agent tests."""

from __future__ import annotations

from kvbm_plugin.tiers.shared.block import SharedBlock
from kvbm_plugin.tiers.shared.keys import SharedLayout, content_digest

BLOCK = 4  # tokens per block in these tests


class Clock:
    """A clock the test moves (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def chain(length: int, *, first_token: int = 100, scope: str | None = None,
          parent: SharedBlock | None = None, lora_id: int | None = None,
          extra_keys: tuple | None = None) -> list[SharedBlock]:
    """``length`` blocks of a chain (continuing ``parent``), with digests as the leader makes
    them and event hashes that differ per block."""
    out: list[SharedBlock] = []
    for i in range(length):
        tokens = tuple(range(first_token + i * BLOCK, first_token + (i + 1) * BLOCK))
        digest = content_digest(None if parent is None else parent.digest, tokens, scope)
        block = SharedBlock(
            digest=digest, parent_digest=None if parent is None else parent.digest,
            event_hash=int.from_bytes(digest[:8], "little", signed=True),
            parent_event_hash=None if parent is None else parent.event_hash,
            token_ids=tokens, lora_id=lora_id, extra_keys=extra_keys)
        out.append(block)
        parent = block
    return out


def layouts(world: int = 2, *, model_key: str = "m", namespace: str = "test", page: int = 64,
            ) -> list[SharedLayout]:
    base = SharedLayout(namespace, model_key, world, 0, 0, BLOCK, page, "bfloat16", "v1pool")
    return [base.for_rank(r) for r in range(world)]
