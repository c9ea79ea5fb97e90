"""The event sink's per-event cost as what it tracks grows: cascades and bounded maps.

Each row compares the same operation in two states in the same run, over paired rounds (each
round measures both, back to back; the row's ratio is the median of the per-round ratios, and
the spread is their range):

- Cascade (executor thread): one removal of a block that still has 4 published descendants
  (``KvEventSink.ingest`` of one ``removed`` event: the lock is held throughout), with 1M
  blocks tracked against 10k. Target: <= 1 ms at 1M, and <= 2x the cost at 10k (O(descendants)).
  The blocks are put back after each removal (untimed), so the tracked count stays constant.
- Parent-first removals: an 8,000-block chain removed root first in one ``ingest`` call (one
  lock hold; the first removal cascades the rest), with 1M tracked against 10k. Target:
  <= 2x the cost at 10k, and <= 100 ms (``flush`` waits on that lock).
- Bounded maps at their cap (100k): the cost per block of a partial-block store (the sink's
  suppressed map) and of ``BlockNames.observe`` (the block-name table) when the map is full, so
  that each block evicts the oldest, against the same below the cap. Target: <= 2x.
- Removals (compiled loop) while a partial block is suppressed, against none suppressed.
  Target: <= 2x.

Input is built right before it is fed (untimed), in iterations of 64 events, as TRT-LLM hands
an iteration's events to the connector. Timings are this thread's CPU time (the executor
thread's cost; time the machine gives other processes does not count), collector enabled.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from benchmarks._table import Row, print_table
from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.naming.names import BlockNames
from kvbm_plugin.wire.publisher import NullEventPublisher

_clock = time.thread_time
BS = 4  # tokens per block: the costs measured here do not depend on it
ITERATION = 64
CHAIN = 1000  # blocks per stored event while filling


def _tokens(n: int) -> list[dict[str, int]]:
    return [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in range(n)]


def _stored(parent: int | None, hashes: range | list[int], n_tokens: int = BS
            ) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {
        "type": "stored", "parent_hash": parent,
        "blocks": [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                    "tokens": _tokens(n_tokens)} for h in hashes]}}


def _removed(h: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 64, "data": {"type": "removed", "block_hashes": [h]}}


def _sink(**kw: Any) -> KvEventSink:
    return KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BS, window_size=64,
                       **kw)


def _fill(sink: KvEventSink, blocks: int, first: int) -> None:
    """``blocks`` published blocks in chains of CHAIN, hashes from ``first`` (untimed)."""
    for start in range(first, first + blocks, CHAIN):
        sink.ingest([_stored(None, range(start, min(start + CHAIN, first + blocks)))])
        sink.flush()


def _paired(rounds: int, ours: Callable[[], float], base: Callable[[], float]
            ) -> tuple[float, float, float, float, float]:
    """(median ours, median base, median ratio, min ratio, max ratio) over paired rounds."""
    a, b, r = [], [], []
    for _ in range(rounds):
        x, y = ours(), base()
        a.append(x)
        b.append(y)
        r.append(x / y)
    return statistics.median(a), statistics.median(b), statistics.median(r), min(r), max(r)


def _spread(rounds: int, ratio: float, lo: float, hi: float) -> str:
    return f"paired median {ratio:.2f}x, spread {lo:.2f}-{hi:.2f}x, {rounds} rounds"


# ---- cascades ---------------------------------------------------------------------------------


class _CascadeBed:
    """A prefix-closed sink tracking ``tracked`` blocks plus one probe chain of 5 blocks and
    one chain of 8,000; removals are timed and the removed blocks stored again (untimed)."""

    PROBE = list(range(-10, -5))
    LONG = list(range(-100_000, -92_000))

    def __init__(self, tracked: int) -> None:
        self.sink = _sink(prefix_closed=True)
        _fill(self.sink, tracked, 1)
        self.sink.ingest([_stored(None, self.PROBE), _stored(None, self.LONG)])
        self.sink.flush()

    def cascade_us(self, samples: int) -> float:
        """Median µs of one removal of the probe's root (4 descendants)."""
        sink, probe = self.sink, self.PROBE
        times = []
        for _ in range(samples):
            event = [_removed(probe[0])]
            t0 = _clock()
            sink.ingest(event)
            times.append(_clock() - t0)
            sink.ingest([_stored(None, probe)])
            sink.flush()
        return statistics.median(times) * 1e6

    def parent_first_ms(self) -> float:
        """ms of one ingest of 8,000 removals of the long chain, root first."""
        sink, chain = self.sink, self.LONG
        events = [_removed(h) for h in chain]
        t0 = _clock()
        sink.ingest(events)
        elapsed = _clock() - t0
        sink.flush()
        sink.ingest([_stored(None, chain)])
        sink.flush()
        return elapsed * 1e3


# ---- bounded maps -----------------------------------------------------------------------------


def _iterations(first: int, blocks: int) -> Iterator[range]:
    for start in range(first, first + blocks, ITERATION):
        yield range(start, min(start + ITERATION, first + blocks))


