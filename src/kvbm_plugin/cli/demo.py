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
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.demo_signals import SIGNALS as _SIGNALS
from kvbm_plugin.cli.demo_signals import STDOUT
from kvbm_plugin.cli.demo_signals import load_engine_modules as _load_engine_modules
from kvbm_plugin.cli.demo_signals import signals_end_the_demo as _signals_end_the_demo
from kvbm_plugin.cli.main import ArgumentParser, CommandFailed, UsageError
from kvbm_plugin.wire.events import to_signed_int64

# The demo's tenants: sessions alternate between them (cache salts).
_TENANTS = ("tenant-a", "tenant-b")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


class _Progress:
    """A one-line progress bar on stderr (no dependency), redrawn at most 10 times a second;
    drawn only when stderr is a terminal (a log file or pipe gets no ``\\r`` frames)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
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


class _ErrorWatch(logging.Handler):
    """Counts what the run must not produce: ERROR records of any ``kvbm_plugin`` logger and
    exceptions that escaped a thread (``threading.excepthook``); keeps the first few lines."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.errors = 0
        self.thread_exceptions = 0
        self.first: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.errors += 1
        self._keep(f"{record.name}: {record.getMessage()}")

    def _keep(self, line: str) -> None:
        if len(self.first) < 3:
            self.first.append(line[:200])

    @contextmanager
    def watching(self) -> Iterator[_ErrorWatch]:
        plugin_logger = logging.getLogger("kvbm_plugin")
        previous_hook = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            self.thread_exceptions += 1
            self._keep(f"thread {args.thread.name if args.thread else '?'}: "
                       f"{args.exc_type.__name__}: {args.exc_value}")
            previous_hook(args)

        plugin_logger.addHandler(self)
        threading.excepthook = hook
        try:
            yield self
        finally:
            threading.excepthook = previous_hook
            plugin_logger.removeHandler(self)


def _failure_check(engine, watch: _ErrorWatch) -> Check:  # noqa: ANN001
    """Nothing failed on the way: no transfer job or op failed on any rank, the leader failed
    no save, demotion or load, nothing logged an ERROR and no thread died. (The demo injects no
    faults, so any of these is a bug even when the stream still came out right.)"""
    workers = [w.stats() for w in engine.workers]
    leader = engine.leader.stats()
    jobs = sum(w.get("jobs_failed", 0) for w in workers)
    ops = sum(w["ops_failed"] for w in workers)
    leader_failed = sum(leader.get(k, 0) for k in ("saves_failed", "demotes_failed",
                                                   "loads_failed"))
    ok = jobs == ops == leader_failed == watch.errors == watch.thread_exceptions == 0
    # Worded so that a clean run's output holds neither "ERROR" nor "failed": an operator (or
    # a script) grepping the demo's output for those words finds only real trouble.
    detail = (f"transfer jobs broken {jobs}, ops broken {ops}, saves/demotions/loads broken "
              f"{leader_failed}, error-level log lines {watch.errors}, thread exceptions "
              f"{watch.thread_exceptions}")
    if watch.first:
        detail += "; first: " + " | ".join(watch.first)
    return Check("clean run (no broken transfer, no error logged, no thread died)", ok, detail)


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
    tiers = set(args.tiers.split(",")) - {"", "none"}  # checked by _check_options
    if "host" in tiers:
        env[cc.CPU_CACHE_NUM_BLOCKS] = str(args.host_blocks)
    if "disk" in tiers:
        env[cc.DISK_CACHE_NUM_BLOCKS] = str(args.disk_blocks)
        env[cc.DISK_CACHE_DIR] = f"{tmp}/disk"
    from kvbm_plugin.cli.demo_routers import router_env

    env.update(router_env(args))  # adapters' names; the router's topic
    return _with_user_endpoints(env, cc.user_endpoint_settings())


def overridden_variables(environ: dict[str, str] | None = None) -> list[str]:
    """The plugin's variables set in ``environ`` (default ``os.environ``) that the demo does
    not honour: it sizes its tiers, places its disk directory and runs its consolidator from
    its options; only the socket-placing variables and DYN_KVBM_NATIVE are taken over."""
    import os

    environ = dict(os.environ) if environ is None else environ
    kept = set(cc.ENDPOINT_VARS) | {cc.NATIVE}
    known = {v.name for v in cc.ENV_VARS}
    return sorted(name for name in environ if name in known and name not in kept)


