"""Offload tiers, the worker's side: the storage interface one worker owns for its rank.

Two halves, because in TensorRT-LLM the leader (rank 0) and the workers (every rank) may live in
different processes:

* :class:`~kvbm_plugin.tiers.index.TierIndex` (``tiers/index.py``) is the leader's
  bookkeeping for one tier: which content key sits in which slot, resident or pending, pins
  and LRU order.
* :class:`OffloadTier` (here) is the storage one worker owns for its own rank: a host tensor
  pool or a directory of block files. Built by the worker in ``register_kv_caches``; called on
  the worker's transfer and disk threads. Workers learn slot numbers only from the connector
  metadata, so every rank writes the same slot for the same block and holds its own head shard
  there.

Block identity is a content key (``tiers/content_keys.py``): a chained hash over full blocks of
token ids (``cache_salt`` mixed in). The hash TRT-LLM's KV events use for the same block
(``RequestData.block_hashes``) is stored next to it as ``event_hash`` and is what the tier
events advertise.

The content-key functions and the leader's index names are re-exported here, where the
connector's modules import them from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvbm_plugin.tiers._entry import TierEntry as TierEntry
from kvbm_plugin.tiers.content_keys import TIER_DISK as TIER_DISK
from kvbm_plugin.tiers.content_keys import TIER_HOST as TIER_HOST
from kvbm_plugin.tiers.content_keys import Signature as Signature
from kvbm_plugin.tiers.content_keys import TierName as TierName
from kvbm_plugin.tiers.content_keys import block_keys as block_keys
from kvbm_plugin.tiers.content_keys import block_path as block_path
from kvbm_plugin.tiers.content_keys import chain_digest as chain_digest
from kvbm_plugin.tiers.content_keys import key_of as key_of
from kvbm_plugin.tiers.content_keys import stat_signature as stat_signature
from kvbm_plugin.tiers.index import TierFullError as TierFullError
from kvbm_plugin.tiers.index import TierIndex as TierIndex

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TierSpec:
    """What a worker's tier storage is built from (one per rank)."""

    capacity: int  # number of block slots (the leader's index has the same count)
    block_shape: tuple[int, ...]  # one block of the device pool: (layers, kv_factor, elements)
    dtype: Any  # torch.dtype of the device pool
    rank: int  # this worker's rank (disk files live under rank{rank}/)
    pin_memory: bool = False  # page-locked host memory (CUDA pools)
    directory: str | None = None  # disk tier base directory
    # Model and layout identity (model name, tokens per block, TP size, ...): what the bytes of
    # a disk block mean beyond dtype and shape; written into every disk file's header.
    identity: str = ""


@dataclass(frozen=True)
class WriteResult:
    ok: bool
    signature: Signature | None = None  # disk: the written file's (size, mtime_ns)
    error: str | None = None


class OffloadTier(ABC):
    """Storage for one tier on one rank. Built by the worker in ``register_kv_caches``.

    ``write``/``read`` move one whole block between a CPU tensor of ``spec.block_shape`` and
    slot ``slot``. They are called from the worker's transfer or disk thread, never from the
    executor thread, and may block on I/O. ``read`` returns False for a block that is absent,
    torn or corrupt: such a block is never served.
    """

    name: ClassVar[TierName]
    medium: ClassVar[str]

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    @abstractmethod
    def write(self, slot: int, key: int, block: torch.Tensor) -> WriteResult:
        """Store ``block`` (CPU, contiguous) in ``slot`` under content key ``key``."""

    @abstractmethod
    def read(self, slot: int, key: int, out: torch.Tensor) -> bool:
        """Fill ``out`` (CPU, contiguous) from ``slot`` if it holds ``key`` intact."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; idempotent."""
