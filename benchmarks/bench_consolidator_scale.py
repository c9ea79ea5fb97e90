"""The consolidator's core under held-back blocks and cascades, at scale (no sockets).

Three measurements, each a ratio of two costs taken in the same round, rounds paired, the
median ratio against its target and the spread (min-max of the rounds' ratios) shown:

* **ingest with blocks held back**: the same engine batches (chains of 16 blocks stored, older
  chains removed leaf first, as in ``bench_consolidator``) applied through
  ``ConsolidatorCore.apply_events`` by a core holding 16,000 blocks back (stored under parents
  no source knows, as a late join without replay leaves them) and by one holding none back
  but tracking as many blocks, published (16,000 root blocks): the held-back state against
  the same amount of state. Target: >= 0.9x the rate with none held back. The rate of an empty
  core is shown too (information: any 16,000 tracked blocks make the maps larger).
* **releasing a held-back chain**: a chain held back under a known but unpublished parent is
  published when the parent is stored again; the cost per released block for a 16,000-block
  chain against a 1,600-block one, with 16,000 unrelated blocks held back besides. Target:
  <= 2x (the cost is O(the chain's length)).
* **a removal that cascades**: one removal of a block with 16 descendants (a parent removed
  before its children) at 1,000,000 tracked blocks against 10,000. Target: <= 2x, and <= 1 ms.
* **heap per tier block** (information): what a core keeps per block registered by a tier
  (64-block chains, 200,000 blocks; ``tracemalloc``), per implementation. The compiled core's
  96-byte block against the Python loops' 12-item list is what keeps the whole leader's heap
  within ``bench_tiers``' <= 400 B per tier block (docs/performance.md).

Times are the measuring thread's CPU time (``time.thread_time``). Both loop implementations are
measured where the compiled one is built (the Python one alone otherwise); ``--quick`` runs
smaller sizes.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from typing import Any

from benchmarks._table import Row, print_table
from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator.service import SOURCE_TIERS, ConsolidatorCore

CHAIN_LEN = 16
BLOCK_SIZE = 32
HELD_BACK = 16_000
TARGET_INGEST = 0.9
TARGET_RELEASE = 2.0
TARGET_CASCADE = 2.0
TARGET_CASCADE_MS = 1.0


def _tokens(first: int, blocks: int) -> list[int]:
    return list(range(first, first + blocks * BLOCK_SIZE))


def engine_batches(count: int, chains: int = 4, keep: int = 2) -> tuple[list[list[Any]], int]:
    """``count`` batches of decoded engine events and the block events they carry."""
    batches: list[list[Any]] = []
    live: deque[list[int]] = deque()
    next_hash, token, block_events = 1, 0, 0
    for _ in range(count):
        events: list[Any] = []
        for _ in range(chains):
            hashes = list(range(next_hash, next_hash + CHAIN_LEN))
            next_hash += CHAIN_LEN
            events.append({"type": "BlockStored", "block_hashes": hashes,
                           "parent_block_hash": None, "token_ids": _tokens(token, CHAIN_LEN),
                           "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU",
                           "lora_name": None})
            token += CHAIN_LEN * BLOCK_SIZE
            live.append(hashes)
            block_events += CHAIN_LEN
        if len(live) > keep * chains:
            gone = [h for _ in range(chains) for h in reversed(live.popleft())]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
            block_events += len(gone)
        batches.append(events)
    return batches, block_events


def hold_back(core: ConsolidatorCore, count: int, base: int = 1 << 40) -> None:
    """``count`` engine blocks stored under parents no source knows (held back for good)."""
    events = [{"type": "BlockStored", "block_hashes": [base + i],
               "parent_block_hash": base * 2 + i, "token_ids": _tokens(i, 1),
               "block_size": BLOCK_SIZE, "medium": "GPU"} for i in range(count)]
    core.apply_events(0, events, _refuse)
    assert core.stats()["blocks_held_back"] == count


def _refuse(exc: Exception) -> None:
    raise exc


def _timed(fn: Callable[[], object]) -> float:
    """CPU seconds this thread spends in ``fn()``: on a shared machine, time the scheduler
    gives to other processes is not counted (everything measured here is single-threaded)."""
    gc.collect()
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def publish_roots(core: ConsolidatorCore, count: int, base: int = 1 << 40) -> None:
    """``count`` engine root blocks, published (resident, nothing held back)."""
    events = [{"type": "BlockStored", "block_hashes": [base + i], "parent_block_hash": None,
               "token_ids": _tokens(i, 1), "block_size": BLOCK_SIZE, "medium": "GPU"}
              for i in range(count)]
    core.apply_events(0, events, _refuse)
    assert core.stats()["blocks_visible"] == count


def ingest_seconds(native: bool, batches: list[list[Any]], held: int, tracked: int = 0
                   ) -> float:
    """Seconds to apply ``batches`` with ``held`` blocks held back, or ``tracked`` blocks
    published, beforehand."""
    core = ConsolidatorCore(native=native)
    if held:
        hold_back(core, held)
    if tracked:
        publish_roots(core, tracked)

    def run() -> None:
        for events in batches:
            core.apply_events(0, events, _refuse)
            core.take_output()

    seconds = _timed(run)
    assert core.stats()["blocks_held_back"] == held
    return seconds


def release_seconds(native: bool, length: int, others: int) -> float:
    """Seconds to publish a parent that a held-back chain of ``length`` waits for."""
    core = ConsolidatorCore(native=native)
    hold_back(core, others)
    parent = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
              "token_ids": _tokens(0, 1), "block_size": BLOCK_SIZE, "medium": "GPU"}
    core.apply_event(0, parent)
    core.apply_event(0, {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1,
                         "token_ids": _tokens(1, 1), "block_size": BLOCK_SIZE, "medium": "GPU"})
    core.apply_event(0, {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"})
    chain = list(range(100, 100 + length))
    core.store(SOURCE_TIERS, "CPU", 0, chain, 1, _tokens(10, length), BLOCK_SIZE)
    core.take_output()
    seconds = _timed(lambda: core.apply_event(0, parent))
    assert core.stats()["released_stores"] == length
    return seconds


def cascade_seconds(native: bool, tracked: int, descendants: int = 16) -> float:
    """Seconds for one removal of a block with ``descendants`` below it, ``tracked`` blocks
    tracked in all."""
    core = ConsolidatorCore(native=native)
    chains = max(0, tracked - descendants - 1) // CHAIN_LEN
    events = [{"type": "BlockStored", "block_hashes": list(range(1000 + i * CHAIN_LEN,
                                                                 1000 + (i + 1) * CHAIN_LEN)),
               "parent_block_hash": None, "token_ids": _tokens(0, CHAIN_LEN),
               "block_size": BLOCK_SIZE, "medium": "GPU"} for i in range(chains)]
    for start in range(0, len(events), 4096):
        core.apply_events(0, events[start:start + 4096], _refuse)
    del events
    chain = list(range(1, descendants + 2))
    core.apply_event(0, {"type": "BlockStored", "block_hashes": chain, "parent_block_hash": None,
                         "token_ids": _tokens(7, len(chain)), "block_size": BLOCK_SIZE,
                         "medium": "GPU"})
    core.take_output()
    seconds = _timed(lambda: core.apply_event(0, {"type": "BlockRemoved", "block_hashes": [1],
                                                  "medium": "GPU"}))
    assert core.stats()["cascade_removes"] == descendants
    return seconds


def heap_per_block(native: bool, blocks: int) -> float:
    """Bytes a core keeps per tier block: ``blocks`` registered in chains of 64 (16 tokens a
    block, random hashes, as ``bench_tiers`` drives the leader), output taken as it comes."""
    rng = random.Random(5)
    core = ConsolidatorCore(native=native)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for chain in range(blocks // 64):
            core.store(SOURCE_TIERS, "DISK", 0, [rng.getrandbits(63) for _ in range(64)], None,
                       list(range(chain * 64 * 16, (chain + 1) * 64 * 16)), 16)
            core.take_output()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert core.stats()["blocks_visible"] == blocks // 64 * 64
    return kept / (blocks // 64 * 64)


def paired(fn_a: Callable[[], float], fn_b: Callable[[], float], rounds: int
           ) -> tuple[float, float, float, float, float]:
    """Rounds of (a, b), alternating which runs first; the medians of a and b, and the median,
    min and max of the rounds' ratios b / a."""
    a_values, b_values, ratios = [], [], []
    for i in range(rounds):
        if i % 2:
            b = fn_b()
            a = fn_a()
        else:
            a = fn_a()
            b = fn_b()
        a_values.append(a)
        b_values.append(b)
        ratios.append(b / a)
    return (statistics.median(a_values), statistics.median(b_values),
            statistics.median(ratios), min(ratios), max(ratios))


