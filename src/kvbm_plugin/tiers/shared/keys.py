"""Shared-tier object keys: one object per block per TP rank, named so that it can never be
loaded by an engine for which its bytes are wrong.

Called on the leader (the executor thread, at match and offload: one blake2b per block, no I/O)
and in every worker (key strings for its own rank).

A key is ``<namespace>/<model key>/<shard>/lg<layer group>/t<tokens per block>b<bytes per
page>/<dtype>.<layout>/<content digest, 32 hex>``; ``<shard>`` is ``w<world>r<rank>``, or
``replicated`` for pages identical on every rank (MLA). The content digest is a 128-bit
BLAKE2b chained over the block's tokens and its parent's digest, with the request's reuse
scope (cache salt, LoRA task id with task 0 an adapter, multimodal keys:
:func:`kvbm_plugin.wire.identity.request_scope`): ``content_keys.chain_digest``, whose first
8 bytes are the block's key in this engine's host and disk tiers. Everything that changes the
bytes of a page is in the key: another model, TP shard, block size, page size, dtype or layout
is another key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbm_plugin.tiers.content_keys import DIGEST_BYTES, block_digests, chain_digest

__all__ = ["DIGEST_BYTES", "SharedLayout", "chain_digests", "content_digest"]


def content_digest(parent: bytes | None, tokens: Sequence[int], scope: str | None) -> bytes:
    """The 16-byte content digest of one full block: its parent's digest (None for a root),
    its token ids and the reuse scope (None: the base model, no salt, no multimodal keys).
    The tiers' one block digest (``content_keys.chain_digest``): the host and disk tiers' key
    of a block is this digest's first 8 bytes."""
    return chain_digest(parent, tokens, scope)


def chain_digests(tokens: Sequence[int], block_size: int, scope: str | None, *,
                  start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Digests of the full blocks ``start..`` of ``tokens`` (``parent``: block ``start - 1``'s):
    :func:`content_digest` along the chain (the leader keeps them with a request's content
    keys, computed together: ``content_keys.block_keys``)."""
    return block_digests(tokens, block_size, scope, start=start, parent=parent)


@dataclass(frozen=True)
class SharedLayout:
    """What a page's bytes depend on, besides its content: the key prefix of one rank."""

    namespace: str
    model_key: str
    world: int  # TP size
    rank: int | None  # None: the page is identical on every rank ("replicated")
    layer_group: int
    tokens_per_block: int
    bytes_per_page: int  # this rank's bytes of one block
    dtype: str  # e.g. "bfloat16"
    layout: str  # e.g. "v1pool" (the pool's per-block layout)

    @property
    def shard(self) -> str:
        return "replicated" if self.rank is None else f"w{self.world}r{self.rank}"

    def prefix(self) -> str:
        return (f"{self.namespace}/{self.model_key}/{self.shard}/lg{self.layer_group}/"
                f"t{self.tokens_per_block}b{self.bytes_per_page}/{self.dtype}.{self.layout}/")

    def key(self, digest: bytes) -> str:
        """The object key of the block with ``digest`` in this rank's shard."""
        return self.prefix() + digest.hex()

    def for_rank(self, rank: int) -> SharedLayout:
        """The same layout for another rank of the TP group (same page size on every rank)."""
        if self.rank is None:
            return self
        return SharedLayout(self.namespace, self.model_key, self.world, rank, self.layer_group,
                            self.tokens_per_block, self.bytes_per_page, self.dtype, self.layout)
