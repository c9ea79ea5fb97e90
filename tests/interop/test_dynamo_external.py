"""The shared tier's medium, ``EXTERNAL``, as NVIDIA Dynamo's real KV indexer reads it.

A worker advertises a chain it can load from the shared tier (medium ``EXTERNAL``), under a
device prefix and on its own, then removes it: the indexer must decode every batch, hold the
blocks in its external tier (``/dump``'s ``storage_tier`` ``external``) for that worker, drop
them on the removal, and log no warning.
"""

from __future__ import annotations

from pathlib import Path

from _feed import feed_indexer

from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.wire.events import MEDIUM_EXTERNAL, BlockRemoved, BlockStored

BS = 4


def _chain(first: int, n: int, parent: int | None, medium: str) -> list[BlockStored]:
    out = []
    for i in range(n):
        h = first + i
        out.append(BlockStored([h], parent, [h * 10 + t for t in range(BS)], BS,
                               medium=medium))
        parent = h
    return out


def test_the_indexer_holds_external_blocks_and_removes_them(indexer: Indexer,
                                                            tmp_path: Path) -> None:
    device = _chain(100, 2, None, "GPU")
    shared = _chain(200, 3, 101, MEDIUM_EXTERNAL) + _chain(300, 2, None, MEDIUM_EXTERNAL)
    removal = [BlockRemoved([202, 301], medium=MEDIUM_EXTERNAL)]
    feed_indexer(indexer, tmp_path, [((1, 0), device), ((1, 0), shared), ((1, 0), removal)],
                 BS)
    held = indexer.held()
    assert held.get((1, 0, "EXTERNAL")) == {200, 201, 300}
    assert {100, 101} <= held.get((1, 0, "GPU"), set())
    assert indexer.warnings() == []
