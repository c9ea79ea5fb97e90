"""The router probe asks its question only once the workers are idle, host-to-disk demotions
included.

A host block evicted for an offload is demoted to disk by a copy that no request owns. A probe
that waited only for the requests' offloads asked while such a copy was on its way: when it
was reported before the next request's match, the engine loaded a disk block no router knew of
(stop 32's CI: llm-d under-credited 8 tier-served tokens). Here a demotion is held on the disk
thread until the probe's first poll; the probe must see its disk STORE before it answers.
"""

from __future__ import annotations

import threading
import time

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.testing.chat_workload import RouterProbe
from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.wire.events import to_signed_int64
from kvbm_plugin.worker import disk_io

BS = 4


def test_the_probe_answers_after_the_demotions_in_flight_are_published(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    held, released = threading.Event(), threading.Event()
    write = disk_io.DiskIO._write

    def held_demotion(self, op_id, req_id, slot, key, block, demotion):  # noqa: ANN001, ANN202
        if demotion and not released.is_set():
            held.set()
            released.wait(30)
        return write(self, op_id, req_id, slot, key, block, demotion)

    monkeypatch.setattr(disk_io.DiskIO, "_write", held_demotion)
    env = {cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
           cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu",
           cc.REPLAY_ENDPOINT: f"ipc://{tmp_path}/gpu-r",
           cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out",
           cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp_path}/out-r",
           cc.CPU_CACHE_NUM_BLOCKS: "4", cc.DISK_CACHE_NUM_BLOCKS: "32",
           cc.DISK_CACHE_DIR: f"{tmp_path}/disk"}
    engine = SimulatedEngine(EngineConfig(tokens_per_block=BS, num_gpu_blocks=32, env=env))
    sub = TreeSubscriber(env[cc.OUTPUT_ENDPOINT], env[cc.OUTPUT_REPLAY_ENDPOINT], start_seq=0,
                         view=RouterView(BS))
    try:
        deadline = time.monotonic() + 30
        for k in range(8):  # one at a time, distinct prompts: no load waits on the disk thread
            engine.submit([1000 * k + i for i in range(1, 10)], 1)
            while engine.active() or not (held.is_set()
                                          or all(w.idle() for w in engine.workers)):
                assert time.monotonic() < deadline
                engine.step()  # (a pass with nothing to run returns at once)
            if held.is_set():
                break
        assert held.is_set(), "no demotion was held"
        leader = engine.leader
        assert leader is not None and leader.stats()["demotes_committed"] == 0

        def poll(timeout_ms: int) -> object:  # the demotion completes once the probe polls
            released.set()
            return sub.poll(timeout_ms)

        probe = RouterProbe(engine, sub, settle_timeout=20.0, poll=poll)
        assert probe.settle()
        stats = leader.stats()
        assert stats["demotes_committed"] == stats["demotes_scheduled"] > 0
        disk = {to_signed_int64(h) for h in leader.resident_hashes("disk")}
        assert disk and {h for _, h, m in sub.view.held() if m == "DISK"} == disk
    finally:
        released.set()
        sub.close()
        engine.shutdown()
