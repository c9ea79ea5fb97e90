"""Sidecar: drain ``trtllm-serve``'s ``POST /kv_cache_events`` into per-rank GPU-tier publishers.

For deployments where the plugin cannot run inside the executor (or as a cross-check): each
``POST {url}/kv_cache_events`` returns, as a JSON list, the buffered event dicts TRT-LLM
collected since the previous call (and clears them). The sidecar feeds them to a
:class:`~kvbm_plugin.event_sink.KvEventSink`, which routes each event by ``attention_dp_rank``
to that rank's publisher (bound at ``ConsolidatorConfig.publish_endpoint(rank)``), and flushes
one batch per rank per poll. Stdlib HTTP only (urllib). Exposed on the CLI as
``kvbm-plugin sidecar``.
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import zmq

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin._util.saferepr import saferepr
from kvbm_plugin.consolidator_config import (
    ConfigError,
    ConsolidatorConfig,
    Endpoint,
    PublisherSettings,
    load_consolidator_config,
)
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.wire.publisher import EventPublisher, create_publisher

logger = logging.getLogger(__name__)

PublisherFactory = Callable[[PublisherSettings, Endpoint, "Endpoint | None", int],
                            EventPublisher]


class Unparsable:
    """Stands in for one element of the event list that could not be parsed (see
    :func:`parse_event_list`); :func:`check_event` reports it as malformed."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


# Limits of one event from /kv_cache_events (TRT-LLM's are a few levels deep, 64-bit numbers).
MAX_EVENT_DEPTH = 16
_INT_MIN, _INT_END = -(1 << 63), 1 << 64


def fetch_events(url: str, *, timeout: float = 5.0) -> list[Any]:
    """One ``POST {url}/kv_cache_events``; the decoded list (see :func:`parse_event_list`).

    Raises on HTTP errors, and ValueError when the body is not a JSON list.
    """
    request = urllib.request.Request(url.rstrip("/") + "/kv_cache_events", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
        body = response.read()
    return parse_event_list(body, url)


def parse_event_list(body: bytes, url: str = "") -> list[Any]:
    """The JSON list of events in ``body``; an element too deeply nested for the JSON parser
    is returned as an :class:`Unparsable`, so the other events still count.

    Raises ValueError when the body is not JSON or not a list.
    """
    try:
        events = json.loads(body or b"[]")
    except RecursionError:
        events = _parse_elements(body.decode("utf-8", "replace"))
        if events is None:
            raise ValueError(f"{url}/kv_cache_events returned nested JSON that is not a "
                             f"list: {saferepr(body[:200])}") from None
    if not isinstance(events, list):
        raise ValueError(f"{url}/kv_cache_events returned {type(events).__name__}, not a list: "
                         f"{saferepr(body[:200])}")
    return events


def _parse_elements(text: str) -> list[Any] | None:
    """Each top-level element of the JSON array ``text`` parsed on its own (an element that
    fails becomes an Unparsable); None when ``text`` is not an array. Only used when the
    whole document is too deep for ``json.loads``: a plain scan, O(len(text))."""
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):
        return None
    out: list[Any] = []
    depth = 0
    begin = -1
    in_string = escaped = False
    for index in range(start + 1, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char in " \t\r\n":
            continue
        if begin < 0 and char not in ",]":
            begin = index
        if char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}" and depth > 0:
            depth -= 1
        elif depth == 0 and char in ",]":
            if begin >= 0:
                out.append(_parse_one(text[begin:index]))
            begin = -1
            if char == "]":
                return out
    return None


