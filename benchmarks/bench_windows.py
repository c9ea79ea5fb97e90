"""The executor thread's cost per offloaded block on a sliding-window model (two KV layer
groups, TensorRT-LLM's per-group calls) against a one-group model, in the same run.

The simulated sliding-window executor (``kvbm_plugin.testing.vswa_engine``, TP 1) runs the
same chats twice per round: once with a sliding and a full-attention group (every tier slot
holds both groups' pages), once with the full group alone on the flat calls; the order
alternates per round. Two costs per offloaded block, each on the executor thread:

* the leader's hooks (CPU time: ``get_num_new_matched_tokens``, both forms of
  ``update_state_after_alloc`` and ``request_finished``, ``build_connector_meta``);
* the worker's hooks (wall time: ``bind_connector_meta``, ``start_load_kv``,
  ``save_kv_layer``, ``wait_for_save``), which for several groups include the wait until the
  iteration's saves are issued (on CPU: copied) before a sliding page can be reused.

    python benchmarks/bench_windows.py [--quick] [--rounds N] [--requests N]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import Row, format_table  # noqa: E402
from kvbm_plugin import consolidator_config as cc  # noqa: E402

BS = 16
TARGET_RATIO = 1.5  # the leader's per-block cost with two groups against one
LEADER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                "update_state_after_alloc_by_layer_group", "build_connector_meta",
                "request_finished", "request_finished_by_layer_group")
WORKER_HOOKS = ("bind_connector_meta", "start_load_kv", "save_kv_layer", "wait_for_save")


def _timed(obj: Any, names: tuple[str, ...], total: list[float], clock: Any) -> None:
    """Wrap ``obj``'s methods so that their time on the calling thread adds up in ``total``
    (a method calling another wrapped one is counted once: only the outermost call)."""
    depth = [0]
    for name in names:
        method = getattr(obj, name)

        @functools.wraps(method)
        def wrapper(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            depth[0] += 1
            start = clock()
            try:
                return _method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    total[0] += clock() - start

        setattr(obj, name, wrapper)


def _one(grouped: bool, requests: int, round_no: int) -> tuple[float, float, int]:
    """(leader s, worker s, blocks offloaded) of one engine running the chats."""
    from kvbm_plugin.testing.vswa_engine import VswaConfig, VswaEngine

    env = {cc.ENABLE_CONSOLIDATOR: "false", cc.EVENTS_SOURCE: "off",
           cc.CPU_CACHE_NUM_BLOCKS: str(requests * 24)}
    config = VswaConfig(tokens_per_block=BS, window=8 * BS, sliding_layers=2 if grouped else 0,
                        full_layers=2, num_kv_heads=4, head_dim=16, num_pages=256, env=env)
    with VswaEngine(config) as engine:
        leader, worker = [0.0], [0.0]
        _timed(engine.leader, LEADER_HOOKS, leader, time.thread_time)
        _timed(engine.ranks[0].worker, WORKER_HOOKS, worker, time.perf_counter)
        history: dict[int, list[int]] = {}
        gc.collect()
        gc.disable()  # a collection would land on whichever variant allocated last
        try:
            for r in range(requests):
                chat = r % 4
                tokens = history.get(chat, []) + [(round_no * 7919 + r * 104729 + i) % 30000
                                                  + 1 for i in range(3 * BS + 3)]
                req = engine.submit(tokens, 4)
                engine.run_until_idle()
                history[chat] = engine.tokens(req)[:-1][-12 * BS:]
        finally:
            gc.enable()
        return leader[0], worker[0], engine.leader.stats()["saves_scheduled"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 16 requests")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args(argv)
    rounds, requests = (3, 16) if args.quick else (args.rounds, args.requests)
    for grouped in (False, True):  # warm-up: imports, first allocations (not counted)
        _one(grouped, 4, rounds + 1)
    leader: dict[bool, list[float]] = {False: [], True: []}
    worker: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for grouped in ((False, True) if r % 2 == 0 else (True, False)):
            lead, work, blocks = _one(grouped, requests, r)
            leader[grouped].append(lead / max(1, blocks) * 1e6)
            worker[grouped].append(work / max(1, blocks) * 1e6)
    ratios = [g / f for g, f in zip(leader[True], leader[False], strict=True)]
    ratio = statistics.median(leader[True]) / statistics.median(leader[False])
    rows = [
        Row("windows", f"leader executor-thread time per offloaded block, sliding + full group "
            f"vs one group ({rounds} paired rounds x {requests} chat turns; ratio spread "
            f"{min(ratios):.2f}-{max(ratios):.2f}x)", statistics.median(leader[True]), "us",
            baseline=statistics.median(leader[False]), target=f"<= {TARGET_RATIO:g}x",
            passed=ratio <= TARGET_RATIO),
        Row("windows", "worker executor-thread time per offloaded block, sliding + full group "
            "vs one group (wall; includes waiting for the saves' issue, on CPU their copy)",
            statistics.median(worker[True]), "us", baseline=statistics.median(worker[False])),
    ]
    print(format_table(rows))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
