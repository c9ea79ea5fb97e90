"""The Mooncake master stopped mid-run and restarted on the same port, behind GuardedStore:
one slow call opens the breaker, every later call fails at once (counted, no traceback, no
ERROR log), and the client recovers by itself when the master is back (its data gone)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from _payload import Arena, payload

from kvbm_plugin.tiers.shared.breaker import GuardedStore
from kvbm_plugin.tiers.shared.store import MISSING, OK, UNAVAILABLE

BLOCK = 64 << 10


# Both ends of the breaker are the same whichever way the master went; a SIGTERM'd master
# takes seconds longer to go (the slow set).
@pytest.mark.parametrize("stop", [pytest.param("sigterm", marks=pytest.mark.slow), "sigkill"])
def test_master_stopped_and_restarted(mooncake_master: Any, mooncake_store_factory: Any,
                                      caplog: pytest.LogCaptureFixture, stop: str) -> None:
    store = mooncake_store_factory(mooncake_master)
    guarded = GuardedStore(store, threshold=3, slow_call_s=1.0, backoff_s=0.2,
                           max_backoff_s=0.5)
    keys = [f"kvbm/test-model/w1r0/lg0/t32b{BLOCK}/bfloat16.v1pool/{i:032x}" for i in range(4)]
    arena = Arena(5, BLOCK)
    for i, key in enumerate(keys):
        arena.write(i, payload(key, BLOCK))
    assert guarded.put(keys, [arena.buffer(i) for i in range(4)]) == [OK] * 4
    assert guarded.exists(keys) == [1] * 4

    caplog.set_level(logging.WARNING, logger="kvbm_plugin")
    if stop == "sigterm":
        mooncake_master.stop()
    else:
        mooncake_master.kill()
    # The first call pays Mooncake's reconnect attempt (or returns -900 at once); from the
    # call that opens the breaker on, nothing waits on the dead master.
    deadline = time.monotonic() + 30
    took = []
    while guarded.available:
        assert time.monotonic() < deadline, "the breaker never opened"
        started = time.monotonic()
        assert guarded.exists(keys) == [UNAVAILABLE] * 4
        took.append(time.monotonic() - started)
    assert len(took) <= 3 and sum(t > 1.0 for t in took) <= 1, took  # one slow call at most
    started = time.monotonic()
    for _ in range(50):
        assert guarded.exists(keys) == [UNAVAILABLE] * 4
        assert guarded.get_into(keys[:1], [arena.buffer(4)]) == [UNAVAILABLE]
        assert guarded.put(keys[:1], [arena.buffer(0)]) == [UNAVAILABLE]
    assert time.monotonic() - started < 3.0  # probes of 0.5 s at most, not 4.5 s per call
    stats = guarded.stats()
    assert stats["opened"] == 1 and stats["short_circuited"] >= 100
    assert stats["exists_unavailable"] >= 200 and stats["put_unavailable"] == 50
    assert "circuit open" in caplog.text

    mooncake_master.restart()  # same RPC and metrics ports
    deadline = time.monotonic() + 20
    while guarded.exists(keys) == [UNAVAILABLE] * 4:
        assert time.monotonic() < deadline, "the client never reconnected"
        time.sleep(0.05)  # the breaker's next probe is due within max_backoff_s
    assert guarded.available and guarded.stats()["closed"] >= 1
    assert guarded.exists(keys) == [0] * 4  # a restarted master is an empty pool
    assert guarded.get_into(keys[:1], [arena.buffer(4)]) == [MISSING]
    # Writes work again once the client has re-mounted its segment (within ~1 s).
    deadline = time.monotonic() + 10
    while guarded.put(keys, [arena.buffer(i) for i in range(4)]) != [OK] * 4:
        assert time.monotonic() < deadline, "puts never worked again"
        time.sleep(0.05)
    assert guarded.get_into(keys[:1], [arena.buffer(4)]) == [BLOCK]
    assert arena.read(4) == payload(keys[0], BLOCK)
    assert not [r for r in caplog.records if r.exc_info]  # no traceback anywhere
