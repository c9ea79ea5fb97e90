"""``kvbm-plugin consolidate``: the consolidator as a standalone process.

Called by :mod:`kvbm_plugin.tools.cli` on the main thread, which then only waits for a signal;
the consolidator's own threads do the socket I/O.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import zmq

from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    CONSOLIDATOR_MODE,
    ENABLE_CONSOLIDATOR,
    EVENTS_ENDPOINT,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    REPLAY_ENDPOINT,
    ConfigError,
    consolidator_enabled,
    load_consolidator_config,
    native_enabled,
)
from kvbm_plugin.tools.cli import ArgumentParser

logger = logging.getLogger("kvbm_plugin.consolidator.service")


def main_consolidate(argv: list[str] | None = None) -> int:
    """``kvbm-plugin consolidate``: run the consolidator until SIGINT/SIGTERM.

    Reads the DYN_KVBM_* variables like the leader does, each validated before anything starts
    (the consolidator switch too, though asking for the command runs it whatever its value);
    the options override them. Runs in the foreground on the main thread (which only waits for
    a signal).
    """
    parser = ArgumentParser(
        prog="kvbm-plugin consolidate",
        description="De-duplicate the per-rank GPU-tier KV-event streams into one stream.")
    parser.add_argument("--num-ranks", type=int, default=1,
                        help="number of GPU-tier publishers (attention-DP ranks); default 1")
    parser.add_argument("--mode", choices=("dedup", "passthrough"),
                        help="override DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE")
    parser.add_argument("--events-endpoint", help=f"override {EVENTS_ENDPOINT} (rank 0's)")
    parser.add_argument("--replay-endpoint", help=f"override {REPLAY_ENDPOINT} (rank 0's)")
    parser.add_argument("--output-endpoint", help=f"override {OUTPUT_ENDPOINT}")
    parser.add_argument("--output-replay-endpoint", help=f"override {OUTPUT_REPLAY_ENDPOINT}")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="log level (default INFO)")
    args = parser.parse_args(argv)
    if args.num_ranks < 1:
        parser.error(f"argument --num-ranks: {args.num_ranks} must be >= 1")
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = dict(os.environ)
    for value, name in ((args.mode, CONSOLIDATOR_MODE), (args.events_endpoint, EVENTS_ENDPOINT),
                        (args.replay_endpoint, REPLAY_ENDPOINT),
                        (args.output_endpoint, OUTPUT_ENDPOINT),
                        (args.output_replay_endpoint, OUTPUT_REPLAY_ENDPOINT)):
        if value is not None:
            env[name] = value
    try:
        consolidator_enabled(env)  # validated, then overridden: the command always runs it
        native_enabled(env)  # read by the core's loops
        env[ENABLE_CONSOLIDATOR] = "true"
        config = load_consolidator_config(env, num_ranks=args.num_ranks,
                                          require_gpu_events=True)
    except ConfigError as exc:
        print(f"kvbm-plugin consolidate: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    consolidator = KvEventConsolidator(config)
    try:
        consolidator.start()
    except (zmq.ZMQError, ConfigError, OSError) as exc:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print(f"kvbm-plugin consolidate: cannot start: {exc}", file=sys.stderr)
        return 1
    inputs = ", ".join(config.publish_endpoint(r).connect for r in range(config.num_ranks))
    logger.info("KV event consolidator started (%s): %s -> %s", config.mode, inputs,
                config.output.bind)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        consolidator.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("KV event consolidator stopped: %s", consolidator.stats())
    return 0