def _parse_one(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        return Unparsable(f"{type(exc).__name__}: {saferepr(str(exc), 100)}")


def check_event(event: Any) -> str | None:
    """Why ``event`` (one element of the list) cannot be published, or None if it can.

    An event must be a JSON object with a ``data`` object naming its ``type`` (TensorRT-LLM's
    event form), nested at most MAX_EVENT_DEPTH levels, whose integers are all 64-bit (signed
    or unsigned: hashes are u64; the sink checks token ids more narrowly). Called on the
    sidecar's thread for every event before it reaches the sink; iterative, O(size).
    """
    if isinstance(event, Unparsable):
        return event.reason
    if not isinstance(event, dict):
        return f"event is not an object: {saferepr(event, 100)}"
    data = event.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        return f"event has no data object with a type: {saferepr(event, 100)}"
    stack: list[tuple[Any, int]] = [(event, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not _INT_MIN <= value < _INT_END:
                return f"integer {saferepr(value, 60)} does not fit 64 bits"
        elif isinstance(value, (dict, list)):
            if depth > MAX_EVENT_DEPTH:
                return f"nested deeper than {MAX_EVENT_DEPTH} levels"
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
    return None


def build_sink(config: ConsolidatorConfig, *, block_size: int,
               publisher_factory: PublisherFactory | None = None) -> KvEventSink:
    """One publisher per rank (``config.num_ranks``) behind one sink that routes by rank."""
    factory = publisher_factory or create_publisher
    publishers: dict[int, EventPublisher] = {}
    try:
        for rank in range(config.num_ranks):
            publishers[rank] = factory(config.publisher, config.publish_endpoint(rank),
                                       config.replay_endpoint(rank), rank)
    except BaseException:
        for pub in publishers.values():
            pub.shutdown(1.0)
        raise
    return KvEventSink(publishers[0], block_size=block_size,
                       window_size=config.publisher.window_size, data_parallel_rank=0,
                       rank_publishers=publishers, prefix_closed=True)


# HTTP statuses that no retry can change: the server does not offer POST /kv_cache_events
# (or refuses us for good). Others (5xx but 501/505, 408, 429) and connection errors are
# retried: a server that is starting or restarting answers them for a while.
PERMANENT_HTTP_STATUSES = frozenset({400, 401, 403, 404, 405, 410, 501, 505})


class SidecarGaveUp(Exception):
    """``POST {url}/kv_cache_events`` can never succeed: raised by :func:`run_sidecar`."""


def check_url(url: str) -> str | None:
    """Why ``url`` can never be polled (not http(s)://host[:port]), or None."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--url {url!r} is not an http:// or https:// URL with a host"
    try:
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        return f"--url {url!r}: {exc}"
    return None


def _permanent(exc: Exception) -> str | None:
    """Why the failed poll ``exc`` will fail the same way every time, or None."""
    if isinstance(exc, urllib.error.HTTPError) and exc.code in PERMANENT_HTTP_STATUSES:
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, ValueError) and not isinstance(exc, http.client.HTTPException) \
            and str(exc).startswith("unknown url type"):
        return str(exc)
    return None


class Stop(Protocol):
    """What ends :func:`run_sidecar`'s loop: a ``threading.Event`` (another thread sets it),
    or the CLI's ``SignalStop`` (a signal; main thread)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


def run_sidecar(url: str, config: ConsolidatorConfig, *, block_size: int,
                interval: float = 0.1, stop_event: Stop,
                publisher_factory: PublisherFactory | None = None,
                http_timeout: float = 5.0) -> dict[str, int]:
    """Poll ``url`` every ``interval`` s until ``stop_event`` is set; returns the final stats.

    Runs on the calling thread. Each poll: fetch, ingest (events with an ``attention_dp_rank``
    outside ``0..num_ranks-1`` are counted and logged, not published), one flush. HTTP errors
    are counted (``poll_errors``) and retried at the next interval, except those no retry can
    change (:data:`PERMANENT_HTTP_STATUSES`, a URL of an unknown type): SidecarGaveUp names it.
    Publishers are shut down on return.
    """
    if interval <= 0:
        raise ConfigError(f"sidecar interval={interval!r} must be > 0 seconds")
    sink = build_sink(config, block_size=block_size, publisher_factory=publisher_factory)
    log = RateLimitedLog(logger)
    polls = errors = foreign = malformed = 0
    try:
        while not stop_event.is_set():
            started = time.monotonic()
            try:
                events = fetch_events(url, timeout=http_timeout)
            except (OSError, ValueError, http.client.HTTPException) as exc:
                # HTTPException: e.g. IncompleteRead, a response cut short (not an OSError).
                errors += 1
                why = _permanent(exc)
                if why is not None:
                    raise SidecarGaveUp(f"POST {url}/kv_cache_events answered {why}; no "
                                        "retry can change that (is --url trtllm-serve's base "
                                        "URL?)") from exc
                log.log(logging.WARNING, "poll", "sidecar: POST %s/kv_cache_events failed: %s",
                        url, exc)
                events = []
            polls += 1
            if events:
                keep = []
                for ev in events:
                    problem = check_event(ev)
                    if problem is not None:
                        # One bad event is dropped alone; the rest of the poll goes on.
                        malformed += 1
                        log.log(logging.WARNING, "malformed", "sidecar: malformed event from "
                                "%s/kv_cache_events dropped: %s", url, problem)
                        continue
                    rank = ev.get("attention_dp_rank", 0)
                    if isinstance(rank, int) and not 0 <= rank < config.num_ranks:
                        foreign += 1
                        log.log(logging.ERROR, "rank", "sidecar: event for attention_dp_rank "
                                "%r but --num-ranks is %d; not published", rank,
                                config.num_ranks)
                        continue
                    keep.append(ev)
                sink.ingest(keep)
            sink.flush()
            stop_event.wait(max(0.0, interval - (time.monotonic() - started)))
    finally:
        sink.shutdown()
    stats = sink.stats()
    stats.update(polls=polls, poll_errors=errors, events_outside_ranks=foreign,
                 events_malformed=malformed)
    return stats


def main_sidecar(argv: Sequence[str] | None = None) -> int:
    """``kvbm-plugin sidecar``: argparse front end of :func:`run_sidecar` (env from DYN_KVBM_*).

    A bad option or variable (a URL that is not http(s)://host) is one line on stderr and exit
    status 2; publishers that cannot bind (a busy port) or a URL that answers what no retry can
    change (HTTP 404, 501, ...) one line and status 1; SIGINT 130, SIGTERM 143.
    """
    from kvbm_plugin.cli.main import EXIT_FAILED, EXIT_USAGE, ArgumentParser, SignalStop
    from kvbm_plugin.consolidator_config import compiled_loops_enabled

    parser = ArgumentParser(
        prog="kvbm-plugin sidecar",
        description="Drain trtllm-serve's POST /kv_cache_events and publish per-rank GPU-tier "
                    "KV events (endpoints and publisher settings from the DYN_KVBM_* env).")
    parser.add_argument("--url", required=True, help="trtllm-serve base URL, e.g. "
                        "http://127.0.0.1:8000")
    parser.add_argument("--interval", type=float, default=0.1,
                        help="seconds between polls (> 0; default 0.1)")
    parser.add_argument("--block-size", type=int, required=True,
                        help="tokens per KV block (the engine's tokens_per_block)")
    parser.add_argument("--num-ranks", type=int, default=1,
                        help="attention-DP ranks (one publisher each, base port + rank)")
    args = parser.parse_args(argv)
    if args.block_size <= 0:
        parser.error(f"argument --block-size: {args.block_size} must be > 0")
    if not args.interval > 0 or args.interval == float("inf"):
        parser.error(f"argument --interval: {args.interval} must be a number of seconds > 0")
    if args.num_ranks < 1:
        parser.error(f"argument --num-ranks: {args.num_ranks} must be >= 1")
    bad_url = check_url(args.url)
    if bad_url is not None:
        parser.error(bad_url)
    try:
        compiled_loops_enabled()  # read by the event sink's loops
        config = load_consolidator_config(num_ranks=args.num_ranks, require_gpu_events=True)
    except ConfigError as exc:
        print(f"kvbm-plugin sidecar: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = SignalStop().install()
    try:
        stats = run_sidecar(args.url, config, block_size=args.block_size,
                            interval=args.interval, stop_event=stop)
    except SidecarGaveUp as exc:
        print(f"kvbm-plugin sidecar: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (ConfigError, zmq.ZMQError, OSError) as exc:
        # At start-up only (the poll loop counts its errors): a publisher that cannot bind.
        print(f"kvbm-plugin sidecar: cannot start the GPU-tier publishers (endpoints from "
              f"{config.publish_endpoint(0).source}): {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        stop.restore()
    logger.info("sidecar stopped: %s", stats)
    return stop.status
