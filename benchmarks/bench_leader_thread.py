"""What the leader costs TensorRT-LLM's executor thread: per offloaded block, per onboarded
block, fixed per request, at 1, 64 and 256 blocks per request, with the shared tier, and with
a full host tier.

A simulated engine (TP 1, in-process ranks; host tier, the in-process consolidator on, 32-token
blocks) runs each workload twice in one round: an offload phase (fresh prompts of ``n`` full
blocks + 1 token, every block offloaded to the host tier), then an onboard phase (the same
prompts again; the GPU pool holds one request at a time, so every block is loaded back from
the host tier). The thread CPU time (``time.thread_time``) of the leader's hooks
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``: everything the engine thread pays the leader) is summed per phase and
divided by the requests and blocks. Rounds alternate the workloads' order; medians with the
spread over rounds.

* per offloaded / onboarded block: ``(T(256) - T(1)) / 255`` per request (the slope), and the
  cost per block of 2,048-token prompts (``T(64) / 64``, everything included);
* fixed per request: ``T(1)`` minus one block's slope;
* flat: ``T(256) / 256`` against the slope between 1 and 64 blocks;
* the shared tier: 64-block prompts with the write-through on (an in-memory store, the real
  agent and directory), against host only in the same round, per offloaded block and per
  onboarded block (loaded back from the host tier, the shared tier asked about the run);
* a big tier: 64-block prompts with ``--tier-blocks`` unrelated blocks committed in the host
  tier (``--tier-blocks 1000000``), each round once with room to spare and once with the tier
  holding exactly those, so that every save evicts one (a tier's steady state);
* a host tier in front of a disk tier (with ``--tier-blocks``): a host tier of 16,384 blocks
  filled to its steady state by real requests (each save evicts a host block, demoted to a
  disk tier behind it), against the same host tier alone in the same round;
* the event pump's own thread CPU per block (info): the drain, the sink and the publishing
  that run off the executor thread (``leader/event_pump.py``), so that moving work off it is
  seen, not hidden; and the leader's keeper thread's CPU per block (info): the workers'
  reports it applied (folded, committed, their STOREs registered) off the executor thread
  (``leader/keeper.py``), for the same reason;
* per request per generation step (info): 32 requests of 4-block prompts decoding together,
  ``(T(66 output tokens) - T(2)) / 32 / 64``: what every running request costs each iteration
  besides the blocks it fills (one in 32 steps here, included), the part of a request's cost
  that grows with its output (not in the fixed cost, whose requests stop after one token);
* an engine's first request (info): each engine first runs a one-block request of its own,
  not in the rows above: what an engine pays once (the event source found and attached, the
  tiers sized) is not a cost per request or per block;
* this machine's cold start (info): one block's content key right after a 1 ms sleep against
  warm. Each hook runs after the executor thread waited or ran other code, so every fixed cost
  above includes such a refill of caches and TLB, which this calibrates.

    python benchmarks/bench_leader_thread.py [--quick] [--rounds N] [--tier-blocks N]
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import Row, format_table  # noqa: E402
from benchmarks.bench_shared_leader import _timed_hooks as time_leader_hooks  # noqa: E402
from kvbm_plugin import consolidator_config as cc  # noqa: E402
from kvbm_plugin.testing.memory_store import MemoryStore  # noqa: E402
from kvbm_plugin.worker import shared_io  # noqa: E402

BS = 32
TARGET_BLOCK_US = 5.0  # per offloaded and per onboarded block (issue 25)
TARGET_SHARED = 1.25  # with the shared tier, against host only
TARGET_FIXED_US = 100.0  # per request
TARGET_FLAT = 1.5  # per block at 256 blocks per request against the 1..64 slope


def _timed_hooks(leader: Any, total: list[float], events: list[float] | None) -> None:
    """Wrap the leader's hooks so that their executor-thread CPU time adds up in ``total``, and
    with ``events``, the GPU-tier event path's part of it (``GpuTierEvents.sync``/``flush``:
    TensorRT-LLM's event drain, the sink, the publisher, the consolidator's flush) in it. The
    inner wrappers' own clock reads fall inside the hooks' time (5-10 us per one-block
    request), so the runs that measure the event path's share are not those of the cost rows."""
    time_leader_hooks(leader, total)  # bench_shared_leader's: the same four hooks
    if events is None:
        return
    engine_thread = threading.get_ident()
    gpu = leader._gpu  # noqa: SLF001 - its calls are timed, not changed
    for name in ("sync", "flush"):
        method = getattr(gpu, name)

        @functools.wraps(method)
        def part(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            if threading.get_ident() != engine_thread:  # the idle keeper's: not counted
                return _method(*args, **kwargs)
            start = time.thread_time()
            try:
                return _method(*args, **kwargs)
            finally:
                events[0] += time.thread_time() - start

        setattr(gpu, name, part)


def _env(tag: str, host_blocks: int) -> dict[str, str]:
    """An engine's settings: the consolidator on, its sockets under ``tag``, a host tier of
    ``host_blocks``."""
    return {cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{tag}-gpu",
            cc.REPLAY_ENDPOINT: f"ipc://{tag}-gpu-r", cc.OUTPUT_ENDPOINT: f"ipc://{tag}-out",
            cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tag}-out-r",
            cc.CPU_CACHE_NUM_BLOCKS: str(host_blocks)}


