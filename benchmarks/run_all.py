"""Run every benchmark in this folder and print one table (ratios from the same run).

    python benchmarks/run_all.py            # full runs
    python benchmarks/run_all.py --quick    # seconds, for a smoke check
    python benchmarks/run_all.py --device cuda   # transfer benchmark on the GPU
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import Row, print_table  # noqa: E402

BENCHMARKS = ("bench_event_sink", "bench_consolidator", "bench_transfer")


def run_all(quick: bool = False, device: str = "cpu") -> list[Row]:
    rows: list[Row] = []
    for name in BENCHMARKS:
        module = importlib.import_module(f"benchmarks.{name}")
        kwargs = {"quick": quick}
        if name == "bench_transfer":
            kwargs["device"] = device
        rows.extend(module.run(**kwargs))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    rows = run_all(args.quick, args.device)
    print_table(rows)
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