def _say_overridden(environ: dict[str, str] | None = None) -> None:
    names = overridden_variables(environ)
    if names:
        print("note: the demo sets its own tiers and consolidator and ignores "
              + ", ".join(names) + " (use --tiers, --host-blocks, --disk-blocks, --mode)",
              flush=True)


def _with_user_endpoints(env: dict[str, str], user: dict[str, str]) -> dict[str, str]:
    """The demo's private endpoints, replaced by whatever socket-placing variables the user set
    (read by ``consolidator_config``): a port variable replaces the private endpoint it would
    otherwise lose to (an endpoint variable wins over a port one)."""
    env = dict(env)
    if cc.EVENTS_ENDPOINT not in user and cc.TRTLLM_ZMQ_PORT in user:
        env.pop(cc.EVENTS_ENDPOINT, None)
    if cc.OUTPUT_ENDPOINT not in user and cc.LEADER_ZMQ_PUB_PORT in user:
        env.pop(cc.OUTPUT_ENDPOINT, None)
    env.update(user)
    return env


def _served_endpoints(config: cc.ConsolidatorConfig,
                      attention_dp: bool = False) -> list[tuple[str, str]]:
    """What the demo serves, as a router should register it (connect addresses)."""
    out = []
    for rank in range(config.num_ranks):
        replay = config.replay_endpoint(rank)
        out.append((f"GPU-tier events, dp rank {rank}", config.publish_endpoint(rank).connect
                    + ("" if replay is None else f"  (replay {replay.connect})")))
    outputs = [(f"consolidated events, dp rank {r}", config.for_dp_rank(r))
               for r in range(config.num_ranks)] if attention_dp \
        else [("consolidated events", config)]
    for role, ranked in outputs:
        out.append((role, ranked.output.connect + ("" if ranked.output_replay is None
                                                   else f"  (replay "
                                                   f"{ranked.output_replay.connect})")))
    return out




