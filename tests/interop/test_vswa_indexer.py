"""A sliding-window model's consolidated stream in NVIDIA Dynamo's real KV indexer: it holds
exactly what the project's strict view holds (every tier block under one name, the largest
window group's, advertised only while every layer group holds it), warns about nothing, and
predicts the engine's reuse of the next turn of every chat (testing/vswa_engine.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _feed import compare, feed_indexer, feed_view

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.vswa_engine import VswaConfig, VswaEngine
from kvbm_plugin.wire.subscriber import StreamSubscriber

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))
from _vswa import BS, OFF, WINDOW  # noqa: E402


def _turn(c: int, turn: int) -> list[int]:
    return [(c * 1000 + turn * 37 + i * 11) % 997 + 1 for i in range(9)]


def test_dynamos_indexer_agrees_with_the_engine_on_a_sliding_window_model(
        indexer: Indexer, tmp_path: Path) -> None:
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu",
           cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/gpu-r",
           cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-r",
           cc.CPU_CACHE_NUM_BLOCKS: "256", **OFF}
    sub = StreamSubscriber(env[cc.OUTPUT_ENDPOINT], env[cc.OUTPUT_REPLAY_ENDPOINT],
                           start_seq=0)
    batches = []
    try:
        with VswaEngine(VswaConfig(tokens_per_block=BS, window=WINDOW, env=env)) as engine:
            leader = engine.leader
            assert leader is not None and leader.consolidator is not None
            history: dict[int, list[int]] = {}
            for turn in range(3):  # four chats grow past the window
                for c in range(4):
                    req = engine.submit(history.get(c, []) + _turn(c, turn), 3)
                    engine.run_until_idle()
                    history[c] = engine._reqs[req].tokens[:-1]  # noqa: SLF001
            deadline = time.monotonic() + 30
            while not all(r.worker.idle() for r in engine.ranks):
                assert time.monotonic() < deadline
                time.sleep(0.005)
            leader.publish_now()
            assert leader.consolidator.wait_idle(10)
            while sub.next_seq != leader.consolidator.stats()["batches_out"]:
                assert time.monotonic() < deadline, sub.next_seq
                batches.extend(sub.poll(20))
            steps = [((1, b.data_parallel_rank or 0), b.events) for b in batches]
            feed_indexer(indexer, tmp_path, steps, BS)
            view = RouterView(BS)
            feed_view(view, steps)
            real, ours, real_parent, our_parent = compare(indexer, view)
            assert ours == real and real_parent == our_parent == 0
            assert view.counts.warnings == 0 and indexer.warnings() == []
            total = disagreed = loaded = 0
            for c in range(4):  # the next turn of every chat: predicted, then run
                tokens = history[c] + _turn(c, 9)
                servable = (len(tokens) - 1) // BS * BS
                predicted = min(indexer.cached_tokens(tokens), servable)
                assert predicted == min(view.cached_tokens(tokens), servable)
                req = engine.submit(tokens, 1)
                engine.run_until_idle()
                total += len(tokens)
                loaded += engine.loaded_tokens(req)
                disagreed += abs(predicted - engine.loaded_tokens(req))
            assert loaded > 0 and disagreed <= 0.01 * total, (loaded, disagreed, total)
            assert engine.stats.kv_mismatches == 0 and engine.stats.window_violations == 0
    finally:
        sub.close()
