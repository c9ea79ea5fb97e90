"""End to end: simulated engine → real leader (sink, publisher, in-process consolidator)."""

from __future__ import annotations

import time

import pytest
from _kvwire import wait_all_sent

from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine
from kvbm_plugin.wire.events import to_unsigned_u64


class _SlowSubscription:
    """Holds back the consolidator's GPU-tier SUB connect until :meth:`release`, as a loaded
    machine's I/O threads hold back a subscription: the PUB drops every batch sent meanwhile.
    The held connect is made on the consolidator's own thread (its sockets are not thread-safe),
    at its next poll, which polls at least every 10 ms while one is held."""

    def __init__(self, monkeypatch, gpu_address: str) -> None:  # noqa: ANN001
        # ``gpu_address``: the configured endpoint (rank r connects to it with a ``_dp<r>``
        # suffix, so every rank is held).
        import threading

        import zmq

        self.released = threading.Event()
        held: list[tuple[zmq.Socket, str]] = []
        connect, poll = zmq.Socket.connect, zmq.Poller.poll

        def held_connect(sock, address: str):  # noqa: ANN001, ANN202
            if threading.current_thread().name == "kvbm-consolidator" \
                    and address.startswith(gpu_address) and sock.type == zmq.SUB:
                held.append((sock, address))
                return None
            return connect(sock, address)

        def polling(poller, timeout=None):  # noqa: ANN001, ANN202
            if held and threading.current_thread().name == "kvbm-consolidator":
                if self.released.is_set():
                    while held:
                        connect(*held.pop())
                else:
                    timeout = 10 if timeout is None else min(timeout, 10)
            return poll(poller, timeout)

        monkeypatch.setattr(zmq.Socket, "connect", held_connect)
        monkeypatch.setattr(zmq.Poller, "poll", polling)

    def release(self) -> None:
        self.released.set()


# The consolidator may join the GPU-tier stream only after the engine published (and went
# quiet): it catches up from the replay endpoint once its subscription reached the publisher.
# (Without a replay endpoint those batches are lost for good: the result would depend on the
# machine's load.)
@pytest.mark.parametrize("subscription", ["prompt", "after the run"])
def test_consolidated_view_equals_gpu_host_disk_truth(tmp_path, monkeypatch,
                                                      subscription: str) -> None:
    slow = _SlowSubscription(monkeypatch, f"ipc://{tmp_path}/gpu")
    if subscription == "prompt":
        slow.release()
    env = {"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "true",
           "DYN_KVBM_KV_EVENTS_ENDPOINT": f"ipc://{tmp_path}/gpu",
           "DYN_KVBM_KV_EVENTS_REPLAY_ENDPOINT": f"ipc://{tmp_path}/gpu-replay",
           "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": f"ipc://{tmp_path}/out",
           "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "6",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "8",
           "DYN_KVBM_DISK_CACHE_DIR": str(tmp_path / "disk")}
    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=12, env=env, tp_size=2))
    try:
        consolidator = engine.leader.consolidator
        assert consolidator is not None
        for k in range(6):
            engine.submit([(k * 1000 + i * 7) % 997 + 1 for i in range(17)], 2)
        engine.run_until_idle()
        # Drain and publish the last GPU events here, now (an iteration only wakes the
        # leader's event pump, whose later batch would land after `published` is read)
        engine.leader.flush_events()
        truth = set().union(*(ranks[0] for ranks in engine.resident_blocks().values()))
        slow.release()
        assert engine.resident_blocks()["DISK"][0]  # all three tiers took part
        published = wait_all_sent(engine.leader.event_sink.stats)
        deadline = time.monotonic() + 10
        while True:
            consolidator.wait_idle(1.0)
            visible = {to_unsigned_u64(h) for h in consolidator._core.visible_hashes(0)}
            applied = consolidator.stats()["batches_applied"]
            if (visible == truth and applied == published) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert visible == truth
        # Every GPU-tier batch reached it (the tiers' copies alone can make the views equal).
        assert applied == published
        stats = consolidator.stats()
        assert stats["registration_errors"] == 0 and stats["unknown_parents"] == 0
        assert engine.stats().kv_mismatches == 0
    finally:
        engine.shutdown()


def test_request_larger_than_the_pool_is_rejected_not_queued_forever() -> None:
    engine = SimulatedEngine(EngineConfig(num_gpu_blocks=4, tokens_per_block=4, env={
        "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false"}))
    try:
        with pytest.raises(ValueError, match="num_gpu_blocks=4"):
            engine.submit(list(range(1, 17)), 1)
        engine.submit(list(range(1, 15)), 1)  # 15 tokens fit in 4 blocks
        engine.run_until_idle(timeout_s=30)
        assert engine.stats().requests_finished == 1
    finally:
        engine.shutdown()


def test_no_endpoint_with_consolidator_off_warns_that_nothing_is_published(caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="kvbm_plugin.connector_leader"):
        engine = SimulatedEngine(EngineConfig(env={
            "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "0",
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": "4"}))
    try:
        assert "no KV-event endpoint configured" in caplog.text
        assert engine.leader.consolidator is None
    finally:
        engine.shutdown()


def test_engine_without_an_event_buffer_gets_a_warning_not_a_silent_empty_stream(caplog) -> None:
    import logging

    engine = SimulatedEngine(EngineConfig(env={"DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "0"}))
    try:
        engine.kv_cache_manager.event_buffer_max_size = 0  # as TRT-LLM's KVCacheManager reports it
        with caplog.at_level(logging.WARNING, logger="kvbm_plugin.connector_leader"):
            engine.submit(list(range(1, 10)), 1)
            engine.run_until_idle()
        assert "event_buffer_max_size=0" in caplog.text
        assert engine.leader.event_source is None
    finally:
        engine.shutdown()