def run_demo(args: argparse.Namespace) -> int:
    import torch

    from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
    from kvbm_plugin.testing.chat_workload import RouterProbe, drive
    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine (torch "
                         f"{torch.__version__}); use --device cpu")
    if args.real_router == "dynamo":
        from kvbm_plugin.routers.dynamo_indexer import unavailable

        reason = unavailable()
        if reason is not None:
            raise UsageError(f"--real-router: NVIDIA Dynamo's indexer cannot run here: {reason}")
    workload = _FollowUps(_workload(args))
    steady = args.duration is not None or args.requests is not None
    total = args.requests or (0 if steady else args.sessions * args.turns)
    started = time.monotonic()
    watch = _ErrorWatch()
    _say_overridden()
    if args.processes or args.attention_dp > 1:
        _quiet_rank_processes()
    adp = args.attention_dp > 1
    with watch.watching(), tempfile.TemporaryDirectory(prefix="kvbm-demo-") as tmp:
        env = _demo_env(tmp, args)
        config = cc.load_consolidator_config(env, num_ranks=args.attention_dp, attention_dp=adp)
        for role, where in _served_endpoints(config, adp):
            print(f"serving {role}: {where}", flush=True)
        try:
            engine_config = EngineConfig(
                num_layers=args.layers, num_kv_heads=kv_heads(args.tp), head_dim=16,
                tokens_per_block=args.block_size, num_gpu_blocks=args.gpu_blocks,
                tp_size=args.tp, max_num_tokens=512, max_batch_size=8, device=args.device,
                dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                env=env, vocab_size=30000, overlap_scheduler=not args.no_overlap,
                processes=args.processes or adp, attention_dp=args.attention_dp)
            if adp:  # every rank its own process, as TensorRT-LLM runs attention DP
                from kvbm_plugin.testing.adp import AttentionDpEngine

                engine = AttentionDpEngine(engine_config)
            else:
                engine = SimulatedEngine(engine_config)
        except cc.ConfigError as exc:
            if isinstance(exc.__cause__ or exc.__context__, (zmq.ZMQError, OSError)) \
                    or "cannot bind" in str(exc):
                # A socket the run needs is taken: the machine's state, not the options.
                raise CommandFailed(f"cannot start: {exc}") from exc
            raise
        workload.engine = engine
        if adp:
            from kvbm_plugin.cli import demo_adp

            subscribers = demo_adp.subscribers_for(config, args.attention_dp,
                                                   RouterView(args.block_size))
            subscriber = subscribers[0]
            probe: RouterProbe = demo_adp.AdpRouterProbe(engine, subscribers,
                                                         settle_timeout=args.settle_timeout)
            real = None
        else:
            from kvbm_plugin.cli import demo_routers

            view = RouterView(args.block_size)
            real = None
            if args.real_router == "llm-d":  # llm-d reads what the demo's subscriber applies
                subscriber, llmd = demo_routers.llmd_subscriber(config, view)
                real = demo_routers.llmd_router(llmd, ROUTER_AGREEMENT_TARGET)
            else:
                subscriber = TreeSubscriber(
                    config.output.connect,
                    None if config.output_replay is None else config.output_replay.connect,
                    start_seq=0, view=view)
            if args.real_router == "dynamo":
                real = demo_routers.dynamo_router(args, tmp, config, view,
                                                  ROUTER_AGREEMENT_TARGET)
            subscribers = [subscriber]
            probe = RouterProbe(engine, subscriber, settle_timeout=args.settle_timeout,
                                poll=subscriber.poll,
                                external=None if real is None else real.ask,
                                lora_names=demo_routers.adapter_names(args.adapters))
        progress = _Progress(total, enabled=not args.no_progress)

        def on_step(done) -> None:  # noqa: ANN001
            _SIGNALS.check()
            STDOUT.check()  # `demo --duration 20 | head`: ends when head has gone
            stats = engine.stats()
            reused = stats.gpu_hit_tokens + stats.host_hit_tokens + stats.disk_hit_tokens
            where = (f"{time.monotonic() - started:.0f}s" if steady
                     else f"turn {workload.turn}/{args.turns}")
            share = reused / max(1, stats.prompt_tokens)
            progress.total = max(progress.total, done.finished)  # --duration: no known total
            progress.update(done.finished, f"{where}  reused {share:.0%} of prompt tokens, "
                            f"router agrees on {done.tally.agreement:.1%}")

        try:
            try:
                result = drive(engine, probe, workload, max_requests=args.requests,
                               duration_s=args.duration,
                               timeout_s=args.timeout + (args.duration or 0.0),
                               on_step=on_step)
            except TimeoutError:
                stats = engine.stats()
                raise CommandFailed(
                    f"the run did not finish within --timeout {args.timeout:g} s"
                    + (f" (after --duration {args.duration:g} s)" if args.duration else "")
                    + f": {stats.requests_finished} of {stats.requests_submitted} requests "
                    "finished; raise --timeout or shrink the run (--sessions, --turns, "
                    "--requests)") from None
            progress.update(result.finished, "draining event streams", force=True)
            if adp:
                checks, summary = demo_adp.settle_and_check(engine, subscribers, args, probe,
                                                            Check)
                checks.insert(2, demo_adp.tier_reuse_check(args, engine, probe, Check))
            else:
                checks, summary = _settle_and_check(engine, subscriber, args, workload)
            router_checks, router_summary = _router_report(result, probe)
            checks += router_checks
            summary += router_summary
            if real is not None:
                real_checks, real_summary = real.report(result, Check)
                checks += real_checks
                summary += real_summary
        finally:
            progress.close()
            for each in subscribers:
                each.close()
            engine.shutdown()
            if real is not None:
                real.close()
        checks.append(_failure_check(engine, watch))  # after shutdown: its errors count too
    _print_summary(summary, checks, time.monotonic() - started)
    return 0 if all(c.ok for c in checks) else 1


# KV heads of the simulated model: TRT-LLM splits them evenly over the TP ranks, so the demo
# gives every --tp a multiple of it (4 for TP 1, 2 and 4; 6 for TP 3; TP for TP > 4).
BASE_KV_HEADS = 4


