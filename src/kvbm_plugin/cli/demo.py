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

This module runs the demo (:func:`main_demo`, on the CLI's main thread); its options are in
:mod:`~kvbm_plugin.cli.demo_options`, those checks in :mod:`~kvbm_plugin.cli.demo_checks`,
the progress bar and the summary in :mod:`~kvbm_plugin.cli.demo_report`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence

import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.demo_checks import (
    ROUTER_AGREEMENT_TARGET,
    Check,
    ErrorWatch,
    FollowUps,
    failure_check,
    router_report,
    settle_and_check,
)
from kvbm_plugin.cli.demo_options import build_parser, check_options, workload_for
from kvbm_plugin.cli.demo_report import Progress, print_summary
from kvbm_plugin.cli.demo_signals import SIGNALS as _SIGNALS
from kvbm_plugin.cli.demo_signals import STDOUT
from kvbm_plugin.cli.demo_signals import load_engine_modules as _load_engine_modules
from kvbm_plugin.cli.demo_signals import signals_end_the_demo as _signals_end_the_demo
from kvbm_plugin.cli.main import CommandFailed, UsageError


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
    tiers = set(args.tiers.split(",")) - {"", "none"}  # checked by check_options
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
    workload = FollowUps(workload_for(args))
    steady = args.duration is not None or args.requests is not None
    total = args.requests or (0 if steady else args.sessions * args.turns)
    started = time.monotonic()
    watch = ErrorWatch()
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
        progress = Progress(total, enabled=not args.no_progress)

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
                checks, summary = settle_and_check(engine, subscriber, args, workload)
            router_checks, router_summary = router_report(result, probe)
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
        checks.append(failure_check(engine, watch))  # after shutdown: its errors count too
    print_summary(summary, checks, time.monotonic() - started)
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


def main_demo(argv: Sequence[str] | None = None) -> int:
    """``kvbm-plugin demo``. Bad options raise UsageError, a bad DYN_KVBM_* value ConfigError
    (one line and exit status 2 through :func:`kvbm_plugin.cli.main.main`); SIGTERM and Ctrl-C end
    the run through its clean-up."""
    args = build_parser().parse_args(argv)
    check_options(args)
    with _signals_end_the_demo():
        _load_engine_modules()
        if args.windows is not None:
            from kvbm_plugin.cli.demo_windows import run_windows_demo

            return run_windows_demo(args, print_summary, Check)
        if args.engines == 2:
            from kvbm_plugin.cli.demo_engines import run_engines_demo

            _quiet_rank_processes()
            return run_engines_demo(args, print_summary, Check)
        return run_demo(args)
