"""``kvbm-plugin subscribe``: print a KV-event stream live, or the router's tree (``--tree``).

Called by :mod:`kvbm_plugin.cli.main` on the main thread; the subscriber's own thread
(:class:`kvbm_plugin.wire.subscriber.StreamSubscriber`) does the socket I/O.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from kvbm_plugin.consolidator_config import ConfigError, parse_endpoint
from kvbm_plugin.wire.subscriber import StreamSubscriber, SubscriberStats, as_json, describe

# Seconds without a handshake before the subscriber says that nothing answers at the endpoint.
NOTHING_THERE_S = 3.0


class _Notes:
    """What the subscriber tells the user on stderr, once each: nothing answering at the
    endpoint, the connection made, a late join (where the stream was joined and whether its
    history is there), malformed messages, restarts and gaps as they come."""

    def __init__(self, args: argparse.Namespace, endpoint: str,
                 subscriber: StreamSubscriber) -> None:
        self.args = args
        self.endpoint = endpoint
        self.subscriber = subscriber
        self.started = time.monotonic()
        self.said_nothing_there = self.said_connected = self.said_join = False
        self.gaps = self.malformed = self.restarts = 0

    def update(self) -> None:
        sub, stats = self.subscriber, self.subscriber.stats
        if not sub.connected and not self.said_nothing_there \
                and time.monotonic() - self.started >= NOTHING_THERE_S:
            self.said_nothing_there = True
            _note(f"nothing answers at {self.endpoint} after {NOTHING_THERE_S:.0f} s (no "
                  "publisher bound there yet?); still waiting")
        if sub.connected and self.said_nothing_there and not self.said_connected:
            self.said_connected = True
            _note(f"connected to {self.endpoint}")
        if stats.joined_at_seq is not None and not self.said_join:
            self.said_join = True
            line = join_note(stats, self.args.replay)
            if line:
                _note(line)
        if stats.malformed != self.malformed:
            self.malformed = stats.malformed
            _note(f"malformed message dropped ({stats.malformed} so far): "
                  f"{sub.last_malformed}")
        if stats.restarts != self.restarts:
            self.restarts = stats.restarts
            _note(f"publisher restarted ({stats.restarts} so far): view cleared, new stream "
                  "followed from its start")
        if stats.gaps != self.gaps:
            self.gaps = stats.gaps
            _note(f"gap detected: {stats.missing_batches} batches missing so far "
                  f"({stats.replayed_batches} replayed)")


def join_note(stats: SubscriberStats, replay: str | None) -> str | None:
    """Where the subscriber joined the stream and what of the history before is missing, in
    words (None when nothing is). A late join is not a broken stream: blocks stored before it
    are unknown, so their children and removals cannot be matched, and the way to get that
    history is the replay endpoint."""
    if not stats.history_missing:
        return None
    head = (f"joined the stream at seq {stats.joined_at_seq}: the {stats.history_missing} "
            "batches before it are not here, so blocks stored earlier are unknown (stores on "
            "them and their removals cannot be matched; that is the late join, not a fault "
            "of the stream)")
    if replay is None:
        return head + "; to get the history, pass --replay ENDPOINT --from-seq 0"
    return head + f"; the replay endpoint {replay} no longer holds them"


def _note(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.count < 0:
        parser.error(f"argument --count: {args.count} must be >= 0 (0 = never stop)")
    if args.from_seq is not None and args.from_seq < 0:
        parser.error(f"argument --from-seq: {args.from_seq} must be >= 0")
    if not args.duration >= 0 or args.duration == float("inf"):
        parser.error(f"argument --duration: {args.duration} must be a number of seconds >= 0")
    if args.tree and args.json:
        parser.error("argument --json: not allowed with --tree (--tree prints the router's "
                     "summary, not the events)")
    if args.from_seq is not None and args.replay is None:
        parser.error(f"argument --from-seq {args.from_seq}: needs --replay ENDPOINT (the "
                     "batches before the join come from the replay endpoint)")


def main_subscribe(argv: Sequence[str] | None = None) -> int:
    """``kvbm-plugin subscribe``: exit status 0 after --count or --duration, 130 on Ctrl-C,
    143 on SIGTERM, 2 for a bad option (see :func:`kvbm_plugin.cli.main.main`)."""
    from kvbm_plugin.cli.main import ArgumentParser  # one-line usage errors, like every command

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
                        help="expect the stream from this seq (replays what came before; "
                             "needs --replay)")
    parser.add_argument("--count", type=int, default=0, help="exit after N batches (0 = never)")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="exit after this many seconds (0 = never)")
    _add_tree_arguments(parser)
    args = parser.parse_args(argv)
    _check_arguments(parser, args)
    if args.tree:
        return _run_tree(parser, args)
    endpoint, replay = _endpoints(parser, args)
    from kvbm_plugin.cli.main import SignalStop

    stop = SignalStop().install()
    subscriber = StreamSubscriber(endpoint, replay, topic=args.topic.encode(),
                                  start_seq=args.from_seq)
    notes = _Notes(args, endpoint, subscriber)
    deadline = time.monotonic() + args.duration if args.duration > 0 else None
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
            notes.update()
    finally:
        subscriber.close()
        stop.restore()
    print(f"# {subscriber.stats}", file=sys.stderr)
    return stop.status


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
    """``subscribe --tree``: a :class:`~kvbm_plugin.routers.router_view.TreeSubscriber` on the
    stream, its summary printed every ``--interval`` seconds and at exit."""
    from kvbm_plugin.routers.router_view import LazyTreeSubscriber

    if args.block_size is not None and args.block_size < 1:
        parser.error(f"--block-size must be >= 1, got {args.block_size}")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    endpoint, replay = _endpoints(parser, args)
    from kvbm_plugin.cli.main import SignalStop

    stop = SignalStop().install()
    subscriber = LazyTreeSubscriber(endpoint, replay, topic=args.topic.encode(),
                                    start_seq=args.from_seq, block_size=args.block_size)
    notes = _Notes(args, endpoint, subscriber)
    now = time.monotonic()
    deadline = now + args.duration if args.duration > 0 else None
    next_summary = now + args.interval

    def summary(final: bool) -> None:
        head = "final" if final else time.strftime("%H:%M:%S")
        stats = subscriber.stats
        print(f"# {head}: {stats.batches} batches, {stats.gaps} gaps", flush=True)
        if stats.history_missing:
            print(f"  {join_note(stats, args.replay)}", flush=True)
        for line in subscriber.summary_lines():
            if stats.history_missing and line.startswith("rule warnings:"):
                # What a late join leaves unmatched is counted by the same rules; say so
                # rather than show them as the stream's faults.
                line += (" (these include what the late join left unmatched: not faults of "
                         "the stream, see above)")
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
            notes.update()
            if args.count and subscriber.stats.batches >= args.count:
                break
    finally:
        subscriber.close()
        stop.restore()
    summary(True)
    return stop.status


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
