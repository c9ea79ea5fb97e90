"""Run every benchmark in this folder and print one table (ratios from the same run).

    python benchmarks/run_all.py            # full runs
    python benchmarks/run_all.py --quick    # seconds, for a smoke check
    python benchmarks/run_all.py --device cuda   # transfer benchmark on the GPU
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import Row, print_table  # noqa: E402

BENCHMARKS = ("bench_event_sink", "bench_vs_vllm", "bench_sink_scale", "bench_lora_names",
              "bench_salt_texts", "bench_consolidator",
              "bench_consolidator_scale", "bench_tiers", "bench_transfer", "bench_router_accuracy",
              "bench_shared_directory", "bench_shared_tier")


def _run_one(name: str, kwargs: dict[str, Any], conn: Any) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    conn.send(module.run(**kwargs))


def run_all(quick: bool = False, device: str = "cpu") -> list[Row]:
    """Each benchmark in a fresh interpreter: what one leaves behind must not bias the next.

    (Right after the event-sink benchmark, whose stream is a few hundred MB of dicts, the
    consolidator runs about 25 % slower in the same interpreter until a full ``gc.collect()``;
    collections during its run cost nothing measurable.)
    """
    rows: list[Row] = []
    spawn = mp.get_context("spawn")
    for name in BENCHMARKS:
        kwargs: dict[str, Any] = {"quick": quick}
        if name == "bench_transfer":
            kwargs["device"] = device
        parent, child = spawn.Pipe(duplex=False)
        proc = spawn.Process(target=_run_one, args=(name, kwargs, child))
        proc.start()
        child.close()
        try:
            rows.extend(parent.recv())
        except EOFError:
            raise RuntimeError(f"benchmark {name} failed (exit code {proc.exitcode})") from None
        finally:
            proc.join()
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
