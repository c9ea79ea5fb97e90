"""Stand-ins for TensorRT-LLM's KV cache layout, what ``register_kv_cache_layout`` receives.

Names, fields and methods as upstream's ``tensorrt_llm/_torch/pyexecutor/connectors/
kv_cache_layout.py`` (stored id 57717663703, the revision paired with the connector module
@ 035ab91cad04): ``valid_page_slots``, ``KvCacheBufferRef``, ``KvCacheRegion`` (``base``,
``size``, ``stride``, ``num_slots``, ``buffers``; ``address_of``, ``as_tensor``,
``slot_tensor``), ``KvCacheLayerGroupLayout`` (``layer_group_id``, ``layer_ids``,
``window_size``, ``regions``; ``bytes_per_page``) and ``KvCacheLayout`` (``tokens_per_block``,
``groups``, ``dtype``; ``group``, ``group_of_layer``, ``as_single_pool_tensor``).

The one difference: upstream builds a region's tensors from a raw device address
(``TensorWrapper``); here a region keeps the torch tensor it describes (``_tensor``, bytes
``[num_slots, stride]``), from which the same views are cut. Used by the simulated
sliding-window executor (:mod:`kvbm_plugin.testing.vswa_engine`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

BAD_PAGE_INDEX = -1


def valid_page_slots(page_indices: Iterable[int]) -> Iterator[tuple[int, int]]:
    """``(block_ordinal, page_slot)`` of the entries that address a page (``slot >= 0``)."""
    for ordinal, slot in enumerate(page_indices):
        if slot >= 0:
            yield ordinal, slot


@dataclass(frozen=True)
class KvCacheBufferRef:
    """One ``(layer, role)`` buffer covered by a region, in memory order."""

    layer_id: int
    role: str
    expansion: int = 1


@dataclass(frozen=True)
class KvCacheRegion:
    """A byte range repeating once per page slot: slot ``i`` at ``base + stride * i``."""

    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[KvCacheBufferRef, ...]
    _tensor: torch.Tensor = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @classmethod
    def over(cls, pages: torch.Tensor, buffers: tuple[KvCacheBufferRef, ...]) -> KvCacheRegion:
        """A region over a contiguous ``[num_slots, ...]`` pool tensor (one page per row)."""
        rows = pages.reshape(pages.shape[0], -1).view(torch.uint8)
        return cls(rows.data_ptr(), rows.shape[1], rows.stride(0), rows.shape[0], buffers, rows)

    def address_of(self, slot_id: int) -> int:
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot_id {slot_id} out of range [0, {self.num_slots})")
        return self.base + self.stride * slot_id

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A ``[num_slots, size // itemsize]`` view; row ``i`` is slot ``i``."""
        return self._tensor[:, :self.size].view(dtype)

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """One slot's view; ``IndexError`` for a slot that addresses no page (-1 included)."""
        self.address_of(slot_id)
        return self.as_tensor(dtype)[slot_id]


@dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    """One layer group, the unit page indices are scoped to."""

    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None  # None: full attention
    regions: tuple[KvCacheRegion, ...]

    @property
    def bytes_per_page(self) -> int:
        return sum(region.size for region in self.regions)


@dataclass(frozen=True)
class KvCacheLayout:
    """What a connector is handed in place of one KV cache pool tensor."""

    tokens_per_block: int
    groups: tuple[KvCacheLayerGroupLayout, ...]
    dtype: torch.dtype = torch.uint8

    def group(self, layer_group_id: int) -> KvCacheLayerGroupLayout:
        for group in self.groups:
            if group.layer_group_id == layer_group_id:
                return group
        raise KeyError(f"no layer group {layer_group_id} in layout")

    def group_of_layer(self, layer_id: int) -> KvCacheLayerGroupLayout:
        for group in self.groups:
            if layer_id in group.layer_ids:
                return group
        raise KeyError(f"layer {layer_id} is not covered by this layout")

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        """``[num_slots, num_layers, kv_factor, block_size]`` for one group of one region of
        uniform buffers, else None (upstream's rule)."""
        if len(self.groups) != 1 or len(self.groups[0].regions) != 1:
            return None
        group = self.groups[0]
        region = group.regions[0]
        num_layers = len(group.layer_ids)
        if not num_layers or len(region.buffers) % num_layers:
            return None
        kv_factor = len(region.buffers) // num_layers
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if region.size % (itemsize * len(region.buffers)):
            return None
        block = region.size // itemsize // len(region.buffers)
        return region.as_tensor(self.dtype).unflatten(1, (num_layers, kv_factor, block))
