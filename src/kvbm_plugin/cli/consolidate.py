"""``kvbm-plugin consolidate``: the consolidator as a standalone process.

Called by :mod:`kvbm_plugin.cli.main` on the main thread, which then only waits for a signal;
the consolidator's own threads do the socket I/O.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import zmq

from kvbm_plugin.cli.doctor import read_llm_api_options
from kvbm_plugin.cli.main import EXIT_FAILED, EXIT_USAGE, ArgumentParser, SignalStop
from kvbm_plugin.consolidator.engine_forms import EngineForms
from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import (
    CONSOLIDATOR_MODE,
    ENABLE_CONSOLIDATOR,
    EVENTS_ENDPOINT,
    LEADER_ZMQ_HOST,
    OUTPUT_ENDPOINT,
    OUTPUT_REPLAY_ENDPOINT,
    REPLAY_ENDPOINT,
    ConfigError,
    compiled_loops_enabled,
    consolidator_enabled,
    load_consolidator_config,
    parse_endpoint,
)
from kvbm_plugin.events.trtllm_publisher import read_trtllm_publisher, trtllm_streams

logger = logging.getLogger("kvbm_plugin.consolidator.service")


def main_consolidate(argv: list[str] | None = None) -> int:
    """``kvbm-plugin consolidate``: run the consolidator until SIGINT/SIGTERM (exit status 130
    and 143: see :func:`kvbm_plugin.cli.main.main` for every status).

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
    parser.add_argument("--llm-api-options", metavar="PATH",
                        help="the engine's LLM-API options (YAML/JSON): where its "
                             "kv_cache_config.kv_events_config turns TensorRT-LLM's own "
                             "publisher on, subscribe to that publisher's per-rank endpoints")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                        help="log level (default INFO)")
    args = parser.parse_args(argv)
    if args.num_ranks < 1:
        parser.error(f"argument --num-ranks: {args.num_ranks} must be >= 1")
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = dict(os.environ)
    if args.mode is not None:
        env[CONSOLIDATOR_MODE] = args.mode
    for value, name, option in (
            (args.events_endpoint, EVENTS_ENDPOINT, "--events-endpoint"),
            (args.replay_endpoint, REPLAY_ENDPOINT, "--replay-endpoint"),
            (args.output_endpoint, OUTPUT_ENDPOINT, "--output-endpoint"),
            (args.output_replay_endpoint, OUTPUT_REPLAY_ENDPOINT, "--output-replay-endpoint")):
        if value is not None:
            try:  # a bad option is named as the option, not as the variable it overrides
                parse_endpoint(option, value, default_host="127.0.0.1")
            except ConfigError as exc:
                parser.error(str(exc))
            env[name] = value
    try:
        consolidator_enabled(env)  # validated, then overridden: the command always runs it
        compiled_loops_enabled(env)  # read by the core's loops
        env[ENABLE_CONSOLIDATOR] = "true"
        streams: tuple[Any, ...] = ()
        if args.llm_api_options is not None:
            engine_pub = read_trtllm_publisher(read_llm_api_options(args.llm_api_options))
            host = (env.get(LEADER_ZMQ_HOST) or "127.0.0.1").strip()
            streams = tuple(s for r in range(args.num_ranks)
                            for s in trtllm_streams(engine_pub, r, host))
        config = load_consolidator_config(env, num_ranks=args.num_ranks,
                                          require_gpu_events=not streams, gpu_streams=streams)
    except ConfigError as exc:
        print(f"kvbm-plugin consolidate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    stop = SignalStop().install()
    consolidator = KvEventConsolidator(config)
    forms = EngineForms() if streams else None  # TensorRT-LLM's own stream, in any form
    consolidator.engine_forms = forms
    try:
        consolidator.start()
    except (zmq.ZMQError, ConfigError, OSError) as exc:
        stop.restore()
        print(f"kvbm-plugin consolidate: cannot start: {exc}", file=sys.stderr)
        return EXIT_FAILED
    inputs = ", ".join(config.stream_endpoint(r).connect for r in config.stream_ranks())
    logger.info("KV event consolidator started (%s): %s -> %s", config.mode, inputs,
                config.output.bind)
    try:
        while not stop.wait():
            pass
    finally:
        consolidator.shutdown()
        stop.restore()
        logger.info("KV event consolidator stopped: %s", {
            **consolidator.stats(), **(forms.stats() if forms is not None else {})})
    return stop.status
