"""GuardedStore: a circuit breaker around any SharedStore, so that a store that is down costs
its callers one slow call per outage, not one per call.

Mooncake's calls take about 4.5 s each while the master is down (and Redis's up to its socket
timeout while a host does not answer). Who calls: the worker's writer and reader threads and the
leader's shared agent, each through the one GuardedStore of its process; never the executor
thread, which reads :attr:`GuardedStore.available` (no I/O, no lock held long).

* Closed (normal): calls go to the store. The breaker opens after ``threshold`` consecutive
  calls with an UNAVAILABLE result, or at once after one call slower than ``slow_call_s`` with
  an UNAVAILABLE result (the store's own timeout has been paid: do not pay it again).
* Open: every call returns UNAVAILABLE for every key at once (but :meth:`get_promised`'s, see
  there). Once the backoff has passed
  (``backoff_s``, doubling to ``max_backoff_s``), the next caller probes :meth:`health` of the
  store on its own thread (one prober at a time; the others are answered UNAVAILABLE meanwhile);
  a healthy answer closes the breaker and that call goes through. Reconnecting is the store's
  (Mooncake's client re-mounts its segment by itself; redis-py reconnects per command).

Every result is counted by kind (:meth:`stats`); opening and closing are logged (rate-limited),
nothing is raised: a store method that raises anyway counts as FAILED for each of its keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.tiers.shared.store import (
    CODE_NAMES,
    FAILED,
    UNAVAILABLE,
    Buffer,
    SharedStore,
)

log = logging.getLogger(__name__)

_OPS = ("exists", "put", "get_into", "remove")


class GuardedStore(SharedStore):
    """``store`` behind a circuit breaker (see the module docstring). Thread-safe."""

    name: ClassVar[str] = "guarded"

    def __init__(self, store: SharedStore, *, threshold: int = 3, slow_call_s: float = 1.0,
                 backoff_s: float = 0.5, max_backoff_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1:
            raise ValueError(f"threshold={threshold!r} must be >= 1")
        self.store = store
        self._threshold = threshold
        self._slow_call_s = slow_call_s
        self._backoff_min = backoff_s
        self._backoff_max = max_backoff_s
        self._clock = clock
        self._rl = RateLimitedLog(log)  # per breaker: one store's outage hides no other's
        self._lock = threading.Lock()
        self._open = False
        self._probing = False
        self._consecutive = 0
        self._backoff = backoff_s
        self._next_probe = 0.0
        self._reason = ""
        counts = {"opened": 0, "closed": 0, "probes": 0, "probes_failed": 0,
                  "short_circuited": 0, "slow_calls": 0, "exceptions": 0}
        for op in _OPS:
            counts[f"{op}_calls"] = 0
            for name in CODE_NAMES.values():
                counts[f"{op}_{name}"] = 0
            counts[f"{op}_present"] = 0  # exists: 1
            counts[f"{op}_absent"] = 0  # exists: 0
        self._counts = counts

    # SharedStore ------------------------------------------------------------------------
    @property
    def lease_s(self) -> float | None:
        return self.store.lease_s

    @property
    def available(self) -> bool:
        """False while the breaker is open (no I/O: the executor thread may read it)."""
        return not self._open

    @property
    def reason(self) -> str:
        """Why the breaker last opened ("" when it never did)."""
        return self._reason

    def register(self, address: int, size: int) -> None:
        self._guarded_hook(self.store.register, "register", address, size)

    def unregister(self, address: int) -> None:
        self._guarded_hook(self.store.unregister, "unregister", address)

    def exists(self, keys: Sequence[str]) -> list[int]:
        return self._run("exists", self.store.exists, keys)

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        return self._run("put", self.store.put, keys, buffers)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        return self._run("get_into", self.store.get_into, keys, buffers)

    def get_promised(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[int]:
        """``get_into`` of blocks the leader already promised TensorRT-LLM (a load that fails
        leaves the request computing on blocks nobody filled): goes to the store even while
        the circuit is open. The worker's breaker can still be open when the leader's agent
        (another client) has seen the store back, and the worker's reader thread can afford
        the store's timeout once more; a read that finds the store answering closes it."""
        return self._run("get_into", self.store.get_into, keys, buffers, force=True)

    def remove_if(self, key: str, fingerprint: str) -> int:
        """The store's ``remove_if``, through the breaker (a repair after a refused object)."""
        return self._run("remove", lambda keys: [self.store.remove_if(keys[0], fingerprint)],
                         [key])[0]

    def remove_if_size_not(self, key: str, size: int) -> int:
        """The store's ``remove_if_size_not``, through the breaker."""
        return self._run("remove", lambda keys: [self.store.remove_if_size_not(keys[0], size)],
                         [key])[0]

    def health(self) -> str | None:
        """The store's own answer while closed; while open, why it opened (no I/O)."""
        if self._open:
            return f"circuit open: {self._reason}"
        try:
            return self.store.health()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.store.close()

    def stats(self) -> dict[str, int]:
        """Every count (calls and results by operation and kind, breaker transitions, short
        circuits), plus the store's own ``stats()`` prefixed ``store_`` where it has one."""
        with self._lock:
            out = dict(self._counts)
            out["open"] = int(self._open)
        inner = getattr(self.store, "stats", None)
        if callable(inner):
            out.update({f"store_{k}": int(v) for k, v in inner().items()})
        return out

    # The breaker ------------------------------------------------------------------------
    def _guarded_hook(self, fn: Callable[..., Any], what: str, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            with self._lock:
                self._counts["exceptions"] += 1
            self._rl.log(logging.ERROR, f"breaker.{what}", "shared store %s %s raised %s: %s",
                         self.store.name, what, type(exc).__name__, exc)

    def _admit(self) -> bool:
        """Whether this call may reach the store; while open, probes health when due."""
        with self._lock:
            if not self._open:
                return True
            if self._probing or self._clock() < self._next_probe:
                return False
            self._probing = True
            self._counts["probes"] += 1
        try:
            problem = self.store.health()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._probing = False
            if problem is None:
                self._open = False
                self._consecutive = 0
                self._backoff = self._backoff_min
                self._counts["closed"] += 1
            else:
                self._counts["probes_failed"] += 1
                self._backoff = min(self._backoff * 2, self._backoff_max)
                self._next_probe = self._clock() + self._backoff
        if problem is None:
            log.warning("shared store %s is back: circuit closed", self.store.name)
            return True
        self._rl.log(logging.WARNING, "breaker.probe", "shared store %s still unavailable "
                     "(%s); next probe in %.1f s", self.store.name, problem, self._backoff)
        return False

    def _run(self, op: str, fn: Callable[..., list[int]], keys: Sequence[str],
             *args: Any, force: bool = False) -> list[int]:
        n = len(keys)
        if not force and not self._admit():
            with self._lock:
                self._counts["short_circuited"] += 1
                self._counts[f"{op}_calls"] += 1
                self._counts[f"{op}_unavailable"] += n
            return [UNAVAILABLE] * n
        started = self._clock()
        try:
            result = fn(keys, *args)
        except Exception as exc:
            with self._lock:
                self._counts["exceptions"] += 1
            self._rl.log(logging.ERROR, f"breaker.{op}", "shared store %s %s raised %s: %s",
                         self.store.name, op, type(exc).__name__, exc)
            result = [FAILED] * n
        elapsed = self._clock() - started
        unavailable = UNAVAILABLE in result
        opened = closed = False
        with self._lock:
            counts = self._counts
            counts[f"{op}_calls"] += 1
            for code in result:
                if code >= 0:
                    if op != "exists":
                        counts[f"{op}_ok"] += 1
                    elif code == 1:
                        counts[f"{op}_present"] += 1
                    else:
                        counts[f"{op}_absent"] += 1
                else:
                    counts[f"{op}_{CODE_NAMES.get(code, 'failed')}"] += 1
            slow = elapsed > self._slow_call_s
            if slow:
                counts["slow_calls"] += 1
            if unavailable:
                self._consecutive += 1
                if not self._open and (slow or self._consecutive >= self._threshold):
                    self._open = opened = True
                    self._reason = (f"{op} of {n} key(s) took {elapsed:.1f} s and found the "
                                    "store unavailable" if slow else
                                    f"{self._consecutive} calls in a row found the store "
                                    "unavailable")
                    self._backoff = self._backoff_min
                    self._next_probe = self._clock() + self._backoff
                    counts["opened"] += 1
            else:
                self._consecutive = 0
                if self._open and force:  # the store answered a forced call: it is back
                    self._open = False
                    self._backoff = self._backoff_min
                    counts["closed"] += 1
                    closed = True
        if closed:
            log.warning("shared store %s is back: circuit closed", self.store.name)
        if opened:
            self._rl.log(logging.WARNING, "breaker.open", "shared store %s unavailable (%s): "
                         "circuit open, calls fail at once until it answers again",
                         self.store.name, self._reason)
        return result

