"""The event sink's executor-thread cost of naming LoRA adapters (``naming.names.LoraNames``).

Stream: the decode steady state, per engine iteration 64 requests each store one block of
``block_size`` 32 under its previous block, each store preceded by the eviction of one old leaf
block (64 stored + 64 removed per iteration; the old blocks are stored before the run, untimed),
in TensorRT-LLM's buffered dict form with no ``lora_id`` (as its serializer writes them).
Three sinks get the same iterations, each built fresh right before it is fed (untimed), in the
same paired rounds:

- baseline: no adapter was ever named (the annotation pass is off);
- base model, adapters named: the leader has named an adapter's root, so every event goes
  through the annotation pass, but the requests are the base model's (nothing to write);
- adapters: every request is an adapter's (task ids 0 and 1), so every store is annotated (a
  copy of the event with its ``lora_id``) and published with its ``lora_name``.

Timed: ``ingest`` + ``flush`` of one iteration on this thread's CPU clock, per block (stored and
removed), median over the iterations of a round; each row's ratio is the median of the per-round
ratios against the baseline of the same round, the spread their range. Compiled ingest loop where
it was built, and the Python loop. Targets: the pass alone <= 1.5x the baseline, adapters <= 3x
(each annotated store is a copy of its event; the compiled loop writes its ``lora_name`` itself).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from benchmarks._table import Row, print_table
from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.wire.publisher import NullEventPublisher

_clock = time.thread_time
BS = 32
REQUESTS = 64


OLD = 1 << 62  # hashes of the old leaf blocks evicted during the run


def _stored(parent: int | None, h: int, it: int) -> dict[str, Any]:
    return {"event_id": 0, "window_size": 4096, "data": {
        "type": "stored", "parent_hash": parent,
        "blocks": [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                    "tokens": [{"type": "unique_token", "token_id": (it * 7 + j) % 30000,
                                "token_extra_id": 0} for j in range(BS)]}]}}


def _iteration(it: int, iterations: int) -> list[dict[str, Any]]:
    """Iteration ``it``: request r evicts old leaf (r, it), then stores block (r, it) under
    (r, it - 1)."""
    events: list[dict[str, Any]] = []
    for r in range(REQUESTS):
        events.append({"event_id": 0, "window_size": 4096, "data": {
            "type": "removed", "block_hashes": [OLD + r * iterations + it]}})
        events.append(_stored((r << 32) + it if it else None, (r << 32) + it + 1, it))
    return events


def _sink(native: bool, scope: str, iterations: int) -> KvEventSink:
    """A sink holding the old leaves (each its own root, named like its request's chain)."""
    sink = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BS, native=native,
                       prefix_closed=True)
    if scope != "baseline":
        sink.name_lora_root(-1, 0)  # an adapter was seen: the annotation pass is on
    for r in range(REQUESTS):
        task = r % 2 if scope == "adapters" else None
        if scope != "baseline":
            sink.name_lora_root((r << 32) + 1, task)
            for it in range(iterations):
                sink.name_lora_root(OLD + r * iterations + it, task)
        sink.ingest([_stored(None, OLD + r * iterations + it, it) for it in range(iterations)])
    sink.flush()
    return sink


def _round(native: bool, iterations: int) -> dict[str, float]:
    """Seconds per block (median over iterations) for each scope, fed interleaved."""
    sinks = {scope: _sink(native, scope, iterations)
             for scope in ("baseline", "pass", "adapters")}
    per: dict[str, list[float]] = {scope: [] for scope in sinks}
    for it in range(iterations):
        for scope, sink in sinks.items():
            events = _iteration(it, iterations)
            blocks = sum(len(e["data"].get("blocks", e["data"].get("block_hashes", [])))
                         for e in events)
            start = _clock()
            sink.ingest(events)
            sink.flush()
            per[scope].append((_clock() - start) / blocks)
    stats = sinks["adapters"].stats()
    assert stats["lora_unnamed_blocks"] == 0 and stats["lora_named_blocks"] > 0, stats
    assert all(s.stats()["orphan_stores_dropped"] == 0 for s in sinks.values())
    return {scope: statistics.median(v[8:]) for scope, v in per.items()}


def _rows(native: bool, rounds: int, iterations: int) -> list[Row]:
    loop = "compiled" if native else "python"
    results = [_round(native, iterations) for _ in range(rounds)]

    def row(scope: str, metric: str, target: float | None) -> Row:
        ratios = [r[scope] / r["baseline"] for r in results]
        ratio = statistics.median(ratios)
        value = statistics.median(r[scope] for r in results) * 1e6
        base = statistics.median(r["baseline"] for r in results) * 1e6
        spread = f"ratio {min(ratios):.2f}-{max(ratios):.2f}"
        return Row("lora names", f"{metric} ({loop} loop, us/block; {spread})", value, "us",
                   base, "-" if target is None else f"<= {target}x",
                   None if target is None else ratio <= target)

    return [row("pass", "base model, adapters named", 1.5),
            row("adapters", "two adapters", 3.0)]


def run(quick: bool = False) -> list[Row]:
    """Measure and return the rows (``quick``: fewer rounds and iterations; seconds)."""
    rounds, iterations = (3, 40) if quick else (7, 120)
    rows: list[Row] = []
    if _compiled.loops("event_sink", {}) is not None:
        rows += _rows(True, rounds, iterations)
    rows += _rows(False, rounds, iterations)
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv))