def kv_heads(tp: int) -> int:
    """The simulated model's KV heads for ``tp`` ranks: the smallest multiple of ``tp`` that
    is at least :data:`BASE_KV_HEADS`."""
    return tp * -(-BASE_KV_HEADS // tp)


# torch's CPU wheels warn at import when NumPy is absent; the plugin does not use NumPy.
NUMPY_WARNING = "ignore:Failed to initialize NumPy"


def _quiet_rank_processes() -> None:
    """Rank processes (``--processes``, spawned) start with the interpreter's -W options,
    which ``multiprocessing`` passes on from ``sys.warnoptions``: the NumPy warning the CLI
    filters in its own process is filtered in theirs too, before they import torch."""
    if NUMPY_WARNING not in sys.warnoptions:
        sys.warnoptions.append(NUMPY_WARNING)


def _workload(args: argparse.Namespace):  # noqa: ANN202
    """Turn waves by default; a steady multi-tenant chat with --duration or --requests."""
    from kvbm_plugin.testing.chat_workload import SteadyChat, TurnWaves

    if args.duration is None and args.requests is None:
        # Sessions alternate between two tenants sharing the system prompt; their cache salts
        # keep each tenant's blocks (GPU, host, disk) to itself.
        return TurnWaves(sessions=args.sessions, turns=args.turns,
                         system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                         gen_tokens=args.gen_tokens, seed=args.seed, salts=_TENANTS,
                         adapters=args.adapters)
    return SteadyChat(tenants=args.tenants, sessions=args.sessions, max_turns=args.turns,
                      system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                      gen_tokens=args.gen_tokens, max_context=args.max_context, seed=args.seed,
                      adapters=args.adapters)


# The router-accuracy target: the share of prompt tokens on which the strict router view and the
# engine's reuse agree.
ROUTER_AGREEMENT_TARGET = 0.99


def _router_report(result, probe) -> tuple[list[Check], list[tuple[str, str]]]:  # noqa: ANN001
    """Router accuracy and the rules the strict router view had to apply."""
    view = probe.view
    counts = view.counts
    tally = result.tally
    rules = [line.strip() for line in view.summary_lines() if line.startswith(("rule", "  "))]
    trees = ", ".join(f"{medium} {n}" for (_, _, medium), n in sorted(view.blocks().items()))
    summary = [
        ("router view (strict)", f"{sum(view.blocks().values())} blocks held ({trees or 'none'})"
                                 f"; {'; '.join(rules)}"),
        ("router accuracy", tally.describe()),
    ]
    if probe.settle_timeouts or probe.settle_stalls:
        summary.append(("router settles given up", f"{probe.settle_timeouts} timed out, "
                        f"{probe.settle_stalls} on a lost batch, of {probe.settles}"))
    checks = [
        Check("router rule warnings 0", counts.warnings == 0,
              f"{counts.warnings} ({'; '.join(rules)})"),
        Check(f"router agrees with engine reuse on >= {ROUTER_AGREEMENT_TARGET:.0%} of prompt "
              "tokens", tally.agreement >= ROUTER_AGREEMENT_TARGET,
              f"{tally.agreement:.2%} over {tally.requests} requests"),
    ]
    return checks, summary


def _settle_and_check(engine, subscriber, args: argparse.Namespace,  # noqa: ANN001, ANN202
                      workload: _FollowUps):
    """Flush the last GPU events, wait until the subscriber has everything, then compare.

    The subscriber connects while the engine is already up, and a PUB socket drops what it
    sends before the subscription has reached it (which takes the I/O threads an unbounded
    time on a loaded machine). It starts at seq 0, so it fetches what it missed from the
    replay socket, as a router that joins late would: that catch-up is the join, not a gap
    (``stats.gaps`` counts only holes after it); history the replay no longer held fails the
    run like a lost batch.

    The truth is read once the engine is idle (:meth:`SimulatedEngine.idle`: every transfer
    terminal and applied by the leader); an engine still busy at ``--settle-timeout`` fails the
    check. ``drive`` returns when every request has its answer, while the leader may still have
    operations in flight. A host-to-disk demotion is one: its block left the host tier at
    eviction and joins the disk tier when its report is applied, so a block the GPU pool
    evicted in the last iteration is in no tier meanwhile (the stream says REMOVE), then STORE
    once the idle keeper applies the report. Tiers read in between lacked a block the view got
    a moment later (seen as 1-6 "extra" blocks at a 10 ms keeper period)."""
    deadline = time.monotonic() + args.settle_timeout
    while not engine.idle() and time.monotonic() < deadline:
        subscriber.poll(1)  # waits on the socket (and drains it), not a sleep
    quiet = engine.idle()
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
    lost = (sink["publisher_lost_batches"] + cons["output_lost"] + sub.missing_batches
            + sub.history_missing)
    summary = [
        ("requests", f"{stats.requests_finished} finished / {stats.requests_submitted} "
                     f"submitted, {stats.iterations} engine iterations, TP={args.tp}"
                     f"{' (rank processes)' if args.processes else ''}, "
                     f"{'plain' if args.no_overlap else 'overlap'} scheduler"
                     + (f", base model and {args.adapters} LoRA adapters" if args.adapters
                        else "")),
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
        ("gaps / losses", f"{sub.gaps} gaps, {lost} batches lost"
                          + (f" (joined late: {sub.replayed_batches} batches replayed)"
                             if sub.replayed_batches and not sub.gaps else "")),
        ("subscriber view", f"{len(view())} blocks held; truth {len(expected)} "
                            f"(GPU {len(truth['GPU'][0])}, host {len(truth['CPU'][0])}, "
                            f"disk {len(truth['DISK'][0])})"),
    ]
    checks = [
        Check("every request finished", stats.requests_finished == stats.requests_submitted,
              f"{stats.requests_finished}/{stats.requests_submitted}"),
        Check("onboarded KV bytes exact", stats.kv_mismatches == 0,
              f"{stats.kv_mismatches} mismatching blocks"),
        _tier_reuse_check(args, stats, workload),
        Check("no gaps, no losses", sub.gaps == 0 and lost == 0,
              f"{sub.gaps} gaps, {lost} lost"),
        Check("no duplicate STORE, no unknown REMOVE, parents first",
              sub.duplicate_stores == 0 and sub.unknown_removes == 0 and sub.orphan_stores == 0,
              f"{sub.duplicate_stores} duplicate, {sub.unknown_removes} unknown, "
              f"{sub.orphan_stores} orphan"),
        Check("subscriber view == tiers' true contents", quiet and view() == expected,
              f"missing {len(expected - view())}, extra {len(view() - expected)}"
              + ("" if quiet else " (transfers still in flight after --settle-timeout "
                 f"{args.settle_timeout:g} s)")),
    ]
    return checks, summary


def _tier_reuse_check(args: argparse.Namespace, stats, workload: _FollowUps) -> Check:  # noqa: ANN001
    """Tiers must serve evicted prefixes when the run gave them the chance: a session's later
    turn handed out after the GPU pool had evicted a block. (A run of first turns only, e.g.
    ``--requests`` up to ``--sessions``, re-sends no history: nothing to serve.)"""
    name = "prefixes reused from tiers"
    reused = stats.host_hit_tokens + stats.disk_hit_tokens
    detail = f"host {stats.host_hit_tokens} + disk {stats.disk_hit_tokens} tokens"
    if "none" in args.tiers.split(","):
        return Check(name, True, "not exercised (--tiers none)")
    if workload.after_eviction == 0:
        return Check(name, True, "not exercised (no later turn came after the GPU pool "
                                 f"evicted a block); {detail}")
    return Check(name, reused > 0, f"{detail} ({workload.after_eviction} later turns after "
                                   "a GPU eviction)")


class _FollowUps:
    """The demo's workload, counting the requests that continue a session (a later turn,
    re-sending its history) handed out after the GPU pool first evicted a block: only those
    can find a prefix in a tier that the GPU no longer holds. Same interface as the workload
    it wraps (:func:`kvbm_plugin.testing.chat_workload.drive` calls it)."""

    def __init__(self, workload) -> None:  # noqa: ANN001
        self._workload = workload
        self._sessions: set[int] = set()
        self.engine = None  # set by run_demo once the engine is up
        self.after_eviction = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._workload, name)

    def next_request(self):  # noqa: ANN201
        request = self._workload.next_request()
        if request is None:
            return None
        if request.session in self._sessions and self._evicted():
            self.after_eviction += 1
        self._sessions.add(request.session)
        return request

    def _evicted(self) -> bool:
        sink = self.engine.leader.event_sink if self.engine is not None else None
        return sink is not None and sink.stats()["blocks_removed"] > 0


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
    parser = ArgumentParser(
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
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random chat workload (default 0)")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel ranks (default 2; 1 with --attention-dp)")
    parser.add_argument("--attention-dp", type=int, default=1, metavar="N",
                        help="attention-DP ranks, each its own process with its own leader, "
                             "tiers and consolidated output (default 1: none)")
    parser.add_argument("--layers", type=int, default=4,
                        help="transformer layers of the simulated KV cache (default 4)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per block (default %(default)s)")
    parser.add_argument("--gpu-blocks", type=int, default=64,
                        help="GPU pool size in blocks (default %(default)s)")
    parser.add_argument("--host-blocks", type=int, default=96,
                        help="host tier size in blocks (default %(default)s)")
    parser.add_argument("--disk-blocks", type=int, default=512,
                        help="disk tier size in blocks (default %(default)s)")
    parser.add_argument("--tiers", default=None,
                        help="offload tiers: host,disk | host | disk | none (default "
                             "host,disk; host with --engines 2)")
    parser.add_argument("--mode", choices=("dedup", "passthrough"), default=None,
                        help="consolidator mode (default dedup; passthrough with "
                             "--real-router llm-d, as README configures llm-d)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the simulated GPU pool lives: cpu, or cuda for a real "
                             "device with pinned host tier and side streams (default cpu)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="give up after this many seconds (default %(default)s; with "
                             "--duration: that long after it)")
    parser.add_argument("--settle-timeout", type=float, default=20.0,
                        help="seconds to wait for the subscriber to catch up at the end "
                             "(default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--real-router", nargs="?", const="dynamo", default=None,
                        choices=("dynamo", "llm-d"),
                        help="also ask a real router how many blocks each request matches, "
                             "as a client asks (its salt string, its adapter's name), and "
                             "report its agreement: dynamo (the default), NVIDIA Dynamo's own "
                             "KV indexer (pip install 'kvbm-plugin[interop]'; root, for its "
                             "private network namespace); llm-d, the model of llm-d's indexer "
                             "and scorer, the stream configured as README says for llm-d")
    parser.add_argument("--adapters", type=int, default=0, metavar="N",
                        help="sessions also use N LoRA adapters (task ids 0..N-1, named "
                             "adapter-<id> through DYN_KVBM_LORA_NAMES) besides the base "
                             "model (default 0)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="run TRT-LLM's plain executor loop instead of the overlap "
                             "scheduler (TRT-LLM's default)")
    parser.add_argument("--engines", type=int, choices=(1, 2), default=1,
                        help="2: two engines in processes of their own sharing a private "
                             "mooncake_master (the shared tier; needs '.[mooncake]'), turns "
                             "alternating between them (default 1)")
    parser.add_argument("--windows", default=None, metavar="FULL,SLIDING",
                        help="a sliding-window model: two attention windows in tokens (e.g. "
                             "4096,512), one KV layer group each (cli/demo_windows.py)")
    parser.add_argument("--processes", action="store_true",
                        help="run ranks 1.. in their own processes, completion reports over "
                             "ZMQ (needs --tp > 1)")
    live = parser.add_argument_group(
        "steady workload", "With --duration or --requests the demo runs a steady multi-tenant "
        "chat (sessions of 1..--turns turns come and go) instead of --turns waves, so a router "
        "or `kvbm-plugin subscribe --tree` can watch its endpoints (set "
        "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT etc. to serve on tcp).")
    live.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                      help="keep submitting for this many seconds")
    live.add_argument("--requests", type=int, default=None, metavar="N",
                      help="submit N requests")
    live.add_argument("--tenants", type=int, default=4,
                      help="tenants, each with its own system prompt (default 4)")
    live.add_argument("--max-context", type=int, default=512,
                      help="a session ends before its prompt would exceed this (default 512)")
    return parser


