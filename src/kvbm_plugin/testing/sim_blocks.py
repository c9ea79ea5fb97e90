"""The KV cache manager's side of the simulated executor: which GPU blocks each request holds.

:class:`RequestBlocks` follows TRT-LLM's C++ block manager where the loop asks it for blocks:
the capacity check and device prefix match of ``addSequence`` (:meth:`~RequestBlocks.reserve`,
guaranteed-no-evict: the whole sequence is reserved up front), a block per token as a request
grows (:meth:`~RequestBlocks.ensure`), ``store_context_blocks``
(:meth:`~RequestBlocks.store_prompt`) and ``releaseBlocks`` (:meth:`~RequestBlocks.release`),
with TRT-LLM's V1 block hashes (:meth:`~RequestBlocks.hashes`). Owned by one
:class:`~kvbm_plugin.testing.engine.SimulatedEngine` and called only from its loop, on the
thread that steps it; it makes no connector call.
"""

from __future__ import annotations

from kvbm_plugin.naming.names import mm_block_keys, mm_hash_bytes
from kvbm_plugin.testing.fake_trtllm import trtllm_block_hash
from kvbm_plugin.testing.gpu_pool import GpuPool
from kvbm_plugin.testing.sim_request import CONTEXT, LOADING, SimRequest


class RequestBlocks:
    """The GPU blocks of every request of one engine, on its ``pool`` of ``block_size``-token
    blocks; ``outstanding``: blocks reserved at admission and not yet allocated."""

    def __init__(self, pool: GpuPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.outstanding = 0

    def reserve(self, r: SimRequest) -> bool:
        """The capacity check and the device prefix match of C++ ``addSequence``
        (``loadOrAllocateBlocks``)."""
        bs = self.block_size
        total = -(-(len(r.prompt) + r.max_new) // bs)
        hashes = self.hashes(r, (len(r.prompt) - 1) // bs)
        matched = self.pool.match(hashes)
        need = total - len(matched)
        avail = self.pool.available() - sum(1 for b in matched if b in self.pool.cached) \
            - self.outstanding
        if avail < need:
            return False
        for b in matched:
            self.pool.acquire(b)
        r.blocks = list(matched)
        r.n_device = r.computed = len(matched) * bs
        r.reserved = need
        self.outstanding += need
        r.state = CONTEXT
        return True

    def hashes(self, r: SimRequest, n_blocks: int) -> list[int]:
        """TRT-LLM's V1 hashes of the first ``n_blocks`` full blocks (the chain is kept: a
        request's tokens only grow)."""
        bs = self.block_size
        chain = r.chain
        while len(chain) < n_blocks:
            i = len(chain)
            chain.append(trtllm_block_hash(chain[-1] if chain else None,
                                           r.tokens[i * bs:(i + 1) * bs], r.salt, r.lora,
                                           self.mm_keys(r, i * bs, (i + 1) * bs)))
        return chain[:n_blocks]

    @staticmethod
    def mm_keys(r: SimRequest, start: int, end: int) -> list[tuple[bytes, int]]:
        """``generateBlockHashExtraKeys``: the multimodal items of ``r`` overlapping tokens
        ``start..end - 1`` (digest, offset of the block's first token in the item)."""
        if not r.mm:
            return []
        return mm_block_keys([(mm_hash_bytes(h), tuple(runs)) for h, runs in r.mm], start, end)

    def ensure(self, r: SimRequest, tokens: int) -> None:
        """Allocate blocks until ``r`` holds ``tokens`` tokens (its reservation first)."""
        while len(r.blocks) * self.block_size < tokens:
            r.blocks.append(self.pool.alloc())
            if r.reserved > 0:
                r.reserved -= 1
                self.outstanding -= 1

    def store_prompt(self, r: SimRequest) -> None:
        """``store_context_blocks``: the full blocks of ``r``'s computed prompt, one STORE."""
        bs = self.block_size
        r.context_stored = True
        full = len(r.prompt) // bs
        hashes = self.hashes(r, full)
        self.pool.store_blocks(r.blocks, [(hashes[i], r.tokens[i * bs:(i + 1) * bs])
                                          for i in range(full)], 0, r.salt, r.lora,
                               self._block_mm(r, full))

    def _block_mm(self, r: SimRequest, n_blocks: int) -> list[list[tuple[bytes, int]]]:
        """The multimodal keys of each of ``r``'s first ``n_blocks`` full blocks ([] when
        text-only)."""
        bs = self.block_size
        return [self.mm_keys(r, i * bs, (i + 1) * bs) for i in range(n_blocks)] if r.mm else []

    def release(self, r: SimRequest) -> None:
        """C++ ``releaseBlocks``: every block with KV is stored for reuse (generated ones and a
        trailing partial block included; nothing of a request that never computed past an
        async load), then released last block first; its reservation is returned."""
        bs = self.block_size
        # uniqueTokens.size() - 1 tokens: the last sampled token has no KV yet
        valid = min(r.computed, len(r.tokens) - 1) if r.state != LOADING else r.n_device
        if valid:
            n_full = valid // bs
            hashes = self.hashes(r, n_full)
            keys = [(hashes[j], r.tokens[j * bs:(j + 1) * bs]) for j in range(n_full)]
            if valid % bs and n_full < len(r.blocks):
                tokens = r.tokens[n_full * bs:valid]
                keys.append((trtllm_block_hash(hashes[-1] if hashes else None, tokens, r.salt,
                                               r.lora, self.mm_keys(r, n_full * bs, valid)),
                             tokens))
            mm = self._block_mm(r, n_full)
            if r.mm and len(keys) > n_full:
                mm.append(self.mm_keys(r, n_full * bs, valid))
            self.pool.store_blocks(r.blocks, keys, 0, r.salt, r.lora, mm)
        for b in reversed(r.blocks):  # last block first, as TRT-LLM's releaseBlocks
            self.pool.release(b)
        self.outstanding -= r.reserved
        r.reserved = 0
