"""``kvbm-plugin subscribe``: print a KV-event stream live, or the router's tree (``--tree``).

Called by :mod:`kvbm_plugin.tools.cli` on the main thread; the subscriber's own thread
(:class:`kvbm_plugin.wire.subscriber.StreamSubscriber`) does the socket I/O.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence

from kvbm_plugin.consolidator_config import ConfigError, parse_endpoint
from kvbm_plugin.wire.subscriber import StreamSubscriber, as_json, describe


def main_subscribe(argv: Sequence[str] | None = None) -> int:
    from kvbm_plugin.tools.cli import ArgumentParser  # one-line usage errors, like every command

    parser = ArgumentParser(
        prog="kvbm-plugin subscribe",
        description="Print a live KV-event stream, with gap detection and optional replay.")
    parser.add_argument("endpoint", help="tcp://host:port, ipc://path or a port on localhost")
    parser.add_argument("--replay", metavar="ENDPOINT", help="replay ROUTER to fill gaps")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per batch (strict JSON: NaN and Infinity are "
                             "written as null)")
    parser.add_argument("--from-seq", type=int, default=None,
                        help="expect the stream from this seq (replays what came before)")
    parser.add_argument("--count", type=int, default=0, help="exit after N batches (0 = never)")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="exit after this many seconds (0 = never)")
    _add_tree_arguments(parser)
    args = parser.parse_args(argv)
    if args.tree:
        return _run_tree(parser, args)
    endpoint, replay = _endpoints(parser, args)
    stop = _stop_on_signals()
    subscriber = StreamSubscriber(endpoint, replay, topic=args.topic.encode(),
                                  start_seq=args.from_seq)
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
    reported_gaps = reported_malformed = reported_restarts = 0
    try:
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            for batch in subscriber.poll(100):
                if args.json:
                    print(as_json(batch), flush=True)
                else:
                    for line in describe(batch):
                        print(line, flush=True)
                if args.count and subscriber.stats.batches >= args.count:
                    stop.set()
            stats = subscriber.stats
            if stats.malformed != reported_malformed:
                reported_malformed = stats.malformed
                print(f"# malformed message dropped ({stats.malformed} so far): "
                      f"{subscriber.last_malformed}", file=sys.stderr, flush=True)
            if stats.restarts != reported_restarts:
                reported_restarts = stats.restarts
                print(f"# publisher restarted ({stats.restarts} so far): view cleared, new "
                      "stream followed from its start", file=sys.stderr, flush=True)
            if subscriber.stats.gaps != reported_gaps:
                reported_gaps = subscriber.stats.gaps
                print(f"# gap detected: {subscriber.stats.missing_batches} batches missing so "
                      f"far ({subscriber.stats.replayed_batches} replayed)", file=sys.stderr,
                      flush=True)
    finally:
        subscriber.close()
    print(f"# {subscriber.stats}", file=sys.stderr)
    return 0


def _add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tree", action="store_true",
                        help="keep a strict router's radix trees of the stream and print their "
                             "summary and rule counts (periodically and at exit) instead of "
                             "the events")
    parser.add_argument("--block-size", type=int, default=None,
                        help="--tree: the router's block size (default: the first store's)")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="--tree: seconds between summaries (default 5)")


def _run_tree(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``subscribe --tree``: a :class:`~kvbm_plugin.tools.router_view.TreeSubscriber` on the stream,
    its summary printed every ``--interval`` seconds and at exit."""
    from kvbm_plugin.tools.router_view import LazyTreeSubscriber

    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    endpoint, replay = _endpoints(parser, args)
    stop = _stop_on_signals()
    subscriber = LazyTreeSubscriber(endpoint, replay, topic=args.topic.encode(),
                                    start_seq=args.from_seq, block_size=args.block_size)
    now = time.monotonic()
    deadline = now + args.duration if args.duration > 0 else None
    next_summary = now + args.interval

    def summary(final: bool) -> None:
        head = "final" if final else time.strftime("%H:%M:%S")
        print(f"# {head}: {subscriber.stats.batches} batches, {subscriber.stats.gaps} gaps",
              flush=True)
        for line in subscriber.summary_lines():
            print(f"  {line}", flush=True)

    try:
        while not stop.is_set():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if now >= next_summary:
                summary(False)
                next_summary = now + args.interval
            subscriber.poll(100)
            if args.count and subscriber.stats.batches >= args.count:
                break
    finally:
        subscriber.close()
    summary(True)
    return 0


__all__ = ["main_subscribe"]


def _endpoints(parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> tuple[str, str | None]:
    """The stream's and the replay socket's connect addresses; a bad one is a usage error."""
    try:
        endpoint = parse_endpoint("endpoint", args.endpoint, default_host="127.0.0.1").connect
        replay = (None if args.replay is None else
                  parse_endpoint("--replay", args.replay, default_host="127.0.0.1").connect)
    except ConfigError as exc:
        parser.error(str(exc))
    return endpoint, replay


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT or SIGTERM sets, so the loop ends and closes its sockets."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop
