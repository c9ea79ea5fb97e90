"""Models with several KV layer groups: the worker's side (the leader's is
:mod:`kvbm_plugin.leader.layer_groups`).

TensorRT-LLM hands such a cache as ``register_kv_cache_layout(layout)`` instead of
``register_kv_caches`` (``connectors/kv_cache_connector.py`` @ 035ab91cad04, stored id
68382362537): ``layout.groups[*]`` with ``layer_group_id``, ``window_size``, ``layer_ids``,
``bytes_per_page`` and ``regions``; page slot ``i`` of a region is ``region.as_tensor()[i]``
(``connectors/kv_cache_layout.py``, stored id 57717663703). Page indices are scoped to their
group, so each op carries every group's page (``SaveOp.pages`` / ``LoadCopy.pages``) and a
tier slot holds the groups' pages one after another: group 0's regions, then group 1's...
A page of -1 (a sliding window's passed block) is never addressed: its segment of the slot is
neither read nor written.

Hybrid models are refused here, at bring-up: a group whose buffers carry a recurrent-state
role (``ssm_state``, ``conv_state``: ``MambaRole`` in TensorRT-LLM's
``kv_cache/mamba_cache_manager/common.py``) holds state that reuses only at snapshot
boundaries, not per block.

Called from the worker's transfer, completion and disk threads (pairs, gather, scatter) and
once from ``register_kv_cache_layout`` (main thread).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where bytes move: `import kvbm_plugin` needs no torch
    import torch

RECURRENT_ROLES = ("ssm_state", "conv_state")


def refuse_hybrid(layout: Any) -> None:
    """ValueError in one line naming the layer kinds when a group holds recurrent state."""
    kinds = sorted({str(b.role) for g in layout.groups for r in g.regions for b in r.buffers
                    if str(b.role) in RECURRENT_ROLES})
    if kinds:
        layers = sorted({b.layer_id for g in layout.groups for r in g.regions
                         for b in r.buffers if str(b.role) in RECURRENT_ROLES})
        raise ValueError(f"kvbm_plugin: hybrid model refused: layers {layers[:8]}"
                         f"{'...' if len(layers) > 8 else ''} hold {'/'.join(kinds)} "
                         "(Mamba / linear attention) state, which reuses only at snapshot "
                         "boundaries, not per block: run without the connector")


@dataclass(frozen=True)
class _Segment:
    group: int  # position of the group in the op's pages
    region: torch.Tensor  # [num_slots, size] bytes of one region
    offset: int  # where in the tier slot
    size: int


class GroupPages:
    """Every group's regions as byte views, and where each lands in a tier slot."""

    def __init__(self, layout: Any) -> None:
        import torch

        refuse_hybrid(layout)
        groups = sorted(layout.groups, key=lambda g: g.layer_group_id)
        ids = [g.layer_group_id for g in groups]
        if ids != list(range(len(groups))):
            raise ValueError(f"kvbm_plugin: layer group ids {ids} are not 0..{len(groups) - 1}"
                             " (RequestData.new_block_ids_by_layer_group is indexed by them)")
        segments: list[_Segment] = []
        offset = 0
        for pos, group in enumerate(groups):
            if not group.regions:
                raise ValueError(f"kvbm_plugin: layer group {group.layer_group_id} has no "
                                 "region")
            for region in group.regions:
                view = region.as_tensor(torch.uint8)
                segments.append(_Segment(pos, view, offset, int(region.size)))
                offset += int(region.size)
        self.segments: tuple[_Segment, ...] = tuple(segments)
        self.windows: tuple[int | None, ...] = tuple(g.window_size for g in groups)
        self.page_bytes: tuple[int, ...] = tuple(int(g.bytes_per_page) for g in groups)
        self.block_bytes = offset  # one tier slot
        self.num_slots = min(int(r.num_slots) for g in groups for r in g.regions)
        self.last_layer = max(layer for g in groups for layer in g.layer_ids)
        self.device = segments[0].region.device
        # What a tier slot's bytes mean, for the disk header: every group's window and, per
        # region in slot order, its size and buffers (layer, role) in memory order. The
        # distinct windows alone do not say it: [8, 4096, 4096, 8, 8, 4096] and [8, 4096]
        # have the same windows and slot size but different layers in each group.
        described = repr([(g.window_size, [(int(r.size), [(int(b.layer_id), str(b.role))
                                                          for b in r.buffers])
                                           for r in g.regions]) for g in groups])
        self.identity = ";groups=" + hashlib.blake2b(described.encode(),
                                                     digest_size=12).hexdigest()

    def describe(self) -> str:
        return ", ".join(f"group {g}: window {w or 'full'}, {b} B/page"
                         for g, (w, b) in enumerate(zip(self.windows, self.page_bytes,
                                                        strict=True)))

    def _valid(self, pages: Sequence[int], seg: _Segment) -> int | None:
        page = pages[seg.group] if seg.group < len(pages) else -1
        return page if 0 <= page < seg.region.shape[0] else None

    def bad_page(self, pages: Sequence[int]) -> tuple[int, int] | None:
        """(group, page) of the first page of a save that addresses no page of its group's
        pool (a save reads every group's page: -1 or past the pool is never valid there)."""
        for seg in self.segments:
            page = pages[seg.group] if seg.group < len(pages) else -1
            if not 0 <= page < seg.region.shape[0]:
                return seg.group, page
        return None

    def save_pairs(self, pages: Sequence[int], slot: torch.Tensor) -> list[tuple[Any, Any]]:
        """(dst, src) copies of a block's live pages into tier slot ``slot`` (1-D bytes)."""
        out = []
        for seg in self.segments:
            page = self._valid(pages, seg)
            if page is not None:
                out.append((slot[seg.offset:seg.offset + seg.size], seg.region[page]))
        return out

    def load_pairs(self, pages: Sequence[int], slot: torch.Tensor) -> list[tuple[Any, Any]]:
        """(dst, src) copies of tier slot ``slot`` into the block's pages (-1: skipped)."""
        return [(dst, src) for src, dst in self.save_pairs(pages, slot)]

    def gather(self, pages: Sequence[int], staging: torch.Tensor) -> None:
        """The block's pages into ``staging`` (1-D bytes, host), synchronously."""
        for dst, src in self.save_pairs(pages, staging):
            dst.copy_(src)

    def scatter(self, staging: torch.Tensor, pages: Sequence[int],
                non_blocking: bool = False) -> None:
        """``staging`` (1-D bytes) into the block's pages; -1 pages are left alone."""
        for dst, src in self.load_pairs(pages, staging):
            dst.copy_(src, non_blocking=non_blocking)
