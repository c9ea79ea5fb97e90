"""A simulated engine in a process of its own: one "node" of a multi-engine deployment.

:class:`EngineProcess` spawns a child (``multiprocessing`` spawn: nothing inherited) that builds
a :class:`~kvbm_plugin.testing.engine.SimulatedEngine` (its own leader, tiers, consolidator and
shared-tier agent; with ``processes=True`` its ranks 1.. in processes of their own) and answers
one command per message over a pipe, on the child's main thread (the engine's executor thread).
The two-engine tests and ``kvbm-plugin demo --engines 2`` drive two of them against one store.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvbm_plugin.testing.child import ChildProcess

_REPLY_TIMEOUT_S = 180.0

Request = tuple[list[int], int, str | None]  # prompt tokens, new tokens, cache salt


class EngineProcess(ChildProcess):
    """The parent's handle on one engine process (calls from one thread); ``call(command,
    *args)`` runs one of :func:`_engine_main`'s commands."""

    def __init__(self, name: str, config: Mapping[str, Any],
                 stderr_path: str | None = None) -> None:
        """``stderr_path``: the child's file descriptor 2 (its Python warnings, Mooncake's glog
        lines) goes to this file instead of the parent's stderr."""
        self.name = name
        super().__init__(f"engine {name}", _engine_main, (dict(config), stderr_path),
                         name=f"sim-engine-{name}", daemon=False,  # not a daemon: it has children
                         reply_timeout_s=_REPLY_TIMEOUT_S)
        try:
            self.info: dict[str, Any] = self.reply()  # raises the child's bring-up error
        except (KeyboardInterrupt, SystemExit):
            self.kill()  # the caller ends on a signal: not after the child's bring-up
            raise
        except BaseException:
            self.shutdown()
            raise

    def run(self, requests: Sequence[Request], timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """Submit ``requests`` and step until idle; per request its result and the prompt
        tokens the connector matched in each tier while it was admitted."""
        return self.call("run", [list(r) for r in requests], timeout_s)

    def settle(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Wait until every write-through is committed and the agent confirmed what it
        was told (a full turn of its thread), then publish and wait until the consolidator
        applied everything; returns the leader's stats (and ``consolidated_batches_out``)."""
        return self.call("settle", timeout_s)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def wait_subscribed(self, peers: int, timeout_s: float = 30.0) -> None:
        """Block until ``peers`` other engines subscribed to this engine's announcements (an
        announcement sent before a peer's subscription arrived is not delivered to it: ZMQ's
        PUB/SUB slow joiner)."""
        _wait(lambda: self.stats()["leader"].get("shared_agent_subscriptions", 0) >= peers,
              f"{peers} peers to subscribe to engine {self.name}'s announcements", timeout_s)

    def block_bytes(self, req_id: int, n_blocks: int) -> list[list[bytes]]:
        """Per rank, the bytes of the request's first ``n_blocks`` device blocks."""
        return self.call("block_bytes", req_id, n_blocks)

    def shutdown(self, timeout: float = 30.0) -> None:
        self.stop(("shutdown",), timeout)


def _wait(predicate: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.005)


def _settle(engine: Any, timeout_s: float) -> dict[str, int]:
    leader = engine.leader
    engine.run_until_idle(timeout_s=timeout_s)
    if leader.shared_enabled or leader._shared.settings is not None:
        _wait(lambda: leader._shared.agent is not None, "the shared-tier agent", timeout_s)
        _wait(lambda: leader.stats()["shared_writes_inflight"] == 0, "the write-throughs",
              timeout_s)
        agent = leader._shared.agent
        ticket = agent.wake()
        _wait(lambda: agent.stats()["wakes_handled"] >= ticket
              and agent.stats()["pending"] == 0, "the agent's checks", timeout_s)
    leader.publish_now()
    out = dict(leader.stats())
    consolidator, sink = leader.consolidator, leader.event_sink
    if consolidator is not None and sink is not None:
        def upstream_done() -> bool:  # every GPU-tier batch reached the consolidator, applied
            st = sink.stats()
            if st["publisher_batches_accepted"] != (st["publisher_batches_published"]
                                                    + st["publisher_lost_batches"]):
                return False
            cons = consolidator.stats()
            return cons["messages_received"] + cons["replayed_batches"] >= \
                st["publisher_batches_published"] and consolidator.wait_idle(0)

        _wait(upstream_done, "the consolidator to apply every batch", timeout_s)
        out["consolidated_batches_out"] = consolidator.stats()["batches_out"]
    return out


def _engine_main(conn: Any, config: dict[str, Any], stderr_path: str | None = None) -> None:
    """Child process: build the engine, then one command per message until shutdown. Counts
    what a run must not produce (``stats()["errors"]``): ERROR records of the plugin's
    loggers and exceptions that escaped a thread."""
    import logging
    import os
    import threading

    if stderr_path is not None:  # before torch or Mooncake is imported: all of it goes there
        log_fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log_fd, 2)
        os.close(log_fd)

    errors: list[str] = []

    class _Errors(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            errors.append(f"{record.name}: {record.getMessage()}"[:300])

    logging.getLogger("kvbm_plugin").addHandler(_Errors(level=logging.ERROR))
    previous_hook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        errors.append(f"thread {args.thread.name if args.thread else '?'}: "
                      f"{args.exc_type.__name__}: {args.exc_value}"[:300])
        previous_hook(args)

    threading.excepthook = hook
    engine = None
    try:
        from kvbm_plugin.testing.engine import EngineConfig, SimulatedEngine

        engine = SimulatedEngine(EngineConfig(**config))
        leader = engine.leader
        if leader._shared.settings is not None:
            _wait(lambda: leader._shared.agent is not None, "the shared-tier agent", 60.0)
        conn.send(("ok", {"env": engine.env}))
    except BaseException as exc:  # the parent raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        if engine is not None:
            engine.shutdown(10.0)
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            kind = msg[0]
            try:
                if kind == "run":
                    reply: Any = _run(engine, msg[1], msg[2])
                elif kind == "settle":
                    reply = _settle(engine, msg[1])
                elif kind == "stats":
                    reply = {"engine": vars(engine.stats()), "leader": engine.leader.stats(),
                             "ranks": [r.stats() for r in engine.ranks],
                             "resident": {k: {r: sorted(v) for r, v in per.items()}
                                          for k, per in engine.resident_blocks().items()},
                             "shared": sorted(engine.leader.resident_shared_hashes()),
                             "errors": list(errors)}
                elif kind == "block_bytes":
                    blocks = engine.block_ids(msg[1])[:msg[2]]
                    reply = [rank.block_bytes(blocks) for rank in engine.ranks]
                elif kind == "shutdown":
                    break
                else:
                    raise ValueError(f"unknown command {kind!r}")
                conn.send(("ok", reply))
            except BaseException as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        engine.shutdown(20.0)
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send(("ok", None))
        conn.close()


def _run(engine: Any, requests: list[list[Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Submit each request (one at a time: the match is measured per request), step until
    idle after each."""
    out = []
    leader = engine.leader
    for tokens, max_new, salt in requests:
        before = leader.stats()
        req = engine.submit(list(tokens), int(max_new), cache_salt=salt)
        engine.run_until_idle(timeout_s=timeout_s)
        after = leader.stats()
        result = engine.result(req)
        # (a request's last offloads may still be saving: it is released by a later pass)
        out.append({"request_id": req, "state": result.state,
                    "finished": result.state in ("done", "saving"),
                    "kv_mismatches": result.kv_mismatches, "gpu_hit": result.gpu_hit_tokens,
                    "tokens": list(result.tokens),
                    **{tier: after[f"matched_{tier}_tokens"] - before[f"matched_{tier}_tokens"]
                       for tier in ("host", "disk", "shared")}})
    return out