def _spread(low: float, high: float) -> str:
    return f"spread {low:.2f}-{high:.2f}x"


def run(quick: bool = False) -> list[Row]:
    """The rows: each value is the median over paired rounds of one round's ratio."""
    rounds = 3 if quick else 9
    held = 1_600 if quick else HELD_BACK
    batches, block_events = engine_batches(100 if quick else 400)
    big = 100_000 if quick else 1_000_000
    rows: list[Row] = []
    implementations = [True, False] if _compiled.loops("consolidator", {}) is not None \
        else [False]
    for native in implementations:
        name = "compiled" if native else "python"
        same, some, ratio, low, high = paired(
            lambda n=native: ingest_seconds(n, batches, 0, held),
            lambda n=native: ingest_seconds(n, batches, held), rounds)
        # Rates: a round's ratio of rates is the inverse of its ratio of times.
        rows.append(Row("consolidator scale", f"ingest rate, {held:,} blocks held back vs "
                        f"{held:,} published ({name}; {block_events / some / 1e3:,.0f}k vs "
                        f"{block_events / same / 1e3:,.0f}k block-events/s; paired median of "
                        f"{rounds} rounds, {_spread(1 / high, 1 / low)})", 1 / ratio, "x",
                        target=f">= {TARGET_INGEST}x", passed=1 / ratio >= TARGET_INGEST))
        empty, some, ratio, low, high = paired(
            lambda n=native: ingest_seconds(n, batches, 0),
            lambda n=native: ingest_seconds(n, batches, held), rounds)
        rows.append(Row("consolidator scale", f"ingest rate, {held:,} blocks held back vs an "
                        f"empty core ({name}; info: larger maps; {_spread(1 / high, 1 / low)})",
                        1 / ratio, "x"))
        short, long_, ratio, low, high = paired(
            lambda n=native: release_seconds(n, held // 10, held) / (held // 10),
            lambda n=native: release_seconds(n, held, held) / held, rounds)
        rows.append(Row("consolidator scale", f"release of a held-back chain, cost per block, "
                        f"{held:,} vs {held // 10:,} long ({name}; {long_ * 1e6:.2f} vs "
                        f"{short * 1e6:.2f} us; paired median, {_spread(low, high)})", ratio,
                        "x", target=f"<= {TARGET_RELEASE}x", passed=ratio <= TARGET_RELEASE))
        small, large, ratio, low, high = paired(
            lambda n=native: cascade_seconds(n, 10_000),
            lambda n=native: cascade_seconds(n, big), max(3, rounds // 3))
        rows.append(Row("consolidator scale", f"one removal cascading 16 blocks, {big:,} vs "
                        f"10,000 tracked ({name}; {large * 1e6:.0f} vs {small * 1e6:.0f} us; "
                        f"paired median, {_spread(low, high)})", ratio, "x",
                        target=f"<= {TARGET_CASCADE}x", passed=ratio <= TARGET_CASCADE))
        rows.append(Row("consolidator scale", f"one removal cascading 16 blocks at {big:,} "
                        f"tracked ({name}; median)", large * 1e3, "ms",
                        target=f"<= {TARGET_CASCADE_MS:g} ms",
                        passed=large * 1e3 <= TARGET_CASCADE_MS))
    heap_blocks = 20_000 if quick else 200_000
    for native in implementations:  # last: tracemalloc slows whatever runs beside it
        name = "compiled" if native else "python"
        rows.append(Row("consolidator scale", f"heap per tier block, {heap_blocks:,} blocks in "
                        f"64-block chains ({name}; info)", heap_per_block(native, heap_blocks),
                        "B"))
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv[1:]))