def _check_options(args: argparse.Namespace) -> None:
    """Every option the run would trip on later, as one UsageError naming the option."""
    # README configures llm-d with passthrough (it weighs each tier); dedup otherwise
    args.mode = args.mode or ("passthrough" if args.real_router == "llm-d" else "dedup")
    if args.attention_dp > 1 and args.tp not in (None, 1):
        raise UsageError(f"--attention-dp {args.attention_dp} runs one rank per process with "
                         f"TP 1 inside each (TensorRT-LLM's mapping), got --tp {args.tp}")
    if args.attention_dp > 1 and args.real_router:
        raise UsageError("--real-router is not available with --attention-dp")
    if args.windows is not None:
        from kvbm_plugin.cli.demo_windows import parse_windows

        parse_windows(args.windows, args.block_size)
        if args.engines == 2 or args.attention_dp > 1 or args.processes or args.real_router:
            raise UsageError("--windows runs one engine in this process: no --engines 2, "
                             "--attention-dp, --processes or --real-router")
    if args.engines == 2:
        from kvbm_plugin.cli.demo_engines import check_engines_options

        check_engines_options(args)
    args.tiers = args.tiers or ("host" if args.engines == 2 else "host,disk")
    if args.adapters < 0:
        raise UsageError(f"--adapters must be >= 0, got {args.adapters}")
    if args.adapters and (args.engines == 2 or args.attention_dp > 1
                          or args.windows is not None):
        raise UsageError(f"--adapters {args.adapters} runs on the one-engine demo: no "
                         "--engines 2, --attention-dp or --windows")
    if args.tp is None:
        args.tp = 1 if args.attention_dp > 1 else 2
    for name in ("sessions", "turns", "system_tokens", "user_tokens", "gen_tokens", "tp",
                 "attention_dp",
                 "layers", "block_size", "gpu_blocks", "host_blocks", "disk_blocks",
                 "tenants", "max_context"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    for name in ("timeout", "settle_timeout"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0 seconds, "
                             f"got {getattr(args, name)}")
    unknown = set(args.tiers.split(",")) - {"", "none", "host", "disk"}
    if unknown:
        raise UsageError(f"--tiers {args.tiers}: unknown tier(s) {sorted(unknown)}; use host, "
                         "disk or none")
    if args.requests is not None and args.requests < 1:
        raise UsageError(f"--requests must be >= 1, got {args.requests}")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration must be > 0 seconds, got {args.duration}")
    steady = args.duration is not None or args.requests is not None
    if steady and args.max_context < args.system_tokens + args.user_tokens + args.gen_tokens:
        raise UsageError(f"--max-context {args.max_context} is shorter than one turn "
                         f"(--system-tokens + --user-tokens + --gen-tokens = "
                         f"{args.system_tokens + args.user_tokens + args.gen_tokens})")
    # The last turn of the longest session re-sends its whole history (a steady chat ends a
    # session before --max-context): the GPU pool must hold that request (as TRT-LLM would
    # refuse one that can never fit).
    longest = args.max_context if steady else _workload(args).longest_request()
    needed = -(-longest // args.block_size)
    if needed > args.gpu_blocks:
        raise UsageError(f"--gpu-blocks {args.gpu_blocks} is too small: the longest request "
                         f"({longest} tokens, the last turn of a chat) needs {needed} blocks "
                         f"of --block-size {args.block_size}; raise --gpu-blocks to at least "
                         f"{needed} or shorten the chats (--turns, --system-tokens, "
                         "--user-tokens, --gen-tokens"
                         + (", --max-context)" if steady else ")"))
    if args.processes and args.tp < 2:
        raise UsageError(f"--processes needs --tp > 1, got --tp {args.tp}")
    cc.compiled_loops_enabled()  # DYN_KVBM_NATIVE, read by the event sink and the consolidator


def main_demo(argv: Sequence[str] | None = None) -> int:
    """``kvbm-plugin demo``. Bad options raise UsageError, a bad DYN_KVBM_* value ConfigError
    (one line and exit status 2 through :func:`kvbm_plugin.cli.main.main`); SIGTERM and Ctrl-C end
    the run through its clean-up."""
    args = build_parser().parse_args(argv)
    _check_options(args)
    with _signals_end_the_demo():
        _load_engine_modules()
        if args.windows is not None:
            from kvbm_plugin.cli.demo_windows import run_windows_demo

            return run_windows_demo(args, _print_summary, Check)
        if args.engines == 2:
            from kvbm_plugin.cli.demo_engines import run_engines_demo

            _quiet_rank_processes()
            return run_engines_demo(args, _print_summary, Check)
        return run_demo(args)
