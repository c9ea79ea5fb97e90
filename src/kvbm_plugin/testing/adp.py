"""A simulated TensorRT-LLM engine under attention DP: one executor per rank, ranks 1.. in
processes of their own.

Upstream, with ``enable_attention_dp`` every rank is its own MPI process running its own
``PyExecutor`` loop over its own requests, with its own KV cache manager and its own connector
leader and worker (``KvCacheConnectorManager(..., enable_attention_dp=True)``: no broadcast,
no allgather in ``get_finished``; ``connectors/kv_cache_connector.py`` @ 035ab91cad04). A
request goes to the rank its ``SchedulingParams.attention_dp_rank`` names (with
``attention_dp_relax=False``, as NVIDIA Dynamo's router sends it;
``tensorrt_llm/scheduling_params.py``, stored file id 67179638883), otherwise to the least
loaded rank. The ranks' loops advance together (their ``_can_queue`` is an allgather), and the
C++ KV event managers gather every rank's events onto rank 0 (``testing.kv_events``). With
TensorRT-LLM's own streaming publisher on (``kv_events_config``), nothing is gathered: each rank
publishes its own stream at its own endpoint, rank r at the tcp port + r or the ipc/inproc
path + ``_dp{r}`` (``StreamingKVCacheEventManager.offset_endpoint_port``,
``tensorrt_llm/_torch/pyexecutor/kv_cache_events.py`` @44004b3864a7, stored id 57357230020;
the same rule in the default version @13599e98c71c, stored id 71400586074), and each rank's
leader consolidates its own rank's stream (``events.trtllm_publisher.trtllm_streams``).

:class:`AttentionDpEngine` runs rank 0's :class:`~kvbm_plugin.testing.engine.SimulatedEngine`
in this process and every other rank's in a child (``processes=True``, spawn start method) or
here too; each rank's exchange thread sends its events to rank 0 (a ZMQ PUSH socket across
processes). Called from one thread (the caller's), like the single engine.
"""

from __future__ import annotations

import contextlib
import pickle
import shutil
import tempfile
import threading
import time
from dataclasses import fields, replace
from typing import Any

import zmq

from kvbm_plugin.testing.child import ChildProcess
from kvbm_plugin.testing.engine import (
    REQUEST_ID_STRIDE,
    EngineConfig,
    EngineStats,
    RequestResult,
    SimulatedEngine,
)
from kvbm_plugin.testing.kv_events import AttentionDpGather, pickled_sender

_REPLY_TIMEOUT_S = 120.0


def _gathers(manager: Any) -> bool:
    """Whether ``manager``'s events are gathered onto rank 0: the buffered C++ path
    (``SimKVCacheManager``), not TensorRT-LLM's per-rank stream (``SimStreamingKVCacheManager``,
    which has nothing to take)."""
    return hasattr(manager, "take_for_gather")


def _rank_view(engine: SimulatedEngine, name: str, args: tuple[Any, ...]) -> Any:
    """What the parent may ask of a rank's engine (by name), answered with plain data."""
    leader = engine.leader
    assert leader is not None
    if name == "leader_stats":
        return leader.stats()
    if name == "consolidator_stats":
        return None if leader.consolidator is None else leader.consolidator.stats()
    if name == "consolidator_idle":
        return leader.consolidator is None or leader.consolidator.wait_idle(args[0])
    if name == "publish_now":
        return leader.publish_now()
    if name == "flush_events":
        return leader.flush_events()
    if name == "event_source_status":
        return leader.event_source_status
    if name == "queue_reads":
        return engine.kv_cache_manager.reads
    if name == "gpu_wire_hashes":  # TensorRT-LLM's own stream: the names its GPU blocks have
        return engine.kv_cache_manager.resident_wire_hashes()
    if name == "stream_batches":
        return engine.kv_cache_manager.batches
    if name == "stream_names":  # every wire hash the rank's stream ever stored
        return engine.kv_cache_manager.published_hashes
    if name == "worker_saves_inflight":
        return sum(w.stats().get("saves_inflight", 0) for w in engine.workers)
    if name == "workers_idle":
        return all(w.idle() for w in engine.workers)
    if name == "submit":
        return engine.submit(args[0], args[1], cache_salt=args[2])
    if name == "step":  # (tokens computed, whether the rank has work after the pass)
        return engine.step(dummy=args[0]), engine.active()
    if name in ("state", "result", "stats", "active", "idle",
                "resident_blocks", "abort"):
        return getattr(engine, name)(*args)
    raise ValueError(f"unknown rank call {name!r}")