def _run_without_gc(engine: Any) -> None:
    """Run ``engine`` until idle with the cyclic collector off (a collection would land on
    whichever measurement allocated last)."""
    gc.collect()
    gc.disable()
    try:
        engine.run_until_idle(timeout_s=300)
    finally:
        gc.enable()


def _fill_host(leader: Any, blocks: int) -> None:
    """Commit ``blocks`` unrelated root blocks into the host tier (as if offloaded earlier)."""
    index = leader._tiers.host  # noqa: SLF001 - the benchmark sets the tier's state up
    tokens = [1] * BS
    for i in range(blocks):
        key = (1 << 62) + i
        index.reserve(key, key, None, tokens, None)
        index.commit(key)


def _prompt(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n_blocks * BS + 1)]


def _one(n_blocks: int, requests: int, tmp: str, seed: int, *, shared: bool = False,
         tier_blocks: int = 0, full: bool = False, parts: bool = False,
         counters: dict[str, int] | None = None, first: list[float] | None = None,
         ) -> tuple[float, float, int, int, float, float, float]:
    """(offload-phase seconds, onboard-phase seconds, blocks offloaded, blocks onboarded,
    seconds of both phases in the GPU-tier event path on the executor thread (``parts``: timed
    apart, else 0), seconds of the event pump's own thread, seconds of the leader's keeper
    thread: the reports it applied off the executor thread). ``tier_blocks``: unrelated blocks
    committed to the host tier first; ``full``: the host tier holds exactly those, so every
    save evicts one (its REMOVE registered), as in a tier at its steady state. ``counters``:
    filled with the leader's final counters (the measured requests'). Each engine first runs
    one one-block request of its own, not counted: what an engine pays once, at its first
    iteration (the event source found and attached, the tiers sized, the naming rules
    confirmed), is not a cost per request; ``first``: its hooks' seconds appended."""
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    tag = f"{tmp}/{seed}-{n_blocks}-{int(shared)}"
    env = _env(tag, tier_blocks if full else tier_blocks + requests * (n_blocks + 2) + 64)
    if shared:
        env.update({cc.SHARED_TIER: "memory", cc.SHARED_MODEL_KEY: "bench",
                    cc.SHARED_QUEUE_BLOCKS: str(requests * (n_blocks + 2)),
                    cc.SHARED_ANNOUNCE_ENDPOINT: f"ipc://{tag}-announce"})
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=BS,
        num_gpu_blocks=n_blocks + 2, max_num_tokens=n_blocks * BS + 64, max_batch_size=4,
        env=env))
    try:
        leader = engine.leader
        if shared:
            deadline = time.monotonic() + 30
            while leader._shared.agent is None and time.monotonic() < deadline:  # noqa: SLF001
                time.sleep(0.01)
        if tier_blocks:
            leader._ensure_tiers()  # noqa: SLF001 - sized as the first hook would
            _fill_host(leader, tier_blocks)
        total, events = [0.0], [0.0]
        _timed_hooks(leader, total, events if parts else None)
        # The engine's first request (its own prompt: no block in common with those below)
        engine.submit(_prompt(seed * 1000 + 999, 1), 1)
        engine.run_until_idle(timeout_s=300)
        if first is not None:
            first.append(total[0])
        before = leader.stats()
        prompts = [_prompt(seed * 1000 + r, n_blocks) for r in range(requests)]
        # Its thread's CPU is read, not changed (None: a revision before the pump, compared)
        pump = getattr(leader._gpu, "pump", None)  # noqa: SLF001
        pump_start = pump.cpu_s if pump is not None else 0.0
        keeper = leader._keeper  # noqa: SLF001 - its thread's CPU is read
        keeper_start = getattr(keeper, "cpu_s", 0.0)  # (0: a revision before it applied)
        seconds = []
        for _phase in ("offload", "onboard"):
            for p in prompts:
                engine.submit(p, 1)
            total[0] = 0.0
            if _phase == "offload":
                events[0] = 0.0
            _run_without_gc(engine)
            seconds.append(total[0])
        stats = leader.stats()
        for name in ("saves_scheduled", "matched_host_tokens", "shared_saves_scheduled",
                     "hook_lock_waits"):
            stats[name] -= before[name]  # the measured requests' alone
        if counters is not None:
            counters.update(stats)
        if full:
            assert stats["host_evictions"] >= stats["saves_scheduled"] > 0, stats
        onboarded = stats["matched_host_tokens"] // BS
        assert onboarded >= (requests - 1) * n_blocks, (onboarded, stats)
        if shared:
            assert stats["shared_saves_scheduled"] == stats["saves_scheduled"], stats
        return (seconds[0], seconds[1], stats["saves_scheduled"], onboarded, events[0],
                (pump.cpu_s if pump is not None else 0.0) - pump_start,
                getattr(keeper, "cpu_s", 0.0) - keeper_start)
    finally:
        engine.shutdown()


