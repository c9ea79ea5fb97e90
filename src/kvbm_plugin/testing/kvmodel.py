"""The simulated model's KV: what the forward pass writes into a rank's pool, and the check.

Every element is ``f(position, layer, kv, head, dim, token)``, so any block that was onboarded
from a tier can be compared exactly with what the forward would have written. Pool variants as
TensorRT-LLM allocates them (``[num_blocks, num_layers, kv_factor, tokens_per_block * heads *
head_dim]``, C++ ``KVCacheManager::allocatePools``):

* ``kv_factor`` 2 (K and V) or 1 (MLA: one latent per token);
* ``kv_cache_dtype="fp8"``: the values are FP8 (e4m3) but the pool tensor the connector gets is
  stored as ``torch.int8`` (1 byte per element), as quantized pools reach the connector; the
  check compares those bytes.

Used by the engine for rank 0 and by each rank process (``testing.processes``).
"""

from __future__ import annotations

from typing import Any

import torch

_MOD = 251  # values stay exact integers in bf16/fp16/fp32 (and are fixed bytes in fp8)

# (start position, tokens to compute, the request's device block ids) per request in a batch
BatchItems = list[tuple[int, list[int], list[int]]]


class KvModel:
    """One rank's KV function and pool layout."""

    def __init__(self, *, rank: int, num_layers: int, heads_per_rank: int, head_dim: int,
                 tokens_per_block: int, kv_factor: int, dtype: torch.dtype,
                 kv_cache_dtype: str, device: str) -> None:
        if kv_factor not in (1, 2):
            raise ValueError(f"kv_factor={kv_factor} must be 1 (MLA) or 2 (K and V)")
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be 'auto' or 'fp8'")
        self.rank = rank
        self.num_layers = num_layers
        self.block_size = tokens_per_block
        self.kv_factor = kv_factor
        self.hd = heads_per_rank * head_dim
        self.device = torch.device(device)
        self.fp8 = kv_cache_dtype == "fp8"
        self.value_dtype = torch.float8_e4m3fn if self.fp8 else dtype
        self.storage_dtype = torch.int8 if self.fp8 else dtype
        heads = torch.arange(heads_per_rank, device=self.device) + rank * heads_per_rank
        dims = torch.arange(head_dim, device=self.device)
        self._hd_base = (heads[:, None] * 3 + dims[None, :]).reshape(-1)

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.num_layers, self.kv_factor, self.block_size * self.hd)

    def new_pool(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(self.pool_shape(num_blocks), dtype=self.storage_dtype,
                           device=self.device)

    def values(self, layer: int, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``[n, kv_factor, heads*dim]`` in the pool's storage dtype."""
        base = (positions * 7 + layer * 13 + tokens * 11)[:, None, None]
        kv = torch.arange(self.kv_factor, device=self.device)[None, :, None] * 5
        vals = ((base + kv + self._hd_base[None, None, :]) % _MOD).to(torch.float32)
        vals = vals.to(self.value_dtype)
        return vals.view(torch.int8) if self.fp8 else vals

    def write_layer(self, pool: torch.Tensor, layer: int, items: BatchItems) -> None:
        """The forward pass of one layer: KV of each item's tokens into its blocks."""
        bs, hd = self.block_size, self.hd
        for start, tokens, blocks in items:
            if not tokens:
                continue
            pos = torch.arange(start, start + len(tokens), device=self.device)
            vals = self.values(layer, pos, torch.tensor(tokens, device=self.device))
            for i in range(len(tokens)):
                p = start + i
                off = (p % bs) * hd
                pool[blocks[p // bs], layer, :, off:off + hd] = vals[i]

    def mismatches(self, pool: torch.Tensor, computed: int, tokens: list[int],
                   blocks: list[int]) -> int:
        """Blocks (of the first ``computed`` positions) whose bytes differ from the forward's."""
        bs, hd = self.block_size, self.hd
        bad = 0
        for i in range(-(-computed // bs)):
            n = min(bs, computed - i * bs)
            pos = torch.arange(i * bs, i * bs + n, device=self.device)
            tok = torch.tensor(tokens[i * bs:i * bs + n], device=self.device)
            for layer in range(self.num_layers):
                want = self.values(layer, pos, tok).permute(1, 0, 2).reshape(self.kv_factor, -1)
                got = pool[blocks[i], layer, :, :n * hd]
                if not torch.equal(got, want):
                    bad += 1
                    break
        return bad


def model_kwargs(config: Any, rank: int) -> dict[str, Any]:
    """KvModel arguments for ``rank`` from an EngineConfig."""
    return {"rank": rank, "num_layers": config.num_layers,
            "heads_per_rank": config.num_kv_heads // config.tp_size,
            "head_dim": config.head_dim, "tokens_per_block": config.tokens_per_block,
            "kv_factor": config.kv_factor, "dtype": config.dtype,
            "kv_cache_dtype": config.kv_cache_dtype, "device": config.device}
