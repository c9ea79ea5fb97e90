"""``kvbm-plugin demo``'s options: the parser, their checks and the chat workload they describe.

:func:`build_parser` and :func:`check_options` run on the CLI's main thread before anything
starts (a bad option is one UsageError naming it, exit status 2); :func:`workload_for` builds
the chat workload the options describe, for the run and for the check that the GPU pool can
hold the longest request.
"""

from __future__ import annotations

import argparse

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.main import ArgumentParser, UsageError

# The demo's tenants: sessions alternate between them (cache salts).
TENANTS = ("tenant-a", "tenant-b")


def workload_for(args: argparse.Namespace):  # noqa: ANN202
    """Turn waves by default; a steady multi-tenant chat with --duration or --requests."""
    from kvbm_plugin.testing.chat_workload import SteadyChat, TurnWaves

    if args.duration is None and args.requests is None:
        # Sessions alternate between two tenants sharing the system prompt; their cache salts
        # keep each tenant's blocks (GPU, host, disk) to itself.
        return TurnWaves(sessions=args.sessions, turns=args.turns,
                         system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                         gen_tokens=args.gen_tokens, seed=args.seed, salts=TENANTS,
                         adapters=args.adapters)
    return SteadyChat(tenants=args.tenants, sessions=args.sessions, max_turns=args.turns,
                      system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                      gen_tokens=args.gen_tokens, max_context=args.max_context, seed=args.seed,
                      adapters=args.adapters)


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


def check_options(args: argparse.Namespace) -> None:
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
    longest = args.max_context if steady else workload_for(args).longest_request()
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
