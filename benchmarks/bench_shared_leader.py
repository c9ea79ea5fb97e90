"""The leader's executor-thread cost per offloaded block, with the shared tier's write-through
and without it, in the same run.

A simulated engine (TP 1, ranks in-process) runs the same workload twice per round, once with
a host tier only and once with a host tier plus the shared tier (an in-memory store, the real
SharedAgent and directory); the variants' order alternates per round. The CPU time the
leader's hooks take on the executor thread (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``: everything the
engine thread pays, the write-through's digest, op and bookkeeping included) is divided by the
blocks offloaded. Paired rounds, median and spread of the per-round difference.

    python benchmarks/bench_shared_leader.py [--quick] [--rounds N] [--requests N]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import Row, format_table  # noqa: E402
from kvbm_plugin import consolidator_config as cc  # noqa: E402
from kvbm_plugin.testing.memory_store import MemoryStore  # noqa: E402
from kvbm_plugin.worker import shared_io  # noqa: E402

BS = 16
# The executor thread's cost per offloaded block with the write-through, against host only:
# the write-through adds one digest, one op and one more tier STORE per block, the host
# save's own bookkeeping is the baseline.
TARGET_RATIO = 1.5
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished")


def _timed_hooks(leader: Any, total: list[float]) -> None:
    """Wrap the leader's hooks so that their executor-thread CPU time adds up in ``total``."""
    for name in HOOKS:
        method = getattr(leader, name)

        @functools.wraps(method)
        def wrapper(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                total[0] += time.thread_time() - start

        setattr(leader, name, wrapper)


def _one(shared: bool, requests: int, tmp: str, round_no: int) -> tuple[float, int]:
    """Executor-thread seconds of the leader's hooks and blocks offloaded, one engine."""
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    env = {cc.ENABLE_CONSOLIDATOR: "false", cc.CPU_CACHE_NUM_BLOCKS: str(requests * 20)}
    if shared:
        env.update({cc.SHARED_TIER: "memory", cc.SHARED_MODEL_KEY: "bench",
                    cc.SHARED_QUEUE_BLOCKS: str(requests * 20),
                    cc.SHARED_ANNOUNCE_ENDPOINT: f"ipc://{tmp}/announce-{round_no}"})
    engine = SimulatedEngine(EngineConfig(num_layers=2, num_kv_heads=4, head_dim=16,
                                          tokens_per_block=BS, num_gpu_blocks=256,
                                          max_num_tokens=2048, env=env))
    try:
        leader = engine.leader
        if shared:
            deadline = time.monotonic() + 30
            while leader._shared.agent is None and time.monotonic() < deadline:
                time.sleep(0.01)
        total = [0.0]
        _timed_hooks(leader, total)
        for r in range(requests):
            engine.submit([(round_no * 7919 + r * 104729 + i) % 30000 + 1
                           for i in range(16 * BS + 3)], 2)
        gc.collect()
        gc.disable()  # a collection would land on whichever variant allocated last
        try:
            engine.run_until_idle(timeout_s=120)
        finally:
            gc.enable()
        stats = leader.stats()
        if shared:
            assert stats["shared_saves_scheduled"] == stats["saves_scheduled"], stats
        return total[0], stats["saves_scheduled"]
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 16 requests")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args(argv)
    rounds, requests = (3, 16) if args.quick else (args.rounds, args.requests)
    store = MemoryStore(lease_s=60.0)

    class Client(MemoryStore):  # one client per process, sharing the store's objects
        def __init__(self) -> None:  # noqa: D107 - a view of ``store``
            self.__dict__ = store.__dict__

        def close(self) -> None:
            return None

    shared_io.open_store = lambda settings, segment_bytes=None: Client()  # type: ignore[assignment]
    base, with_shared, added = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-shared-leader-") as tmp:
        for shared in (False, True):  # warm-up: imports, first allocations (not counted)
            _one(shared, 4, tmp, rounds + 1)
        store.clear()
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            per: dict[bool, float] = {}
            for shared in order:
                seconds, blocks = _one(shared, requests, tmp, r)
                per[shared] = seconds / max(1, blocks) * 1e6
            base.append(per[False])
            with_shared.append(per[True])
            added.append(per[True] - per[False])
            store.clear()
    ratios = [w / b for w, b in zip(with_shared, base, strict=True)]
    ratio = statistics.median(with_shared) / statistics.median(base)
    rows = [
        Row("shared", f"leader executor-thread time per offloaded block, host + shared tier "
            f"vs host only ({rounds} paired rounds x {requests} requests of 16 blocks; ratio "
            f"spread {min(ratios):.2f}-{max(ratios):.2f}x)", statistics.median(with_shared),
            "us", baseline=statistics.median(base), target=f"<= {TARGET_RATIO:g}x",
            passed=ratio <= TARGET_RATIO),
        Row("shared", f"added by the write-through per offloaded block (paired; spread "
            f"{min(added):.1f}-{max(added):.1f} us)", statistics.median(added), "us"),
    ]
    print(format_table(rows))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
