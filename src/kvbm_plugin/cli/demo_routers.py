"""``kvbm-plugin demo --real-router dynamo|llm-d``: a real router's reading of the demo's stream.

Who calls it: :func:`kvbm_plugin.cli.demo.run_demo`, on the demo's main thread, once before the
workload (to set the router up and configure the stream the way README configures it for that
router) and once after (to report). Each request of the workload is then asked of the router as
a client asks it: its own salt string, its adapter's name (``--adapters``), through
:class:`~kvbm_plugin.testing.chat_workload.RouterProbe`'s ``external`` question.

* ``dynamo``: NVIDIA Dynamo's own KV indexer (``ai-dynamo-runtime``, :mod:`.dynamo_indexer`)
  subscribed to the consolidated output with its replay endpoint.
* ``llm-d``: the test model of llm-d's indexer and scorer (:mod:`.llmd_model`, read line by line
  from llm-d's Go source; llm-d itself cannot run here), fed every batch the demo's own
  subscriber applies, in order. The stream is configured as README's "Behind Dynamo or llm-d"
  says for llm-d: topic ``kv@<pod>@<model>``, passthrough mode, a rolled replay answered empty.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbm_plugin import consolidator_config as cc

# The pod and model llm-d reads from the topic (kv@<pod>@<model>): the model names the base
# model in its block keys, an adapter's name replaces it.
LLMD_POD, LLMD_MODEL = "demo-pod", "demo-model"
LLMD_TOPIC = f"kv@{LLMD_POD}@{LLMD_MODEL}"
ROUTERS = ("dynamo", "llm-d")


def adapter_names(adapters: int) -> dict[int, str]:
    """The demo's adapters: task ids 0..adapters-1, named ``adapter-<id>`` (what requests use,
    given to the plugin through DYN_KVBM_LORA_NAMES)."""
    return {i: f"adapter-{i}" for i in range(adapters)}


def router_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables README sets for the router the demo reads its stream with."""
    env: dict[str, str] = {}
    if args.adapters:
        env[cc.LORA_NAMES] = ",".join(f"{k}={v}" for k, v in adapter_names(args.adapters).items())
    if args.real_router == "llm-d":
        env[cc.TOPIC] = LLMD_TOPIC
        env[cc.OUTPUT_REPLAY_ROLLED] = "empty"  # llm-d recovers from an empty replay only
    return env


class RealRouter:
    """One real router reading the consolidated output: its question and its report."""

    def __init__(self, name: str, ask: Callable[[list[int], str | None, str | None], int],
                 report: Callable[[Any, Any], tuple[list, list]], close: Callable[[], None],
                 ) -> None:
        self.name = name
        self.ask = ask  # (prompt, salt string, adapter name) -> cached tokens
        self._report = report
        self._close = close

    def report(self, result: Any, check: Any) -> tuple[list, list]:
        """``(checks, summary lines)`` for the run's :class:`DriveResult` ``result``."""
        return self._report(result, check)

    def close(self) -> None:
        self._close()


def dynamo_router(args: argparse.Namespace, tmp: str, config: cc.ConsolidatorConfig,
                  view: Any, target: float) -> RealRouter:
    """NVIDIA Dynamo's own indexer on the consolidated stream (with its replay endpoint)."""
    from kvbm_plugin.routers.dynamo_indexer import Indexer, ask_like_the_view

    indexer = Indexer(Path(tmp))
    indexer.register(1, config.output.connect,
                     None if config.output_replay is None else config.output_replay.connect,
                     args.block_size)
    ask = ask_like_the_view(indexer, lambda: sum(view.blocks().values()),
                            salt_form=config.publisher.salt_form)

    def report(result: Any, check: Any) -> tuple[list, list]:
        tally = result.external_tally
        warnings = indexer.warnings()
        summary = [("Dynamo indexer", f"{sum(len(v) for v in indexer.held().values())} blocks "
                                      f"held; {len(warnings)} warnings"),
                   ("Dynamo indexer accuracy", tally.describe())]
        checks = [
            check("Dynamo indexer warnings 0", not warnings,
                  f"{len(warnings)}" + (f" (first: {warnings[0][-160:]})" if warnings else "")),
            check(f"Dynamo indexer agrees with engine reuse on >= {target:.0%} of prompt "
                  "tokens", tally.agreement >= target,
                  f"{tally.agreement:.2%} over {tally.requests} requests"),
        ]
        return checks, summary

    return RealRouter("dynamo", ask, report, indexer.close)


def llmd_subscriber(config: cc.ConsolidatorConfig, view: Any) -> tuple[Any, Any]:
    """``(subscriber, llm-d indexer)``: the demo's subscriber of the consolidated output that
    also hands every batch it applies to the llm-d model (:func:`.llmd_model.llmd_tap`)."""
    from kvbm_plugin.routers.llmd_model import LlmdIndexer, llmd_tap

    llmd = LlmdIndexer(block_size=view.block_size)
    tap = llmd_tap([llmd], config.output.connect,
                   None if config.output_replay is None else config.output_replay.connect,
                   start_seq=0, view=view)
    return tap, llmd


def llmd_router(llmd: Any, target: float) -> RealRouter:
    """llm-d's score of each request (the model and pod from the topic, the adapter's name as
    the model of an adapter's request, the salt string as the request carries it)."""

    def ask(prompt: list[int], salt: str | None, lora_name: str | None) -> int:
        return llmd.cached_tokens(prompt, lora_name or LLMD_MODEL, salt, pod=LLMD_POD)

    def report(result: Any, check: Any) -> tuple[list, list]:
        tally = result.external_tally
        counts = llmd.counts
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(llmd.tiers_held(LLMD_POD).items()))
        summary = [("llm-d (model)", f"{counts['batches']} batches, {counts['stores']} stores, "
                                     f"{counts['topic_filtered']} filtered by topic; held "
                                     f"{tiers or 'none'}"),
                   ("llm-d accuracy", tally.describe())]
        checks = [
            check("llm-d parse errors 0, stores skipped for an unknown parent 0",
                  counts["parse_errors"] == 0 and counts["unknown_parent_stores"] == 0,
                  f"{counts['parse_errors']} parse errors, {counts['unknown_parent_stores']} "
                  "unknown parents" + (f" (last: {llmd.last_error})" if llmd.last_error
                                       else "")),
            check(f"llm-d agrees with engine reuse on >= {target:.0%} of prompt tokens",
                  tally.agreement >= target,
                  f"{tally.agreement:.2%} over {tally.requests} requests"),
        ]
        return checks, summary

    return RealRouter("llm-d", ask, report, lambda: None)


__all__ = ["LLMD_MODEL", "LLMD_POD", "LLMD_TOPIC", "ROUTERS", "RealRouter", "adapter_names",
           "dynamo_router", "llmd_router", "llmd_subscriber", "router_env"]
