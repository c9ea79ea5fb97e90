"""Requests TensorRT-LLM never finishes: a cancelled request never reaches ``request_finished``
(``py_executor.py`` @ 0004396720054 calls it only for finished requests). The leader sees the
request object finished (or gone) and forgets it: pins released, saves that may have read
reused blocks discarded, state bounded and, once everything settled, empty."""

from __future__ import annotations

import random
import threading
from collections import Counter, deque

import pytest
from _engines import prompt, tiers

from kvbm_plugin.connector_worker import KvbmConnectorWorker
from kvbm_plugin.worker.transfer_thread import TransferThread

# the engine state a cancel is aimed at -> the phase's name
PHASES = {"waiting": "waiting", "context": "prefill", "loading": "loading",
          "generation": "decode", "saving": "saving"}


# 2,500 requests in the default run, 10,000 in the slow set: either is many times what is
# ever in flight (80), which is what the bound on the leader's state is checked against.
@pytest.mark.parametrize("requests", [
    pytest.param(2_500, id="2500"), pytest.param(10_000, id="10000", marks=pytest.mark.slow)])
def test_thousands_of_requests_a_fifth_cancelled_at_every_phase_leave_no_state(
        make_engine, monkeypatch, requests: int) -> None:
    # The transfer thread takes up a load one pass and a save two passes after the pass
    # that issued it (until the run is over), so requests are seen loading and saving
    # (request_finished said True) between passes, at no cost in disk I/O.
    gate = threading.Condition()
    passes = {"done": 0, "open": False}
    issued: dict[str, deque[int]] = {"load": deque(), "save": deque()}

    def wait_for(kind: str, n_passes: int) -> None:
        with gate:
            start = issued[kind].popleft()
            gate.wait_for(lambda: passes["open"] or passes["done"] >= start + n_passes, 30)

    start_load, enqueue_saves = KvbmConnectorWorker.start_load_kv, \
        KvbmConnectorWorker._enqueue_saves
    run_loads, run_saves = TransferThread._run_loads, TransferThread._run_saves

    def start_load_kv(self, stream):
        meta = self.get_connector_meta()
        if getattr(meta, "loads", None):
            issued["load"].append(passes["done"])
        return start_load(self, stream)

    def _enqueue_saves(self, stream):
        if self._pending_save_meta is not None:
            issued["save"].append(passes["done"])
        return enqueue_saves(self, stream)

    monkeypatch.setattr(KvbmConnectorWorker, "start_load_kv", start_load_kv)
    monkeypatch.setattr(KvbmConnectorWorker, "_enqueue_saves", _enqueue_saves)
    monkeypatch.setattr(TransferThread, "_run_loads",
                        lambda self, loads: (wait_for("load", 1), run_loads(self, loads))[1])
    monkeypatch.setattr(TransferThread, "_run_saves",
                        lambda self, *a: (wait_for("save", 2), run_saves(self, *a))[1])
    rng = random.Random(17)
    engine = make_engine(num_gpu_blocks=192, env=tiers(host=256), max_num_tokens=96,
                         max_batch_size=64, num_layers=1, num_kv_heads=1, head_dim=2)
    leader = engine.leader
    systems = [prompt(1000 + k, 8 + 4 * (k % 3)) for k in range(24)]
    target: dict[int, str] = {}
    cancelled: Counter[str] = Counter()
    in_flight: set[int] = set()
    submitted = 0
    peak = 0
    # Until nothing is left but saving requests: TRT-LLM's loop then blocks (they are out of
    # active_requests) and frees them at the next request's get_finished.
    while submitted < requests or (in_flight and engine.active()):
        while submitted < requests and len(in_flight) < 80:
            tokens = rng.choice(systems) + prompt(rng.randrange(1 << 20), rng.randrange(1, 9))
            req = engine.submit(tokens, rng.randrange(1, 5))
            submitted += 1
            in_flight.add(req)
            if rng.random() < 0.2:
                target[req] = rng.choice(list(PHASES))
        for req in list(in_flight):
            state = engine.state(req)
            if state == "done":
                in_flight.discard(req)
            elif target.get(req) == state:
                engine.abort(req)
                cancelled[PHASES[state]] += 1
                del target[req]
        engine.step()
        with gate:
            passes["done"] += 1
            gate.notify_all()
        peak = max(peak, len(leader._reqs))
    with gate:
        passes["open"] = True
        gate.notify_all()
    engine.run_until_idle()
    engine.submit(prompt(7, 9), 1)  # its pass's get_finished releases the last saves
    engine.run_until_idle()
    assert all(engine.state(req) == "done" for req in in_flight)
    stats = leader.stats()
    assert set(cancelled) == set(PHASES.values()), cancelled
    assert min(cancelled.values()) >= requests // 200, cancelled
    # every cancel the engine applied to a request the leader knew ended its state silently
    assert stats["requests_terminated_silently"] > requests * 3 // 100
    assert peak <= 160  # bounded by what is in flight, not by what ever ran
    assert len(leader._reqs) == 0 and stats["ops_inflight"] == 0
    assert stats["tier_stores_waiting_for_name"] == 0
    assert all(e.pins == 0 for e in leader._tiers.host.entries())
    assert leader._pending_loads == [] and leader._fences == []
    assert stats["matched_host_tokens"] > 0
    assert engine.stats().kv_mismatches == 0
