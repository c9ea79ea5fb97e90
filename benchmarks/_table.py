"""Shared result rows and table printing for the benchmarks (ratios against a same-run baseline)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One measured quantity: ``value`` for us, ``baseline`` for the same-run baseline."""

    benchmark: str
    metric: str
    value: float
    unit: str
    baseline: float | None = None  # same-run baseline, same unit; None = absolute metric
    target: str = ""  # e.g. ">= 15x" or "<= 2 us"
    passed: bool | None = None  # None = informational

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return self.value / self.baseline


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """Median of ``repeats`` calls of ``fn`` (each returns one measurement)."""
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def format_table(rows: Sequence[Row]) -> str:
    header = ("benchmark", "metric", "value", "baseline", "ratio", "target", "ok")
    body = [
        (r.benchmark, r.metric, f"{_fmt(r.value)} {r.unit}",
         "-" if r.baseline is None else f"{_fmt(r.baseline)} {r.unit}",
         "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target or "-",
         "-" if r.passed is None else ("yes" if r.passed else "NO"))
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in (header, *body)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(b) for b in body)])


def print_table(rows: Sequence[Row]) -> None:
    print(format_table(rows))


def quick_main(doc: str | None, run: Callable[[bool], Sequence[Row]]) -> int:
    """The command line of a benchmark whose only option is ``--quick``: prints the table of
    ``run(quick)`` and returns 1 when a row missed its target (``raise SystemExit(...)``)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    rows = run(parser.parse_args().quick)
    print_table(rows)
    return 0 if all(r.passed is not False for r in rows) else 1
