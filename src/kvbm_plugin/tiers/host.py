"""Host-memory tier (G2): one preallocated tensor pool, pinned when the device pool is on CUDA."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbm_plugin.tiers.base import OffloadTier, TierSpec, WriteResult
from kvbm_plugin.tiers.content_keys import TIER_HOST
from kvbm_plugin.wire.events import MEDIUM_CPU

if TYPE_CHECKING:
    import torch


class HostTier(OffloadTier):
    """``pool[slot]`` has the device pool's per-block shape and dtype.

    The worker's transfer path copies whole blocks straight between ``pool`` and the device pool
    (batched, on a side stream); ``write``/``read`` are the per-block form used for disk
    demotion and tests. ``keys[slot]`` remembers which content key a slot holds, so a read of a
    slot that was reused returns False instead of someone else's bytes.
    """

    name = TIER_HOST
    medium = MEDIUM_CPU

    def __init__(self, spec: TierSpec) -> None:
        import torch

        super().__init__(spec)
        if spec.capacity <= 0:
            raise ValueError(f"host tier capacity {spec.capacity} must be > 0")
        self.pool: torch.Tensor = torch.empty((spec.capacity, *spec.block_shape),
                                              dtype=spec.dtype, pin_memory=spec.pin_memory)
        self.keys: list[int | None] = [None] * spec.capacity

    def write(self, slot: int, key: int, block: torch.Tensor) -> WriteResult:
        self.pool[slot].copy_(block)
        self.keys[slot] = key
        return WriteResult(True)

    def read(self, slot: int, key: int, out: torch.Tensor) -> bool:
        if self.keys[slot] != key:
            return False
        out.copy_(self.pool[slot])
        return True

    def close(self) -> None:
        self.keys = [None] * self.spec.capacity
