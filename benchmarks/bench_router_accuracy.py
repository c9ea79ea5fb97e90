"""Router accuracy: what a strict router would say is cached versus what the engine reuses.

The simulated engine (real leader and worker, host and disk tiers, in-process consolidator)
runs a steady multi-tenant chat (:class:`~kvbm_plugin.testing.chat_workload.SteadyChat`) of 10,000
requests with the GPU pool and both tiers under eviction pressure; a
:class:`~kvbm_plugin.routers.router_view.TreeSubscriber` of the consolidated stream keeps a strict
router's radix trees. For every request the router's answer (any tier), taken after the streams
settled right before the iteration that schedules it, is compared with the prefix the engine
reused (GPU hit plus tokens onboarded from host and disk); see
:mod:`kvbm_plugin.testing.chat_workload` for the exact timing. The model is tiny (one layer,
blocks of 4 tokens) so that the run is about events, not KV copies.

Targets: >= 99 % of prompt tokens agree; 0 router-rule warnings. Run in dedup mode (the
default) and in passthrough mode (per-medium trees; any tier = the longest of them).

``--real``: NVIDIA Dynamo's own indexer (``pip install '.[interop]'``; root, for its private
network namespace, see kvbm_plugin.routers.dynamo_indexer) subscribes to the consolidated stream
too and is asked the same question at the same moment, through its ``/query`` (the tenant's
cache salt as ``cache_salt``: the namespace the plugin publishes, ``identity.salt_namespace``).
Before each answer the probe waits (up to 2 s) until the indexer holds as many blocks as the
view: it applies events asynchronously and says nothing of how far it got.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from benchmarks._table import Row, print_table
from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.dynamo_indexer import Indexer, ask_like_the_view, unavailable
from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.testing.chat_workload import RouterProbe, SteadyChat, drive

BLOCK_SIZE = 4


def _real_indexer(tmp: str, config: cc.ConsolidatorConfig, view: RouterView):  # noqa: ANN202
    """Dynamo's indexer on the consolidated stream, and the probe's question to it."""
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"--real: {reason}")
    idx = Indexer(Path(tmp))
    assert config.output_replay is not None
    idx.register(1, config.output.connect, config.output_replay.connect, BLOCK_SIZE)
    return idx, ask_like_the_view(idx, lambda: sum(view.blocks().values()))


def measure(requests: int, mode: str, seed: int = 7, real: bool = False) -> dict[str, float]:
    """One run; returns the tally and counters as plain numbers."""
    import torch

    from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

    with tempfile.TemporaryDirectory(prefix="kvbm-bench-router-") as tmp:
        env = {
            cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: mode,
            cc.EVENTS_ENDPOINT: f"ipc://{tmp}/gpu", cc.REPLAY_ENDPOINT: f"ipc://{tmp}/gpu-r",
            cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/out", cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/out-r",
            cc.CPU_CACHE_NUM_BLOCKS: "48", cc.DISK_CACHE_NUM_BLOCKS: "128",
            cc.DISK_CACHE_DIR: f"{tmp}/disk",
        }
        config = cc.load_consolidator_config(env)
        assert config.output_replay is not None
        engine = SimulatedEngine(EngineConfig(
            num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=BLOCK_SIZE,
            num_gpu_blocks=40, tp_size=1, max_num_tokens=128, max_batch_size=8,
            dtype=torch.float32, env=env, vocab_size=30000))
        subscriber = TreeSubscriber(config.output.connect, config.output_replay.connect,
                                    start_seq=0, view=RouterView(BLOCK_SIZE))
        idx = ask = None
        if real:
            idx, ask = _real_indexer(tmp, config, subscriber.view)
        probe = RouterProbe(engine, subscriber, external=ask)
        workload = SteadyChat(tenants=6, sessions=12, max_turns=6, system_tokens=16,
                              user_tokens=8, gen_tokens=2, max_context=72, seed=seed)
        started = time.perf_counter()
        try:
            result = drive(engine, probe, workload, max_requests=requests, timeout_s=3600)
            stats = engine.stats()
            real_warnings = len(idx.warnings()) if idx is not None else 0
        finally:
            subscriber.close()
            engine.shutdown()
            if idx is not None:
                idx.close()
        seconds = time.perf_counter() - started
    tally = result.tally
    counts = subscriber.view.counts
    return {
        "requests": float(result.finished), "seconds": seconds,
        "agreement": tally.agreement, "over": tally.over_tokens / max(1, tally.prompt_tokens),
        "under": tally.under_tokens / max(1, tally.prompt_tokens),
        "under_late": tally.under_late_tokens / max(1, tally.prompt_tokens),
        "warnings": float(counts.warnings), "skipped_stores": float(counts.skipped_stores),
        "cut_subtrees": float(counts.cut_subtrees),
        "unknown_removes": float(counts.unknown_removes),
        "alias_blocks": float(counts.alias_blocks),
        "tier_share": (stats.host_hit_tokens + stats.disk_hit_tokens)
        / max(1, stats.prompt_tokens),
        "settle_timeouts": float(probe.settle_timeouts),
        "real_agreement": result.external_tally.agreement if real else float("nan"),
        "real_warnings": float(real_warnings),
    }


def run(quick: bool = False, real: bool = False) -> list[Row]:
    """Dedup mode on 10,000 requests (``quick``: 600), passthrough on a fifth as many."""
    rows: list[Row] = []
    for mode, requests in (("dedup", 600 if quick else 10_000),
                           ("passthrough", 200 if quick else 2_000)):
        m = measure(requests, mode, real=real)
        name = f"router[{mode}, {int(m['requests'])} req]"
        if real:
            rows += [
                Row(name, "prompt tokens Dynamo's indexer and engine agree on",
                    m["real_agreement"] * 100, "%", None, ">= 99 %",
                    m["real_agreement"] >= 0.99),
                Row(name, "Dynamo indexer warnings", m["real_warnings"], "", None, "0",
                    m["real_warnings"] == 0),
            ]
        rows += [
            Row(name, "prompt tokens router and engine agree on", m["agreement"] * 100, "%",
                None, ">= 99 %", m["agreement"] >= 0.99),
            Row(name, "router-rule warnings (strict tree)", m["warnings"], "", None, "0",
                m["warnings"] == 0),
            Row(name, "prompt tokens over-estimated (info)", m["over"] * 100, "%"),
            Row(name, "prompt tokens under-estimated (info)", m["under"] * 100, "%"),
            Row(name, "under-estimated, shown right after the scheduling iteration (info)",
                m["under_late"] * 100, "%"),
            *(Row(name, f"of the warnings: {rule} (info)", m[rule], "")
              for rule in ("cut_subtrees", "skipped_stores", "unknown_removes", "alias_blocks")
              if m[rule]),
            Row(name, "prompt tokens served by host/disk (info)", m["tier_share"] * 100, "%"),
            Row(name, "run time (info)", m["seconds"], "s"),
        ]
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv, real="--real" in sys.argv))