class _LocalDpRank:
    """A rank's engine in this process (rank 0, or every rank without processes)."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self._step_result: tuple[int, bool] = (0, False)

    def call(self, name: str, *args: Any) -> Any:
        return _rank_view(self.engine, name, args)

    def start_step(self, dummy: bool) -> None:
        self._step_result = _rank_view(self.engine, "step", (dummy,))

    def finish_step(self) -> tuple[int, bool]:
        return self._step_result

    def shutdown(self, timeout: float) -> None:
        self.engine.shutdown(timeout)


class _RemoteDpRank(ChildProcess):
    """A rank's engine in a child process; the same interface as :class:`_LocalDpRank`."""

    def __init__(self, config: EngineConfig, gather_endpoint: str) -> None:
        self.rank = config.dp_rank
        super().__init__(f"dp rank {self.rank} process", _dp_rank_main,
                         (config, gather_endpoint), name=f"sim-dp-rank-{self.rank}",
                         daemon=True, reply_timeout_s=_REPLY_TIMEOUT_S)

    def wait_ready(self) -> None:
        self.reply()

    def call(self, name: str, *args: Any) -> Any:
        return super().call(name, args)

    def start_step(self, dummy: bool) -> None:
        self.send("step", (dummy,))

    def finish_step(self) -> tuple[int, bool]:
        computed, active = self.reply()
        return int(computed), bool(active)

    def shutdown(self, timeout: float) -> None:
        self.stop(("shutdown", (timeout,)), timeout + 5)


def _dp_rank_main(conn: Any, config: EngineConfig, gather_endpoint: str) -> None:
    """Child process: rank ``config.dp_rank``'s whole executor (engine, leader, worker,
    consolidator) and its exchange thread to rank 0; one call per message until shutdown."""
    engine = gather = push = None
    ctx = zmq.Context()
    try:
        engine = SimulatedEngine(config)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(gather_endpoint)
        if _gathers(engine.kv_cache_manager):
            gather = AttentionDpGather(engine.kv_cache_manager, pickled_sender(push))
        conn.send(("ok", None))
    except BaseException as exc:  # the parent raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        if engine is not None:
            engine.shutdown(5.0)
        ctx.destroy(0)
        return
    while True:
        try:
            name, args = conn.recv()
        except EOFError:
            break
        try:
            if name == "shutdown":
                if gather is not None:
                    gather.stop(args[0])
                engine.shutdown(args[0])
                conn.send(("ok", None))
                break
            if name == "gather_snapshot":
                reply: Any = (0, 0) if gather is None else gather.snapshot()
            elif name == "stop_gather":
                if gather is not None:
                    gather.stop(args[0])
                reply = 0 if gather is None else gather.sent
            else:
                reply = _rank_view(engine, name, args)
            conn.send(("ok", reply))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    if push is not None:
        push.close()
    ctx.term()
    conn.close()


