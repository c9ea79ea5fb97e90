"""A small strict radix-tree router model for tests: the rules a strict KV-aware router applies.

One tree per (dp rank, medium). A store whose parent the tree does not hold, a removal of a
block it does not hold, a removal of a block whose descendants it still holds, and a store of a
hash it already holds are each a rule violation (a real router skips the store, logs the
removal or cuts the subtree). ``medium_of_store`` remembers each block's medium so a removal
with another medium is a violation too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class StrictTree:
    """Published blocks of one (dp rank, medium): hash -> parent hash."""

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}
        self.kids: dict[int | None, set[int]] = {}

    def __contains__(self, h: int) -> bool:
        return h in self.parent

    def store(self, hashes: Iterable[int], parent: int | None) -> list[str]:
        problems: list[str] = []
        if parent is not None and parent not in self.parent:
            return [f"store of {list(hashes)} under unknown parent {parent}"]
        p = parent
        for h in hashes:
            if h in self.parent:
                problems.append(f"store of {h}, already held")
            else:
                self.parent[h] = p
                self.kids.setdefault(p, set()).add(h)
            p = h
        return problems

    def remove(self, hashes: Iterable[int]) -> list[str]:
        problems: list[str] = []
        for h in hashes:
            if h not in self.parent:
                problems.append(f"removal of unknown block {h}")
            elif self.kids.get(h):
                problems.append(f"removal of {h} while it has descendants {self.kids[h]}")
            else:
                p = self.parent.pop(h)
                siblings = self.kids[p]
                siblings.discard(h)
                if not siblings:
                    del self.kids[p]
        return problems

    def check_closed(self) -> list[str]:
        return [f"{h} held under missing parent {p}" for h, p in self.parent.items()
                if p is not None and p not in self.parent]


class StrictRouter:
    """Strict trees per (dp rank, medium) fed with wire events (signed or unsigned hashes)."""

    def __init__(self) -> None:
        self.trees: dict[tuple[int, str], StrictTree] = {}
        self.violations: list[str] = []

    def tree(self, dp_rank: int, medium: str) -> StrictTree:
        return self.trees.setdefault((dp_rank, medium), StrictTree())

    def apply(self, dp_rank: int, events: Iterable[dict[str, Any]]) -> None:
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                self.violations += self.tree(dp_rank, ev.get("medium") or "GPU").store(
                    ev["block_hashes"], ev["parent_block_hash"])
            elif kind == "BlockRemoved":
                self.violations += self.tree(dp_rank, ev.get("medium") or "GPU").remove(
                    ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                for key in [k for k in self.trees if k[0] == dp_rank]:
                    del self.trees[key]
            else:
                self.violations.append(f"unknown event {kind}")

    def held(self, dp_rank: int, medium: str) -> set[int]:
        return set(self.tree(dp_rank, medium).parent)
