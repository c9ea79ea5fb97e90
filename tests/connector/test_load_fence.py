"""A request cancelled while its async load runs: TensorRT-LLM frees its blocks in that pass
and may hand them to another request in the next one. The load must never write into them
after that: the leader learns of the cancel from the request object, and every rank fences the
request's loads before the next pass's loads or forward."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from _engines import prompt, tiers
from _kvwire import wait_until

from kvbm_plugin.tiers.disk import DiskTier

POISON = -12345.0


def in_disk_not_gpu(engine: Any, tokens: list[int]) -> None:
    engine.submit(tokens, 1)
    engine.run_until_idle()
    for k in range(3):
        engine.submit(prompt(500 + k, 40), 1)
        engine.run_until_idle()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_cancelled_load_never_writes_into_a_reused_block(make_engine, monkeypatch,
                                                           overlap) -> None:
    engine = make_engine(num_gpu_blocks=16, env=tiers(disk=64), max_num_tokens=4,
                         overlap_scheduler=overlap)
    a = prompt(7, 17)
    in_disk_not_gpu(engine, a)
    original = DiskTier.read
    reading, release = threading.Event(), threading.Event()

    def held_read(self, slot, key, out):
        reading.set()
        release.wait(30)
        return original(self, slot, key, out)

    monkeypatch.setattr(DiskTier, "read", held_read)
    worker = engine.workers[0]
    progress = worker._progress
    fence = progress.fence

    def fence_and_let_the_read_finish(req_ids, timeout_s):  # the read ends while it waits
        release.set()
        return fence(req_ids, timeout_s)

    progress.fence = fence_and_let_the_read_finish
    keep_busy = engine.submit(prompt(8, 5), 12)  # batches keep running: cancels are processed
    victim = engine.submit(a, 1)
    for _ in range(10):
        engine.step()
        if engine.result(victim).state != "waiting":
            break
    assert engine.result(victim).state == "loading" and reading.wait(10)
    targets = engine.block_ids(victim)[:4]  # the 16 tokens being loaded
    engine.abort(victim)
    while engine.result(victim).state != "done":
        engine.step()
    # TRT-LLM freed the blocks while the read is still held; the next request gets them
    reuser = engine.submit(prompt(9, 20), 1)
    start_load = worker.start_load_kv
    poisoned: list[int] = []

    def poison_after_bind(stream):
        start_load(stream)
        blocks = engine.block_ids(reuser)
        if not poisoned and blocks:
            # the blocks its first 4-token chunk does not compute: nobody may write them now
            poisoned.extend(b for b in blocks[1:] if b in targets)
            for b in poisoned:
                worker._pool[b].fill_(POISON)

    worker.start_load_kv = poison_after_bind
    engine.step()
    while not poisoned:
        engine.step()
    release.set()  # where no fence ran (the old behaviour), the read ends only now
    wait_until(lambda: worker.idle(), 10, "the cancelled load to end")
    assert poisoned, "the reusing request got none of the cancelled load's blocks"
    for b in poisoned:
        assert torch.all(worker._pool[b] == POISON), f"block {b} written after reuse"
    assert worker.stats()["loads_fenced"] >= 1
    # Its fenced loads are no load errors: the blocks are the reusing request's now, and that
    # request's own forward fills them (handle_load_errors must not recompute it).
    assert worker.stats()["load_error_blocks"] == 0
    assert engine.stats().recomputed_requests == 0
    engine.run_until_idle()
    engine.submit(prompt(10, 5), 1)  # its pass releases a request that was still saving
    engine.run_until_idle()
    assert engine.result(keep_busy).state == "done"
    assert engine.stats().kv_mismatches == 0