class AttentionDpEngine:
    """``config.attention_dp`` ranks, each its own :class:`SimulatedEngine` (tp_size 1) with
    its own leader, worker, tiers and consolidator; ranks 1.. in child processes with
    ``config.processes``. Rank r's request ids start at ``1 + r * REQUEST_ID_STRIDE``."""

    GATHER_PERIOD_S = 0.005  # KvCacheConfig.attention_dp_events_gather_period_ms default

    def __init__(self, config: EngineConfig) -> None:
        n = config.attention_dp
        if n < 2:
            raise ValueError(f"AttentionDpEngine needs attention_dp >= 2, got {n}")
        self.config = config
        self.size = n
        self._tmp = tempfile.mkdtemp(prefix="kvbm-sim-adp-")
        self._closed = False
        self._ctx: zmq.Context | None = None
        self._pull: Any = None
        self._receiver: threading.Thread | None = None
        self._gathers: list[AttentionDpGather] = []
        self._received = 0  # events rank 0 got from the other ranks' processes
        per_rank = [replace(config, dp_rank=r, processes=False) for r in range(n)]
        self.ranks: list[_LocalDpRank | _RemoteDpRank] = []
        remote: list[_RemoteDpRank] = []
        try:
            gather_endpoint = f"ipc://{self._tmp}/gather"
            if config.processes:
                self._ctx = zmq.Context()
                self._pull = self._ctx.socket(zmq.PULL)
                self._pull.setsockopt(zmq.LINGER, 0)
                self._pull.bind(gather_endpoint)
                remote = [_RemoteDpRank(c, gather_endpoint) for c in per_rank[1:]]
            self.rank0 = SimulatedEngine(per_rank[0])
            self.ranks.append(_LocalDpRank(self.rank0))
            if config.processes:
                for rank in remote:
                    rank.wait_ready()
                self.ranks.extend(remote)
                self._receiver = threading.Thread(target=self._receive, daemon=True,
                                                  name="sim-adp-gather-receiver")
                self._receiver.start()
            else:
                for c in per_rank[1:]:
                    engine = SimulatedEngine(c)
                    self.ranks.append(_LocalDpRank(engine))
                    if not _gathers(engine.kv_cache_manager):
                        continue  # TensorRT-LLM's per-rank stream: nothing goes to rank 0
                    self._gathers.append(AttentionDpGather(
                        engine.kv_cache_manager, self.rank0.kv_cache_manager.receive_gathered,
                        self.GATHER_PERIOD_S))
        except BaseException as exc:
            signalled = isinstance(exc, (KeyboardInterrupt, SystemExit))
            for rank in (*remote, *self.ranks):
                if signalled and isinstance(rank, _RemoteDpRank):
                    rank.kill()  # not after its bring-up: the caller ends on a signal
                else:
                    rank.shutdown(5.0)
            self._close_local()
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._where: dict[int, int] = {}  # request id -> dp rank
        self._busy = [False] * n  # each rank has work (as of its last pass or a submit)

    @property
    def workers(self) -> list[Any]:
        """Rank 0's workers (the others live in their processes)."""
        return self.rank0.workers

    @property
    def leader(self) -> Any:
        """Rank 0's leader (it publishes every rank's GPU-tier stream)."""
        return self.rank0.leader

    def _receive(self) -> None:
        """Rank 0's side of the exchange: append what the other ranks sent."""
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._closed:
            if not poller.poll(50):
                continue
            try:
                objects = pickle.loads(self._pull.recv(zmq.NOBLOCK))
            except zmq.ZMQError:
                continue
            self.rank0.kv_cache_manager.receive_gathered(objects)
            self._received += len(objects)

    # ------------------------------------------------------------------ public API

    def submit(self, prompt_tokens: list[int], max_new_tokens: int = 1, *,
               cache_salt: str | None = None, dp_rank: int | None = None) -> int:
        """Queue a request on ``dp_rank`` (``SchedulingParams.attention_dp_rank``, strict), or
        on the rank with the fewest live requests; returns its id."""
        if dp_rank is None:
            loads = [sum(1 for r in self._where.values() if r == rank)
                     for rank in range(self.size)]
            dp_rank = loads.index(min(loads))
        if not 0 <= dp_rank < self.size:
            raise ValueError(f"dp_rank={dp_rank} is not one of the {self.size} ranks")
        req_id = int(self.ranks[dp_rank].call("submit", prompt_tokens, max_new_tokens,
                                              cache_salt))
        self._where[req_id] = dp_rank
        self._busy[dp_rank] = True
        return req_id

    def rank_of(self, req_id: int) -> int:
        return req_id // REQUEST_ID_STRIDE

    def step(self) -> int:
        """One pass of every rank's loop, concurrently (other processes first). While any rank
        has work every rank runs the pass, an idle one with a dummy request (upstream's
        ``_pad_attention_dp_dummy_request``); with none the loops block."""
        dummy = any(self._busy)
        for rank in reversed(self.ranks):
            rank.start_step(dummy)
        results = [rank.finish_step() for rank in self.ranks]
        self._busy = [active for _, active in results]
        return sum(computed for computed, _ in results)

    def state(self, req_id: int) -> str:
        state = str(self.ranks[self.rank_of(req_id)].call("state", req_id))
        if state == "done":
            self._where.pop(req_id, None)
        return state

    def result(self, req_id: int) -> RequestResult:
        return self.ranks[self.rank_of(req_id)].call("result", req_id)

    def abort(self, req_id: int) -> None:
        self.ranks[self.rank_of(req_id)].call("abort", req_id)

    def active(self) -> bool:
        return any(rank.call("active") for rank in self.ranks)

    def idle(self) -> bool:
        return all(rank.call("idle") for rank in self.ranks)

    def call(self, dp_rank: int, name: str, *args: Any) -> Any:
        """Ask rank ``dp_rank``'s engine (see ``_rank_view`` for the names)."""
        return self.ranks[dp_rank].call(name, *args)

    def stats(self) -> EngineStats:
        total = EngineStats()
        for rank in self.ranks:
            s = rank.call("stats")
            for f in fields(EngineStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        return total

    def resident_blocks(self) -> dict[str, dict[int, set[int]]]:
        out: dict[str, dict[int, set[int]]] = {"GPU": {}, "CPU": {}, "DISK": {}}
        for rank in self.ranks:
            for medium, per_rank in rank.call("resident_blocks").items():
                out[medium].update(per_rank)
        return out

    def gathered(self) -> bool:
        """Every event another rank made readable so far has reached rank 0's queue (one
        check; the exchange threads run on their own period)."""
        if not _gathers(self.rank0.kv_cache_manager):
            return True  # each rank streams its own events: nothing is gathered
        if self._gathers:
            return all(g.snapshot()[0] == 0 for g in self._gathers) \
                and sum(g.sent for g in self._gathers) == self.rank0.kv_cache_manager.gathered_in
        snapshots = [rank.call("gather_snapshot") for rank in self.ranks[1:]]
        return all(readable == 0 for readable, _ in snapshots) \
            and sum(sent for _, sent in snapshots) == self._received

    def run_until_idle(self, *, timeout_s: float = 60.0) -> None:
        """Step until no rank has work, then until every transfer is reported (each rank's
        keeper applies them); raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while self.active() and time.monotonic() < deadline:
            if self.step() == 0:
                time.sleep(0.0005)  # nothing to compute: waiting for transfer threads
        while time.monotonic() < deadline:
            if self.idle():
                return
            time.sleep(0.001)  # the leaders' keeper threads apply the reports
        raise TimeoutError(f"attention-DP engine not idle after {timeout_s}s")

    def _close_local(self) -> None:
        self._closed = True
        for g in self._gathers:
            g.stop(5.0)
        if self._receiver is not None:
            self._receiver.join(5.0)
        if self._pull is not None:
            self._pull.close()
        if self._ctx is not None:
            self._ctx.term()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Other ranks first (their last events reach rank 0), then rank 0. Also after an
        interrupted step (Ctrl-C in the caller): a rank process that cannot hand over its
        last events is stopped anyway, and the temporary directory is always removed."""
        if self._closed:
            return
        try:
            if self._receiver is not None:
                sent = 0
                for rank in self.ranks[1:]:
                    # A rank gone or stuck hands nothing over: its stop below kills it.
                    with contextlib.suppress(RuntimeError, TimeoutError):
                        sent += int(rank.call("stop_gather", timeout))
                deadline = time.monotonic() + timeout
                while self._received < sent and time.monotonic() < deadline:
                    time.sleep(0.005)  # the receiver thread appends them to rank 0's queue
            for rank in self.ranks[1:]:
                rank.shutdown(timeout)
            self._close_local()
            if self.ranks:
                self.ranks[0].shutdown(timeout)
        finally:
            self._closed = True
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> AttentionDpEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