def _suppressed_us(cap: int, prefill: int, measured: int) -> float:
    """µs per partial-block store with ``prefill`` hashes suppressed already (cap ``cap``)."""
    sink = _sink(max_suppressed=cap)
    for hashes in _iterations(1, prefill):
        sink.ingest([_stored(None, [h], n_tokens=1) for h in hashes])
    elapsed = 0.0
    for hashes in _iterations(10_000_000, measured):
        events = [_stored(None, [h], n_tokens=1) for h in hashes]
        t0 = _clock()
        sink.ingest(events)
        elapsed += _clock() - t0
    assert sink.stats()["suppressed_evicted"] == max(0, prefill + measured - cap)
    return elapsed / measured * 1e6


def _names_batch(hashes: range) -> list[dict[str, Any]]:
    return [{"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None,
             "token_ids": [t for h in hashes for t in (h, 1, 2, 3)], "block_size": BS}]


def _names_us(cap: int, prefill: int, measured: int) -> float:
    """µs per block of ``BlockNames.observe`` with ``prefill`` entries already (cap ``cap``)."""
    names = BlockNames(BS, max_entries=cap)
    for hashes in _iterations(1, prefill):
        names.observe(0, _names_batch(hashes))
    elapsed = 0.0
    for hashes in _iterations(10_000_000, measured):
        batch = _names_batch(hashes)
        t0 = _clock()
        names.observe(0, batch)
        elapsed += _clock() - t0
    return elapsed / measured * 1e6


def _removal_us(suppressed: bool, blocks: int) -> float:
    """µs per removal of a published leaf (prefix-closed, compiled loop when built), with one
    partial block suppressed or none."""
    sink = _sink(prefix_closed=True)
    for hashes in _iterations(1, blocks):
        sink.ingest([_stored(None, [h]) for h in hashes])
        sink.flush()
    if suppressed:
        sink.ingest([_stored(None, [-1], n_tokens=1)])
    elapsed = 0.0
    for hashes in _iterations(1, blocks):
        events = [_removed(h) for h in hashes]
        t0 = _clock()
        sink.ingest(events)
        elapsed += _clock() - t0
        sink.flush()
    assert sink.stats()["blocks_removed"] == blocks
    return elapsed / blocks * 1e6


def run(quick: bool = False) -> list[Row]:
    """Measure and return the rows (``quick``: 100k instead of 1M tracked blocks, fewer
    rounds; seconds)."""
    big = 100_000 if quick else 1_000_000
    small = 10_000
    rounds = 3 if quick else 7
    cap = 100_000
    measured = 5_000 if quick else 20_000
    name = "sink_scale"
    loop = "compiled" if _compiled.loops("event_sink") is not None else "Python"
    rows: list[Row] = []

    big_bed, small_bed = _CascadeBed(big), _CascadeBed(small)
    samples = 50 if quick else 200
    c_big, c_small, ratio, lo, hi = _paired(rounds, partial(big_bed.cascade_us, samples),
                                            partial(small_bed.cascade_us, samples))
    rows.append(Row(name, f"removal with 4 descendants at {big:,} tracked vs {small:,} "
                          f"({_spread(rounds, ratio, lo, hi)})", c_big, "us", c_small,
                    "<= 1 ms; <= 2x", c_big <= 1000 and ratio <= 2.0))
    p_big, p_small, ratio, lo, hi = _paired(rounds, big_bed.parent_first_ms,
                                            small_bed.parent_first_ms)
    rows.append(Row(name, f"8,000 parent-first removals, one lock hold, at {big:,} tracked vs "
                          f"{small:,} ({_spread(rounds, ratio, lo, hi)})", p_big, "ms",
                    p_small, "<= 100 ms; <= 2x", p_big <= 100 and ratio <= 2.0))
    del big_bed, small_bed

    s_full, s_below, ratio, lo, hi = _paired(
        rounds, lambda: _suppressed_us(cap, cap, measured),
        lambda: _suppressed_us(cap, cap // 2, measured))
    rows.append(Row(name, f"partial-block store, suppressed map at its {cap:,} cap vs half "
                          f"full ({_spread(rounds, ratio, lo, hi)})", s_full, "us/blk",
                    s_below, "<= 2x", ratio <= 2.0))
    n_full, n_below, ratio, lo, hi = _paired(
        rounds, lambda: _names_us(cap, cap, measured),
        lambda: _names_us(cap, cap // 2, measured))
    rows.append(Row(name, f"BlockNames.observe, table at its {cap:,} cap vs half full "
                          f"({_spread(rounds, ratio, lo, hi)})", n_full, "us/blk", n_below,
                    "<= 2x", ratio <= 2.0))
    r_sup, r_none, ratio, lo, hi = _paired(rounds, lambda: _removal_us(True, measured),
                                           lambda: _removal_us(False, measured))
    rows.append(Row(name, f"removal, {loop} loop, a partial block suppressed vs none "
                          f"({_spread(rounds, ratio, lo, hi)})", r_sup, "us/blk", r_none,
                    "<= 2x", ratio <= 2.0))
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv))
