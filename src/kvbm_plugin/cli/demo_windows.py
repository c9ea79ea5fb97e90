"""``kvbm-plugin demo --windows FULL,SLIDING``: the demo on a sliding-window model.

The simulated sliding-window executor (:mod:`kvbm_plugin.testing.vswa_engine`: a full-attention
and a sliding layer group with different page sizes, driven through TensorRT-LLM's per-group
connector calls) runs the demo's chats with the real leader and worker, the host and disk tiers
and the consolidator; a strict router view follows the consolidated stream. Checks: every
request finished, every group's onboarded bytes exact, no sliding group saved beyond its
window, no dead or -1 page touched, the router agrees with the engine's reuse on >= 99 % of
prompt tokens with 0 rule warnings. Called by :func:`kvbm_plugin.cli.demo.main_demo`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.main import UsageError

AGREEMENT_TARGET = 0.99


def parse_windows(value: str, block_size: int) -> tuple[int, int]:
    """``FULL,SLIDING`` (tokens) → (full, sliding); UsageError naming ``--windows`` else."""
    try:
        windows = sorted({int(v) for v in value.split(",")}, reverse=True)
    except ValueError:
        windows = []
    if len(windows) != 2 or len(value.split(",")) != 2 or windows[1] < block_size:
        raise UsageError(f"--windows {value}: expected two different attention windows in "
                         f"tokens, FULL,SLIDING (e.g. 4096,512), the smaller >= --block-size "
                         f"{block_size}")
    return windows[0], windows[1]


def _wait(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_windows_demo(args: argparse.Namespace,
                     report: Callable[[list[tuple[str, str]], list[Any], float], None],
                     check: Callable[[str, bool, str], Any]) -> int:
    """Runs the chats (``--sessions`` x ``--turns``) on the sliding-window model."""
    from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
    from kvbm_plugin.testing.vswa_engine import VswaConfig, VswaEngine
    from kvbm_plugin.wire.events import to_signed_int64

    full, sliding = parse_windows(args.windows, args.block_size)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available on this machine (torch "
                             f"{torch.__version__}); use --device cpu")
    rng = random.Random(args.seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbm-demo-windows-") as tmp:
        env = {cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu",
               cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-r", cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/out",
               cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/out-r", cc.EVENTS_SOURCE: "off",
               cc.CPU_CACHE_NUM_BLOCKS: str(args.host_blocks),
               cc.DISK_CACHE_NUM_BLOCKS: str(args.disk_blocks)}
        sub = TreeSubscriber(env[cc.OUTPUT_ENDPOINT], env[cc.OUTPUT_REPLAY_ENDPOINT],
                             start_seq=0, view=RouterView(args.block_size), worker="engine")
        config = VswaConfig(tokens_per_block=args.block_size, window=sliding,
                            max_seq_len=full, tp_size=args.tp, num_pages=args.gpu_blocks,
                            device=args.device, env=env)
        total = disagreed = loaded = 0
        synced = True
        try:
            with VswaEngine(config) as engine:
                leader = engine.leader
                assert leader is not None

                def route(tokens: list[int]) -> int:
                    nonlocal synced
                    # every copy done and applied, demotions too (no request waits for them)
                    _wait(lambda: leader.publish_now() is None and leader.stats()[
                        "ops_inflight"] == 0 and all(r.worker.idle() for r in engine.ranks),
                        args.settle_timeout)
                    want = {(0, to_signed_int64(h)) for tier in ("host", "disk")
                            for h in leader.resident_hashes(tier)}
                    synced &= _wait(lambda: sub.poll(5) is not None and sub.held == want,
                                    args.settle_timeout)
                    return sub.view.cached_tokens(tokens)

                system = [rng.randrange(1, 30000) for _ in range(args.system_tokens)]
                history = {s: list(system) for s in range(args.sessions)}
                for _turn in range(args.turns):
                    for s in range(args.sessions):
                        tokens = history[s] + [rng.randrange(1, 30000) for _ in
                                               range(rng.randint(1, args.user_tokens))]
                        servable = (len(tokens) - 1) // args.block_size * args.block_size
                        predicted = min(route(tokens), servable)
                        req = engine.submit(tokens, args.gen_tokens)
                        engine.run_until_idle()
                        got = engine.loaded_tokens(req)
                        total, loaded = total + len(tokens), loaded + got
                        disagreed += abs(predicted - got)
                        history[s] = engine.tokens(req)[:-1]
                stats = engine.stats
                io = engine.ranks[0].worker._groups_io  # noqa: SLF001 (the demo shows it)
                groups = io.describe() if io is not None else "?"
        finally:
            sub.close()
    agreement = 1 - disagreed / total if total else 1.0
    checks = [
        check("every request finished", stats.requests_finished == args.sessions * args.turns,
              f"{stats.requests_finished} of {args.sessions * args.turns}"),
        check("onboarded KV bytes exact in every layer group", stats.kv_mismatches == 0,
              f"{stats.pages_checked} pages checked, {stats.kv_mismatches} differ"),
        check("no sliding group saved beyond its window", stats.window_violations == 0,
              f"{stats.sliding_saves} sliding-group pages saved"),
        check("no dead or -1 page touched", stats.dead_page_touches == 0,
              f"{stats.dead_page_touches} touches"),
        check("router rule warnings 0", sub.view.counts.warnings == 0 and synced,
              str(sub.view.counts.broken() or "none")),
        check(f"router agrees with engine reuse on >= {AGREEMENT_TARGET:.0%} of prompt tokens",
              agreement >= AGREEMENT_TARGET, f"{agreement:.2%} of {total} tokens"),
    ]
    summary = [("model", f"windows {full} (full) and {sliding} (sliding) tokens: {groups}"),
               ("workload", f"{args.sessions} sessions x {args.turns} turns, TP={args.tp}"),
               ("onboarded", f"{loaded} of {total} prompt tokens ({loaded / max(total, 1):.0%})")]
    report(summary, checks, time.monotonic() - started)
    return 0 if all(c.ok for c in checks) else 1