def _host_before_disk(tmp: str, seed: int, disk: bool, host: int = 16384,
                      measured: int = 16) -> tuple[float, dict[str, int]]:
    """(µs of the hooks' thread CPU per offloaded block, the leader's counters over the
    measured requests): a host tier of ``host`` blocks, with a disk tier of 4x behind it when
    ``disk``, filled to its steady state by real requests (64-block prompts, each of its
    blocks written by the worker, so that demotions copy real bytes), then ``measured`` more
    such requests, every save evicting one host block (demoted to disk, when there is one)."""
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    tag = f"{tmp}/hd-{seed}-{int(disk)}"
    env = _env(tag, host)
    if disk:
        env.update({cc.DISK_CACHE_NUM_BLOCKS: str(4 * host), cc.DISK_CACHE_DIR: f"{tag}-disk"})
    engine = SimulatedEngine(EngineConfig(
        num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=BS, num_gpu_blocks=66,
        max_num_tokens=64 * BS + 64, max_batch_size=4, env=env))
    try:
        leader = engine.leader
        for r in range(host // 64 + 40):  # full, and 40 requests' blocks evicted
            engine.submit(_prompt(seed * 100000 + r, 64), 1)
            if r % 32 == 31:
                engine.run_until_idle(timeout_s=300)
        engine.run_until_idle(timeout_s=300)
        total = [0.0]
        _timed_hooks(leader, total, None)
        before = leader.stats()
        for r in range(measured):
            engine.submit(_prompt(seed * 100000 + 50000 + r, 64), 1)
        _run_without_gc(engine)
        after = leader.stats()
        counters = {k: after[k] - before.get(k, 0) for k in after}
        assert counters["host_evictions"] >= counters["saves_scheduled"] > 0, counters
        return total[0] / counters["saves_scheduled"] * 1e6, counters
    finally:
        engine.shutdown()


def _decode(tmp: str, seed: int, batch: int = 32, steps: int = 64) -> float:
    """µs of the hooks' thread CPU per request per generation step: ``batch`` requests of
    4-block prompts decoding together, ``steps + 2`` output tokens against 2 (each run its
    own engine; the blocks the steps fill are offloaded as they fill, included)."""
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    def run(out_tokens: int) -> float:
        tag = f"{tmp}/decode-{seed}-{out_tokens}"
        env = _env(tag, batch * (4 + out_tokens // BS + 2) + 64)
        engine = SimulatedEngine(EngineConfig(
            num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=BS,
            num_gpu_blocks=batch * (4 + out_tokens // BS + 3),
            max_num_tokens=batch * (4 * BS + 64), max_batch_size=batch, env=env))
        try:
            total = [0.0]
            _timed_hooks(engine.leader, total, None)
            for r in range(batch):
                engine.submit(_prompt(seed * 1000 + r, 4), out_tokens)
            _run_without_gc(engine)
            return total[0]
        finally:
            engine.shutdown()

    short = run(2)
    return (run(steps + 2) - short) / batch / steps * 1e6


def _cold_start() -> tuple[float, float]:
    """(µs of one block's content key right after a 1 ms sleep, µs of it warm), thread CPU,
    medians: what this machine charges code that runs after its thread blocked (caches and
    TLB refilled), as each hook does in the engine. A calibration for the fixed-cost rows."""
    from kvbm_plugin.tiers.content_keys import block_keys

    tokens = _prompt(7, 1)
    clock = time.thread_time_ns

    def one() -> float:
        start = clock()
        block_keys(tokens, BS)
        return (clock() - start) / 1e3

    warm = [one() for _ in range(2000)][1000:]
    cold = []
    for _ in range(200):
        time.sleep(0.001)
        cold.append(one())
    return statistics.median(cold), statistics.median(warm)


def _spread(values: list[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, fewer requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tier-blocks", type=int, default=0,
                        help="host tier blocks committed before the full-tier rows, every "
                        "round (0: no such rows; 1000000 adds about 20 s a round)")
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    scale = 1 if args.quick else 2
    counts = {1: 32 * scale, 64: 4 * scale, 256: 2 * scale}
    store = MemoryStore(lease_s=60.0)

    class Client(MemoryStore):  # one client per process, sharing the store's objects
        def __init__(self) -> None:  # noqa: D107 - a view of ``store``
            self.__dict__ = store.__dict__

        def close(self) -> None:
            return None

    shared_io.open_store = lambda settings, segment_bytes=None: Client()  # type: ignore[assignment]
    per: dict[str, list[float]] = {}
    firsts: list[float] = []  # each engine's first request (one block), seconds

    def note(name: str, value: float) -> None:
        per.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory(prefix="bench-leader-") as tmp:
        _one(4, 2, tmp, 0)  # warm-up: imports, first allocations (not counted)
        for r in range(rounds):
            order = [1, 64, 256] if r % 2 == 0 else [256, 64, 1]
            req_us: dict[int, tuple[float, float]] = {}
            for n in order:
                counters: dict[str, int] = {}
                off, on, saved, loaded, ev, pumped, kept = _one(n, counts[n], tmp, r * 10 + 1,
                                                                counters=counters, first=firsts)
                req_us[n] = (off / counts[n] * 1e6, on / counts[n] * 1e6)
                if n == 64:
                    note("off64", off / max(1, saved) * 1e6)
                    note("on64", on / max(1, loaded) * 1e6)
                    note("pump64", pumped / max(1, saved + loaded) * 1e6)
                    note("keeper64", kept / max(1, saved + loaded) * 1e6)
                    # (0 on a revision before the keeper applied reports)
                    note("waits64", counters.get("hook_lock_waits", 0) / counts[n])
            for k, label in ((0, "off"), (1, "on")):
                slope = (req_us[256][k] - req_us[1][k]) / 255
                note(f"{label}_slope", slope)
                note(f"{label}_fixed", req_us[1][k] - slope)
                note(f"{label}_flat", (req_us[256][k] / 256) / max(1e-9, (
                    req_us[64][k] - req_us[1][k]) / 63))
            host, with_shared = [], []
            for shared in ((False, True) if r % 2 == 0 else (True, False)):
                off, on, saved, loaded, _ev, _p, _k = _one(64, counts[64], tmp, r * 10 + 2,
                                                       shared=shared)
                (with_shared if shared else host).append((off / max(1, saved) * 1e6,
                                                          on / max(1, loaded) * 1e6))
                store.clear()
            note("shared_ratio", with_shared[0][0] / host[0][0])
            note("shared_us", with_shared[0][0])
            note("shared_on_ratio", with_shared[0][1] / host[0][1])
            note("shared_on_us", with_shared[0][1])
            note("decode", _decode(tmp, r * 10 + 6))
            for n in (1, 64):  # the event path's share: its own runs (see _timed_hooks)
                off, on, _saved, _loaded, ev, _p, _k = _one(n, counts[n], tmp, r * 10 + 5,
                                                        parts=True)
                note(f"events{n}", ev / (off + on))
            if args.tier_blocks:  # the tier is filled twice a round (seconds per million)
                off, on, saved, loaded, _ev, _p, _k = _one(64, counts[64], tmp, r * 10 + 3,
                                                   tier_blocks=args.tier_blocks)
                note("full_off", off / max(1, saved) * 1e6)
                note("full_on", on / max(1, loaded) * 1e6)
                full_counters: dict[str, int] = {}
                off, on, saved, loaded, _ev, _p, kept = _one(
                    64, counts[64], tmp, r * 10 + 4, tier_blocks=args.tier_blocks, full=True,
                    counters=full_counters)
                note("evict_off", off / max(1, saved) * 1e6)
                note("evict_on", on / max(1, loaded) * 1e6)
                note("evict_keeper", kept / max(1, saved + loaded) * 1e6)
                # (0 on a revision before the keeper evicted ahead of need)
                note("evict_ahead", full_counters.get("evicted_ahead", 0)
                     / max(1, full_counters["host_evictions"]))
                note("evict_waits", full_counters.get("hook_lock_waits", 0) / counts[64])
                for disk in ((False, True) if r % 2 == 0 else (True, False)):
                    us, hd = _host_before_disk(tmp, r * 10 + 5 + int(disk), disk)
                    note("hd_disk" if disk else "hd_host", us)
                    if disk:  # (0 on a revision before demotions were made ahead)
                        note("hd_inline", (hd["demotes_scheduled"] - hd.get("demoted_ahead", 0))
                             / max(1, hd["host_evictions"]))

    def med(name: str) -> float:
        return statistics.median(per[name])

    def rng(name: str) -> str:
        return _spread(per[name])

    b = TARGET_BLOCK_US
    rows = [
        Row("leader", f"per offloaded block, 2,048-token prompts, hooks' thread CPU (spread "
            f"{rng('off64')})", med("off64"), "us", target=f"<= {b:g} us",
            passed=med("off64") <= b),
        Row("leader", f"per onboarded block, 2,048-token prompts (spread {rng('on64')})",
            med("on64"), "us", target=f"<= {b:g} us", passed=med("on64") <= b),
        Row("leader", f"per offloaded block, slope 1 -> 256 blocks per request (spread "
            f"{rng('off_slope')})", med("off_slope"), "us", target=f"<= {b:g} us",
            passed=med("off_slope") <= b),
        Row("leader", f"per onboarded block, slope 1 -> 256 blocks per request (spread "
            f"{rng('on_slope')})", med("on_slope"), "us", target=f"<= {b:g} us",
            passed=med("on_slope") <= b),
        Row("leader", f"fixed per request, offload phase (spread {rng('off_fixed')})",
            med("off_fixed"), "us", target=f"<= {TARGET_FIXED_US:g} us",
            passed=med("off_fixed") <= TARGET_FIXED_US),
        Row("leader", f"fixed per request, onboard phase (spread {rng('on_fixed')})",
            med("on_fixed"), "us", target=f"<= {TARGET_FIXED_US:g} us",
            passed=med("on_fixed") <= TARGET_FIXED_US),
        Row("leader", f"flat: per block at 256 blocks/request over the 1 -> 64 slope, offload "
            f"(spread {rng('off_flat')})", med("off_flat"), "x",
            target=f"<= {TARGET_FLAT:g}x", passed=med("off_flat") <= TARGET_FLAT),
        Row("leader", f"flat: the same, onboard (spread {rng('on_flat')})", med("on_flat"),
            "x", target=f"<= {TARGET_FLAT:g}x", passed=med("on_flat") <= TARGET_FLAT),
        Row("leader", f"per offloaded block with the shared tier's write-through, against host "
            f"only (paired; ratio spread {rng('shared_ratio')})", med("shared_us"), "us",
            baseline=med("shared_us") / med("shared_ratio"),
            target=f"<= {TARGET_SHARED:g}x, <= {b * TARGET_SHARED:g} us",
            passed=med("shared_ratio") <= TARGET_SHARED
            and med("shared_us") <= b * TARGET_SHARED),
        Row("leader", "per onboarded block with the shared tier on (the loaded run's blocks "
            "the shared tier lacks are written through), against host only (paired; ratio "
            f"spread {rng('shared_on_ratio')})", med("shared_on_us"), "us",
            baseline=med("shared_on_us") / med("shared_on_ratio"),
            target=f"<= {TARGET_SHARED:g}x, <= {b * TARGET_SHARED:g} us",
            passed=med("shared_on_ratio") <= TARGET_SHARED
            and med("shared_on_us") <= b * TARGET_SHARED),
    ]
    rows.append(Row("leader", "of the 2,048-token rows: share in the GPU-tier event path "
                    f"(drain, sink, publisher; spread {rng('events64')})",
                    100 * med("events64"), "%"))
    rows.append(Row("leader", "of the 1-block rows (mostly the fixed cost): share in the GPU-tier "
                    f"event path (spread {rng('events1')})", 100 * med("events1"), "%"))
    rows.append(Row("leader", "of the 2,048-token rows: the event pump's own thread CPU per "
                    "offloaded or onboarded block (drain, sink, publisher; off the executor "
                    f"thread; spread {rng('pump64')})", med("pump64"), "us"))
    rows.append(Row("leader", "of the 2,048-token rows: the leader's keeper thread's CPU per "
                    "offloaded or onboarded block (the reports it applied off the executor "
                    f"thread; spread {rng('keeper64')})", med("keeper64"), "us"))
    rows.append(Row("leader", "of the 2,048-token rows: hooks that found the keeper holding the "
                    "leader's lock and waited, per request (info: at most the rest of one apply; "
                    f"spread {rng('waits64')})", med("waits64"), ""))
    rows.append(Row("leader", "per running request per generation step, 32 decoding together "
                    f"(info: grows with the output; spread {rng('decode')})", med("decode"),
                    "us"))
    first_us = [f * 1e6 for f in firsts]
    rows.append(Row("leader", "an engine's first request, one block, not in the rows above "
                    "(info: what an engine pays once, at its first iterations: the event source "
                    f"found and attached, the tiers sized; spread {_spread(first_us)})",
                    statistics.median(first_us), "us"))
    cold, warm = _cold_start()
    rows.append(Row("leader", "this machine's cold start: one block's content key right after a "
                    "1 ms sleep, against warm (info: each hook starts so in the engine)", cold,
                    "us", baseline=warm))
    if args.tier_blocks:
        rows += [
            Row("leader", f"per offloaded block, {args.tier_blocks:,} blocks in the host tier "
                f"(spread {rng('full_off')})", med("full_off"), "us",
                baseline=med("off64"), target=f"<= {b:g} us", passed=med("full_off") <= b),
            Row("leader", f"per onboarded block, {args.tier_blocks:,} blocks in the host tier "
                f"(spread {rng('full_on')})", med("full_on"), "us",
                baseline=med("on64"), target=f"<= {b:g} us", passed=med("full_on") <= b),
            Row("leader", f"per offloaded block, the host tier full at {args.tier_blocks:,} "
                "blocks: every save evicts one (on the executor thread or, ahead of need, on "
                f"the keeper's; spread {rng('evict_off')})", med("evict_off"), "us",
                baseline=med("off64"), target=f"<= {b:g} us", passed=med("evict_off") <= b),
            Row("leader", f"per onboarded block, the same full tier (spread {rng('evict_on')})",
                med("evict_on"), "us",
                baseline=med("on64"), target=f"<= {b:g} us", passed=med("evict_on") <= b),
            Row("leader", "the same full tier: the keeper thread's CPU per offloaded or "
                "onboarded block (info: the reports it applied and the evictions it made ahead "
                "of need, off the executor thread)", med("evict_keeper"), "us"),
            Row("leader", "the same full tier: share of the evictions the keeper made ahead of "
                "need (info: the rest evicted inline, on the executor thread)",
                med("evict_ahead"), ""),
            Row("leader", "the same full tier: hooks that found the keeper holding the leader's "
                "lock and waited, per request (info)", med("evict_waits"), ""),
            Row("leader", "per offloaded block, a full host tier of 16,384 blocks in front of a "
                "disk tier (every save evicts a host block, demoted to disk), against the same "
                f"host tier alone, same round (filled by real requests; spread {rng('hd_disk')})",
                med("hd_disk"), "us",
                baseline=med("hd_host"), target=f"<= {b:g} us", passed=med("hd_disk") <= b),
            Row("leader", "the same: demotions made on the executor thread per host eviction "
                "(info: the rest made ahead of need by the keeper)", med("hd_inline"), ""),
        ]
    print(f"{rounds} rounds; requests per workload {counts}; 32-token blocks; host tier, "
          "consolidator on")
    print(format_table(rows))
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
