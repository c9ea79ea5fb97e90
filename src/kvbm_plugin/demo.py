"""``kvbm-plugin demo``: the whole plugin end to end on a simulated TensorRT-LLM engine.

The real KvbmConnectorLeader and KvbmConnectorWorker run inside the simulated executor
(TP=2 by default), with host and disk tiers sized so the GPU pool overflows, the per-rank
GPU-tier publisher, the in-process consolidator, and a subscriber of the consolidated stream
that builds the view a router would. The workload is a multi-turn chat: every session shares a
system prompt and re-sends its growing history each turn, so later turns reuse prefixes that the
GPU already evicted.

The run passes only if: every request finished, every onboarded block's KV bytes were exact,
the subscriber saw no gap, no loss, no duplicate STORE, no REMOVE of an unknown block, no
STORE before its parent, and its view equals the blocks the GPU pool and tiers really hold.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.events import to_signed_int64

# The demo's tenants: sessions alternate between them (cache salts).
_TENANTS = ("tenant-a", "tenant-b")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


class _Progress:
    """A one-line progress bar on stderr (no dependency), redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._last = 0.0

    def update(self, done: int, note: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // max(1, self.total)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r[{bar}] {done}/{self.total} requests  {note}   ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _demo_env(tmp: str, args: argparse.Namespace) -> dict[str, str]:
    """Endpoints as ipc paths in a private temp dir: no port can collide on the user's machine."""
    env = {
        cc.ENABLE_CONSOLIDATOR: "true",
        cc.CONSOLIDATOR_MODE: args.mode,
        cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu",
        cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-replay",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/consolidated",
        cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/consolidated-replay",
    }
    tiers = set(args.tiers.split(",")) - {"", "none"}
    unknown = tiers - {"host", "disk"}
    if unknown:
        raise SystemExit(f"--tiers: unknown tier(s) {sorted(unknown)}; use host, disk or none")
    if "host" in tiers:
        env[cc.CPU_CACHE_NUM_BLOCKS] = str(args.host_blocks)
    if "disk" in tiers:
        env[cc.DISK_CACHE_NUM_BLOCKS] = str(args.disk_blocks)
        env[cc.DISK_CACHE_DIR] = f"{tmp}/disk"
    return env


def _chat_workload(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per turn and session, the user message tokens."""
    rng = random.Random(args.seed)
    system = [rng.randrange(1, 30000) for _ in range(args.system_tokens)]
    turns = [[[rng.randrange(1, 30000) for _ in range(rng.randint(args.user_tokens // 2,
                                                                   args.user_tokens))]
              for _ in range(args.sessions)] for _ in range(args.turns)]
    return system, turns


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from kvbm_plugin.subscribe import StreamSubscriber
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available on this machine", file=sys.stderr)
        return 2
    system, turns = _chat_workload(args)
    total = args.sessions * args.turns
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbm-demo-") as tmp:
        env = _demo_env(tmp, args)
        config = cc.load_consolidator_config(env)
        engine = SimulatedEngine(EngineConfig(
            num_layers=args.layers, num_kv_heads=4, head_dim=16,
            tokens_per_block=args.block_size, num_gpu_blocks=args.gpu_blocks,
            tp_size=args.tp, max_num_tokens=512, max_batch_size=8, device=args.device,
            dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
            env=env, vocab_size=30000))
        assert config.output_replay is not None
        subscriber = StreamSubscriber(config.output.connect, config.output_replay.connect,
                                      start_seq=0)
        progress = _Progress(total, enabled=not args.no_progress)
        try:
            histories = [list(system) for _ in range(args.sessions)]
            done = 0
            for turn, messages in enumerate(turns):
                ids = []
                for session, message in enumerate(messages):
                    histories[session].extend(message)
                    # Sessions alternate between two tenants sharing the system prompt; their
                    # cache salts keep each tenant's blocks (GPU, host, disk) to itself.
                    ids.append(engine.submit(histories[session], args.gen_tokens,
                                             cache_salt=_TENANTS[session % len(_TENANTS)]))
                while not engine.idle():
                    if engine.step() == 0:
                        time.sleep(0.0005)  # waiting for transfer threads only
                    subscriber.poll(0)
                    finished = sum(engine.result(i).state == "done" for i in ids)
                    stats = engine.stats()
                    reused = stats.gpu_hit_tokens + stats.host_hit_tokens + stats.disk_hit_tokens
                    progress.update(done + finished, f"turn {turn + 1}/{args.turns}  "
                                    f"reused {reused / max(1, stats.prompt_tokens):.0%} of "
                                    f"prompt tokens")
                    if time.monotonic() - started > args.timeout:
                        raise TimeoutError(f"demo exceeded --timeout {args.timeout}s")
                done += len(ids)
                for session, req_id in enumerate(ids):
                    histories[session] = engine.result(req_id).tokens
            progress.update(done, "draining event streams", force=True)
            checks, summary = _settle_and_check(engine, subscriber, args)
        finally:
            progress.close()
            subscriber.close()
            engine.shutdown()
    _print_summary(summary, checks, time.monotonic() - started)
    return 0 if all(c.ok for c in checks) else 1


def _settle_and_check(engine, subscriber, args: argparse.Namespace):  # noqa: ANN001, ANN202
    """Flush the last GPU events, wait until the subscriber has everything, then compare."""
    engine.leader.flush_events()  # events of the last iteration (TRT-LLM: next iteration)
    consolidator = engine.leader.consolidator
    truth = engine.resident_blocks()
    if args.mode == "dedup":
        expected = {(0, to_signed_int64(h)) for per_rank in truth.values() for h in per_rank[0]}
    else:
        expected = {(0, to_signed_int64(h), medium) for medium, per_rank in truth.items()
                    for h in per_rank[0]}

    def view() -> set:
        return subscriber.held if args.mode == "dedup" else subscriber.held_with_medium

    deadline = time.monotonic() + args.settle_timeout
    while time.monotonic() < deadline:
        consolidator.wait_idle(0.2)
        subscriber.poll(20)
        published = consolidator.stats()["batches_out"]
        if subscriber.next_seq == published and view() == expected:
            break
    subscriber.poll(50)
    stats = engine.stats()
    sink = engine.leader.event_sink.stats()
    cons = consolidator.stats()
    sub = subscriber.stats
    blocks_in = cons["store_blocks_in"] + cons["remove_blocks_in"]
    blocks_out = cons["store_blocks_out"] + cons["remove_blocks_out"]
    prompt = max(1, stats.prompt_tokens)
    lost = sink["publisher_lost_batches"] + cons["output_lost"] + sub.missing_batches
    summary = [
        ("requests", f"{stats.requests_finished} finished / {stats.requests_submitted} "
                     f"submitted, {stats.iterations} engine iterations, TP={args.tp}"),
        ("prefill tokens", f"{stats.prompt_tokens} in prompts: {stats.computed_prefill_tokens} "
                           f"computed, {prompt - stats.computed_prefill_tokens} reused"),
        ("hit rate GPU", f"{stats.gpu_hit_tokens / prompt:.1%} ({stats.gpu_hit_tokens} tokens)"),
        ("hit rate host", f"{stats.host_hit_tokens / prompt:.1%} ({stats.host_hit_tokens} "
                          "tokens)"),
        ("hit rate disk", f"{stats.disk_hit_tokens / prompt:.1%} ({stats.disk_hit_tokens} "
                          "tokens)"),
        ("bytes offloaded", _bytes(stats.bytes_offloaded) + " (all ranks)"),
        ("bytes onboarded", _bytes(stats.bytes_onboarded) + " (all ranks)"),
        ("GPU-tier events, dp rank 0", f"{sink['blocks_stored']} blocks stored, "
                                       f"{sink['blocks_removed']} removed, "
                                       f"{sink['publisher_batches_published']} batches"),
        ("tier events", f"{cons['registrations']} host/disk store/remove registrations"),
        ("consolidated events", f"{cons['store_blocks_out']} block stores, "
                                f"{cons['remove_blocks_out']} block removes, "
                                f"{cons['batches_out']} batches"),
        ("suppressed by dedup", f"{blocks_in - blocks_out} of {blocks_in} block events"),
        ("gaps / losses", f"{sub.gaps} gaps, {lost} batches lost"),
        ("subscriber view", f"{len(view())} blocks held; truth {len(expected)} "
                            f"(GPU {len(truth['GPU'][0])}, host {len(truth['CPU'][0])}, "
                            f"disk {len(truth['DISK'][0])})"),
    ]
    checks = [
        Check("every request finished", stats.requests_finished == stats.requests_submitted,
              f"{stats.requests_finished}/{stats.requests_submitted}"),
        Check("onboarded KV bytes exact", stats.kv_mismatches == 0,
              f"{stats.kv_mismatches} mismatching blocks"),
        _tier_reuse_check(args, stats, sink),
        Check("no gaps, no losses", sub.gaps == 0 and lost == 0,
              f"{sub.gaps} gaps, {lost} lost"),
        Check("no duplicate STORE, no unknown REMOVE, parents first",
              sub.duplicate_stores == 0 and sub.unknown_removes == 0 and sub.orphan_stores == 0,
              f"{sub.duplicate_stores} duplicate, {sub.unknown_removes} unknown, "
              f"{sub.orphan_stores} orphan"),
        Check("subscriber view == tiers' true contents", view() == expected,
              f"missing {len(expected - view())}, extra {len(view() - expected)}"),
    ]
    return checks, summary


def _tier_reuse_check(args: argparse.Namespace, stats, sink: dict) -> Check:  # noqa: ANN001
    """Tiers must serve evicted prefixes, when the run gives them the chance: a later turn and a
    GPU pool that evicted something."""
    name = "prefixes reused from tiers"
    reused = stats.host_hit_tokens + stats.disk_hit_tokens
    detail = f"host {stats.host_hit_tokens} + disk {stats.disk_hit_tokens} tokens"
    if "none" in args.tiers.split(","):
        return Check(name, True, "not exercised (--tiers none)")
    if args.turns < 2 or sink["blocks_removed"] == 0:
        return Check(name, True, f"not exercised (one turn, or the GPU pool never evicted); "
                                 f"{detail}")
    return Check(name, reused > 0, detail)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _print_summary(summary: list[tuple[str, str]], checks: list[Check], seconds: float) -> None:
    width = max(len(k) for k, _ in summary)
    print(f"\nkvbm-plugin demo: {seconds:.1f} s")
    for key, value in summary:
        print(f"  {key.ljust(width)}  {value}")
    print()
    for check in checks:
        print(f"  [{'PASS' if check.ok else 'FAIL'}] {check.name}: {check.detail}")
    print("\nall checks passed" if all(c.ok for c in checks) else "\nSOME CHECKS FAILED")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbm-plugin demo",
        description="Run the real leader and worker on a simulated TensorRT-LLM engine with a "
                    "multi-turn chat workload; exit 0 only if every check holds.")
    parser.add_argument("--sessions", type=int, default=16, help="chat sessions (default 16)")
    parser.add_argument("--turns", type=int, default=4, help="turns per session (default 4)")
    parser.add_argument("--system-tokens", type=int, default=128,
                        help="shared system prompt length (default 128)")
    parser.add_argument("--user-tokens", type=int, default=48,
                        help="max user message length (default 48)")
    parser.add_argument("--gen-tokens", type=int, default=16,
                        help="tokens generated per turn (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--gpu-blocks", type=int, default=64, help="GPU pool size in blocks")
    parser.add_argument("--host-blocks", type=int, default=96, help="host tier size in blocks")
    parser.add_argument("--disk-blocks", type=int, default=512, help="disk tier size in blocks")
    parser.add_argument("--tiers", default="host,disk",
                        help="offload tiers: host,disk | host | disk | none")
    parser.add_argument("--mode", choices=("dedup", "passthrough"), default="dedup",
                        help="consolidator mode (default dedup)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=120.0, help="give up after seconds")
    parser.add_argument("--settle-timeout", type=float, default=20.0,
                        help="seconds to wait for the subscriber to catch up at the end")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main_demo(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("sessions", "turns", "system_tokens", "user_tokens", "gen_tokens", "tp",
                 "layers", "block_size", "gpu_blocks", "host_blocks", "disk_blocks"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    return run_demo(args)
