"""A multimodal workload's consolidated stream in NVIDIA Dynamo's real KV indexer: every block
(GPU copies, host copies under TensorRT-LLM's V1 names with the items' digests) is held there
as the project's strict view holds it, with no warning and no block under a second name."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _feed import compare, feed_indexer, feed_view

from kvbm_plugin.routers.dynamo_indexer import Indexer
from kvbm_plugin.routers.router_view import RouterView
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.wire.subscriber import StreamSubscriber

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))
from test_multimodal_names import BS, _request  # noqa: E402


def test_dynamos_indexer_holds_a_multimodal_stream_as_the_strict_view_does(
        indexer: Indexer, tmp_path: Path) -> None:
    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
           "DYN_KVBM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/gpu",
           "DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/gpu-r",
           "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
           "DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT": f"ipc://{tmp_path}/out-r",
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "64"}
    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=6, tokens_per_block=BS,
                                          provide_block_hashes=False, env=env))
    sub = StreamSubscriber(env["DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT"],
                           env["DYN_KVBM_KV_EVENTS_OUTPUT_REPLAY_ENDPOINT"], start_seq=0)
    batches = []
    try:
        leader = engine.leader
        assert leader is not None and leader.consolidator is not None
        for image, tail in ((1, 20), (2, 21), (1, 22), (2, 23), (3, 24)):
            tokens, items = _request(image, tail)
            engine.submit(tokens, 2, multimodal=items)
            engine.run_until_idle()
        leader.publish_now()
        assert leader.consolidator.wait_idle(10)
        deadline = time.monotonic() + 30
        while sub.next_seq != leader.consolidator.stats()["batches_out"]:
            assert time.monotonic() < deadline, sub.next_seq
            batches.extend(sub.poll(20))
        assert leader.consolidator.stats()["hash_conflicts"] == 0
    finally:
        sub.close()
        engine.shutdown()
    steps = [((1, b.data_parallel_rank or 0), b.events) for b in batches]
    feed_indexer(indexer, tmp_path, steps, BS)
    view = RouterView(BS)
    feed_view(view, steps)
    real, ours, real_parent, our_parent = compare(indexer, view)
    assert real and ours == real and real_parent == our_parent == 0
    assert view.counts.warnings == 0 and indexer.warnings() == []
