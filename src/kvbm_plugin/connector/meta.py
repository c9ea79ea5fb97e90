"""What the leader tells the workers each iteration, and how workers tell the leader back.

Leader → workers: :class:`ConnectorMetadata`, built by ``KvbmConnectorLeader.build_connector_meta``
on rank 0, pickled and broadcast by TensorRT-LLM, bound on every rank. It is the *only* way a
worker learns of tier slots: every rank applies the same ops to the same slots, each on its own
head shard. It is small: tuples of ints, one per block moved. The per-block records
(:class:`LoadCopy`, :class:`SaveOp`, :class:`DemoteOp`, :class:`SharedSaveOp`, and the
workers' :class:`OpReport`) are named tuples, at about a third of a frozen dataclass's cost to
make and to pickle: the ops are made on the executor thread once per block (a planner run's
saves and write-throughs once per run: :class:`SaveOpRun`, :class:`SharedSaveOpRun`) and
pickled with the metadata where TensorRT-LLM broadcasts it, the reports once per block and
rank.

Workers → leader: :class:`OpReport` ("op ``op_id`` finished on rank ``r``, ok or failed").
TensorRT-LLM's connector API has no path from workers back to the scheduler (``get_finished``
results are intersected by the runtime and never shown to the scheduler), yet the leader may
advertise a tier block only once its bytes are in the tier on *every* rank. So each op carries
an id, every rank reports it exactly once, and the leader applies the same rule TensorRT-LLM
applies to request ids in ``get_finished``: an op is done when all ranks reported it (the
intersection), and failed if any rank failed it. Reports travel through a
:class:`CompletionHub`: in-process (rank 0's worker, and every rank of the simulated engine)
or, for workers in other processes, a ZMQ PUSH → PULL channel to the leader's port.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from kvbm_plugin._util.ratelimit import RateLimitedLog

logger = logging.getLogger(__name__)

# Tier codes in the metadata (ints keep the pickle small).
HOST: Final = 1
DISK: Final = 2
SHARED: Final = 3  # the shared tier (worker/shared_io.py on the workers)
TIER_CODES: Final = {HOST: "host", DISK: "disk", SHARED: "shared"}

# Why an op failed (OpReport.error); CORRUPT makes the leader forget the source block.
ERR_NONE: Final = 0
ERR_FAILED: Final = 1
ERR_CORRUPT: Final = 2
ERR_DROPPED: Final = 3  # a shared-tier write dropped by a full write queue (counted apart)


# One of the records below built from its fields' tuple, every field given (defaults
# included): one C call, where calling the class runs NamedTuple's Python-level __new__
# (0.10 against 0.24 us; once per block on the leader's executor thread).
record = tuple.__new__


class LoadCopy(NamedTuple):
    """Copy one tier block into one device block (onboarding)."""

    op_id: int
    tier: int  # HOST, DISK or SHARED
    slot: int  # -1 for SHARED (the store names objects by key)
    key: int  # content key the slot must hold (disk files are checked against it); for
    # SHARED the first 8 bytes of ``digest`` (little-endian), for logs
    device_block: int
    digest: bytes | None = None  # SHARED: the 16-byte content digest in the object's key
    # Several KV layer groups: every group's page to write (-1: none there, never written);
    # () for a one-group model (``device_block`` is the page). leader/layer_groups.py
    pages: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadOp:
    """All onboarding of one request (``started_loading_req_ids`` in get_finished).

    ``copies`` may be empty: the worker still reports the request, so no id is left waiting.
    """

    req_id: int
    copies: tuple[LoadCopy, ...]


class SaveOp(NamedTuple):
    """Copy one device block into a tier slot after this iteration's forward pass."""

    op_id: int
    req_id: int
    device_block: int
    tier: int  # HOST, or DISK when there is no host tier
    slot: int
    key: int
    # Several KV layer groups: every group's page of the block, read into the slot group
    # after group; () for a one-group model. leader/layer_groups.py
    pages: tuple[int, ...] = ()


class DemoteOp(NamedTuple):
    """Copy host slot ``host_slot`` to disk slot ``disk_slot`` (a host eviction).

    Workers read the host slot before any save of the same metadata writes it, so the leader may
    hand the host slot to a new block in the same iteration.
    """

    op_id: int
    host_slot: int
    disk_slot: int
    key: int


class SharedSaveOp(NamedTuple):
    """Write one block through to the shared tier, under this rank's key for ``digest``.

    Either it rides in the metadata of the host :class:`SaveOp` ``after`` of the same block:
    each rank copies the device block into a staging buffer in the same copy batch as that host
    copy (a failed host copy fails this op too); or (``after`` -1) the block is resident in the
    host tier already: each rank copies host slot ``host_slot`` (which must hold ``host_key``)
    into staging when its transfer thread takes the metadata, before that metadata's saves may
    reuse the slot. The rank's writer thread puts the staged bytes. Reported once per rank,
    like every op."""

    op_id: int
    after: int  # the op_id of the host SaveOp of the same block in this metadata, or -1
    device_block: int  # -1 when staged from the host slot
    digest: bytes
    host_slot: int = -1
    host_key: int = 0


class SaveOpRun(NamedTuple):
    """The :class:`SaveOp` s of a run of blocks the leader's planner reserved together, as one
    record (made once per run on the executor thread, and pickled with the metadata, not once
    per block): op ``first + k`` copies device block ``device_blocks[k]`` (``pages[k]``: every
    layer group's page, ``()`` for a one-group model, as each op's ``pages``) into slot
    ``slots[k]`` of tier ``tier`` under content key ``keys[k]``, for request ``req_id``. The
    workers count it per request at bind time and read it as its ops on their transfer
    thread (:func:`save_ops`)."""

    first: int
    req_id: int
    tier: int
    device_blocks: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...] = ()


def save_ops(items: tuple[SaveOp | SaveOpRun, ...]) -> list[SaveOp]:
    """``ConnectorMetadata.saves`` as one :class:`SaveOp` per block, a run's in order (every
    rank's transfer thread, :func:`ops_of`; tests)."""
    out: list[SaveOp] = []
    for item in items:
        if type(item) is SaveOpRun:
            first, req_id, tier = item.first, item.req_id, item.tier
            pages = item.pages or ((),) * len(item.device_blocks)
            out.extend(SaveOp(first + k, req_id, block, tier, slot, key, group_pages)
                       for k, (block, slot, key, group_pages) in enumerate(zip(
                           item.device_blocks, item.slots, item.keys, pages, strict=True)))
        else:
            out.append(item)
    return out


def save_count(item: SaveOp | SaveOpRun) -> int:
    """How many blocks one item of ``ConnectorMetadata.saves`` saves."""
    return len(item.device_blocks) if type(item) is SaveOpRun else 1


class SharedSaveOpRun(NamedTuple):
    """The :class:`SharedSaveOp` s of a run of host saves the leader's planner scheduled
    together, as one record (made once per run on the executor thread, not once per block):
    op ``first + k`` writes through the block of host :class:`SaveOp` ``after[k]``, copied
    from device block ``device_blocks[k]``, under ``digests[k]``. The workers read it as its
    ops (:func:`shared_save_ops`)."""

    first: int
    after: tuple[int, ...]
    device_blocks: tuple[int, ...]
    digests: tuple[bytes, ...]


def shared_save_ops(items: tuple[SharedSaveOp | SharedSaveOpRun, ...]) -> list[SharedSaveOp]:
    """``ConnectorMetadata.shared_saves`` as one :class:`SharedSaveOp` per block, a run's in
    order (every rank's transfer thread, :func:`ops_of`)."""
    out: list[SharedSaveOp] = []
    for item in items:
        if type(item) is SharedSaveOpRun:
            first = item.first
            out.extend(SharedSaveOp(first + k, after, block, digest)
                       for k, (after, block, digest) in enumerate(zip(
                           item.after, item.device_blocks, item.digests, strict=True)))
        else:
            out.append(item)
    return out


@dataclass(frozen=True, slots=True)
class TierLayout:
    """Tier sizes every rank must use; identical in every metadata of one leader."""

    host_blocks: int
    disk_blocks: int
    disk_dir: str | None


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """One iteration's instructions for every worker (picklable, broadcast by TRT-LLM)."""

    iteration: int
    layout: TierLayout
    loads: tuple[LoadOp, ...] = ()
    demotes: tuple[DemoteOp, ...] = ()  # executed before ``saves`` on every rank
    saves: tuple[SaveOp | SaveOpRun, ...] = ()  # a planner run's as one SaveOpRun
    # Requests TensorRT-LLM terminated without telling the connector (a cancel; upstream frees
    # their blocks at once, even during an async load, and may hand them to another request):
    # every rank drops their unstarted copies into device blocks and waits, in
    # bind_connector_meta, for the started ones, before this iteration's forward or loads.
    fences: tuple[int, ...] = ()
    # Each follows one of ``saves`` or is staged from a resident host copy; a run's as one
    # SharedSaveOpRun (the workers read them with shared_save_ops)
    shared_saves: tuple[SharedSaveOp | SharedSaveOpRun, ...] = ()

    def is_empty(self) -> bool:
        return not (self.loads or self.demotes or self.saves or self.fences
                    or self.shared_saves)


def ops_of(meta: ConnectorMetadata) -> ConnectorMetadata:
    """``meta`` with its saves and write-throughs one op per block (:func:`save_ops`,
    :func:`shared_save_ops`): the worker's transfer thread, before it runs a save job (what
    reads the job after that sees ops only)."""
    if not any(type(op) is SaveOpRun for op in meta.saves) \
            and not any(type(op) is SharedSaveOpRun for op in meta.shared_saves):
        return meta
    return dataclasses.replace(meta, saves=tuple(save_ops(meta.saves)),
                               shared_saves=tuple(shared_save_ops(meta.shared_saves)))


_META_SETTERS: Final = tuple(getattr(ConnectorMetadata, name).__set__ for name in (
    "iteration", "layout", "loads", "demotes", "saves", "fences", "shared_saves"))


def make_meta(iteration: int, layout: TierLayout, loads: tuple[LoadOp, ...],
              demotes: tuple[DemoteOp, ...], saves: tuple[SaveOp | SaveOpRun, ...],
              fences: tuple[int, ...],
              shared_saves: tuple[SharedSaveOp | SharedSaveOpRun, ...]) -> ConnectorMetadata:
    """``ConnectorMetadata(...)`` of every field, without the frozen dataclass's
    ``object.__setattr__`` per field (0.6 against 1.4 us warm; the leader's executor thread,
    once per iteration)."""
    meta = object.__new__(ConnectorMetadata)
    s0, s1, s2, s3, s4, s5, s6 = _META_SETTERS
    s0(meta, iteration)
    s1(meta, layout)
    s2(meta, loads)
    s3(meta, demotes)
    s4(meta, saves)
    s5(meta, fences)
    s6(meta, shared_saves)
    return meta


class OpReport(NamedTuple):
    """Op ``op_id`` reached a terminal state on rank ``rank``."""

    op_id: int
    rank: int
    ok: bool
    error: int = ERR_NONE
    signature: tuple[int, int] | None = None  # disk writes: (size, mtime_ns) of the file


class ReportBatch(NamedTuple):
    """One rank's reports of a copy batch as one completion-hub item: op ``op_ids[i]`` ended
    ok where ``oks[i]``, else failed with ERR_FAILED; none carries a signature. Made by
    :meth:`CompletionHub.put_batch` and :meth:`CompletionHub.put_many` (never on the wire:
    the cross-process channel sends each :class:`OpReport`), so that the leader folds a run
    of consecutive op ids in one step."""

    rank: int
    op_ids: list[int]
    oks: list[bool]

    def reports(self) -> list[OpReport]:
        rank = self.rank
        return [OpReport(op_id, rank, ok, ERR_NONE if ok else ERR_FAILED)
                for op_id, ok in zip(self.op_ids, self.oks, strict=True)]


def encode_report(report: OpReport) -> bytes:
    """Wire form of a report on the cross-process channel: a msgpack array, never pickle (the
    leader's PULL socket accepts connections from other hosts; unpickling would run their
    code)."""
    import msgpack

    sig = None if report.signature is None else list(report.signature)
    return msgpack.packb([report.op_id, report.rank, report.ok, report.error, sig])


def decode_report(data: bytes) -> OpReport:
    """Inverse of :func:`encode_report`; ValueError naming the message for anything else."""
    import msgpack

    try:
        op_id, rank, ok, error, sig = msgpack.unpackb(data)
        ints = (op_id, rank, error) if sig is None else (op_id, rank, error, *sig)
        if not all(type(v) is int for v in ints) or type(ok) is not bool or (
                sig is not None and len(sig) != 2):
            raise ValueError
    except Exception:
        raise ValueError(f"malformed completion report {data[:64]!r}") from None
    return OpReport(op_id, rank, ok, error, None if sig is None else (sig[0], sig[1]))


@dataclass
class CompletionHub:
    """Where workers drop :class:`OpReport` s and the leader drains them.

    ``put`` is called from worker transfer/disk threads (and the ZMQ receive thread), ``drain``
    from the leader on the executor thread; neither blocks (an unbounded SimpleQueue: its size is
    bounded by the number of ops in flight, which the tier capacities bound).
    """

    key: str
    # Items are single reports, or a batch's reports as one ReportBatch (one rank's, with no
    # signature and no error but ERR_FAILED) or else one list (one hand-off per batch).
    _queue: queue.SimpleQueue[OpReport | ReportBatch | list[OpReport]] = field(
        default_factory=queue.SimpleQueue)
    # Called after each hand-off, on the handing thread (the leader's keeper's nudge: it
    # applies the reports off the executor thread). Must not block or raise.
    on_put: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        # Whether nothing was handed off since the last take: the queue's own (C) method,
        # asked by the leader's hooks first (most find nothing; no Python frame for that).
        self.empty = self._queue.empty

    def put(self, report: OpReport) -> None:
        self._queue.put(report)
        on_put = self.on_put  # (read once: shutdown clears it from another thread)
        if on_put is not None:
            on_put()

    def put_batch(self, rank: int, op_ids: list[int], oks: list[bool]) -> None:
        """Rank ``rank``'s copy batch: op ``op_ids[i]`` ended ok where ``oks[i]`` (else
        ERR_FAILED)."""
        if op_ids:
            self._queue.put(ReportBatch(rank, op_ids, oks))
            on_put = self.on_put  # (read once: shutdown clears it from another thread)
            if on_put is not None:
                on_put()

    def put_many(self, reports: list[OpReport]) -> None:
        """Reports handed off together (a copy batch's, the cross-process receiver's turn):
        one ReportBatch per rank where none carries a signature or an error but ERR_FAILED
        (a fold does not depend on the order of different ranks' reports), else one list."""
        if not reports:
            return
        batches: dict[int, ReportBatch] = {}
        for r in reports:
            if r.signature is not None or r.error != (ERR_NONE if r.ok else ERR_FAILED):
                self._queue.put(reports)
                break
            batch = batches.get(r.rank)
            if batch is None:
                batch = batches[r.rank] = ReportBatch(r.rank, [], [])
            batch.op_ids.append(r.op_id)
            batch.oks.append(r.ok)
        else:
            for batch in batches.values():
                self._queue.put(batch)
        on_put = self.on_put  # (read once: shutdown clears it from another thread)
        if on_put is not None:
            on_put()

    def take(self) -> list[OpReport | ReportBatch | list[OpReport]]:
        """Every item handed off so far, as handed off (the leader's fold, under its lock)."""
        # One consumer: what empty() saw stays there for get_nowait(). Checked first, not
        # caught: most calls find nothing, and a raised queue.Empty cost each of them
        # ~0.3 us more (several calls per iteration).
        out: list[OpReport | ReportBatch | list[OpReport]] = []
        q = self._queue
        while not q.empty():
            out.append(q.get_nowait())
        return out

    def drain(self) -> list[OpReport]:
        """Every report handed off so far, one by one (:meth:`take`, batches spread)."""
        out: list[OpReport] = []
        for item in self.take():
            if type(item) is ReportBatch:
                out.extend(item.reports())
            elif isinstance(item, list):
                out.extend(item)
            else:
                out.append(item)
        return out


_hubs: dict[str, CompletionHub] = {}
_layouts: dict[str, tuple[int, int]] = {}  # group -> (device blocks, bytes per block) of rank 0
_shared_layouts: dict[str, Any] = {}  # group -> rank 0's SharedLayout (tiers.shared.keys)
_registry_lock = threading.Lock()


def open_hub(key: str) -> CompletionHub:
    """Create (leader) the in-process hub for ``key``; refuses a second live leader."""
    with _registry_lock:
        if key in _hubs:
            raise RuntimeError(f"a KvbmConnectorLeader for group {key!r} already exists in "
                               "this process; shut it down first")
        hub = _hubs[key] = CompletionHub(key)
        return hub


def close_hub(key: str) -> None:
    with _registry_lock:
        _hubs.pop(key, None)
        _layouts.pop(key, None)
        _shared_layouts.pop(key, None)


def find_hub(key: str) -> CompletionHub | None:
    """The in-process hub for ``key`` (None: the leader lives in another process)."""
    with _registry_lock:
        return _hubs.get(key)


def publish_pool_layout(key: str, num_blocks: int, bytes_per_block: int) -> None:
    """Rank 0's worker tells an in-process leader the device pool's block size."""
    with _registry_lock:
        _layouts[key] = (num_blocks, bytes_per_block)


def pool_layout(key: str) -> tuple[int, int] | None:
    with _registry_lock:
        return _layouts.get(key)


def publish_shared_layout(key: str, layout: Any) -> None:
    """Rank 0's worker tells an in-process leader the shared-tier key layout of its shard
    (``tiers.shared.keys.SharedLayout``: page bytes, dtype), from which the leader derives
    every rank's keys (``for_rank``): the same page size on every TP rank."""
    with _registry_lock:
        _shared_layouts[key] = layout


def shared_layout(key: str) -> Any:
    """Rank 0's published SharedLayout, or None."""
    with _registry_lock:
        return _shared_layouts.get(key)


REPORT_MAX_BYTES = 512  # a report's wire form is under 100 bytes (encode_report)
REPORT_HWM = 128  # reports queued per connection (the sender keeps the rest: SNDHWM 0)
REPORTS_PER_TURN = 256  # reports read per wake-up of the receiver thread


class ZmqReportReceiver:
    """Leader side of the cross-process report channel: a PULL socket on its own thread.

    The thread creates, uses and closes the socket; received reports go into the hub.
    """

    def __init__(self, hub: CompletionHub, bind: str) -> None:
        import zmq

        from kvbm_plugin.consolidator_config import load_max_peers

        self._hub = hub
        self._bind = bind
        self._max_peers = load_max_peers()  # ConfigError names the variable, on the caller
        self.malformed = 0  # dropped messages (the leader's stats() shows them)
        self._log = RateLimitedLog(logger)  # anyone can reach the port: no log storm
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._zmq = zmq
        self._thread = threading.Thread(target=self._run, name="kvbm-report-recv", daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0):
            self._stop.set()
            raise RuntimeError(f"report receiver did not bind {bind} within 10 s")
        if self._error is not None:
            raise RuntimeError(f"report receiver cannot bind {bind}: {self._error}")

    def _run(self) -> None:
        zmq = self._zmq
        from kvbm_plugin.wire.listen_brake import MAX_BEHIND
        from kvbm_plugin.wire.peers import PeerCap, limit_receive_buffer
        from kvbm_plugin.wire.reconnect import keep_alive

        sock = zmq.Context.instance().socket(zmq.PULL)
        cap = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # What anyone who reaches the port can make this hold: a report is a few dozen
            # bytes (encode_report), so larger messages drop their connection in libzmq, at
            # most REPORT_HWM wait per connection, and DYN_KVBM_ZMQ_MAX_PEERS connections.
            sock.setsockopt(zmq.MAXMSGSIZE, REPORT_MAX_BYTES)
            sock.setsockopt(zmq.RCVHWM, REPORT_HWM)
            # A connection gone silent (a rank's host gone without a word) is dropped, not
            # kept for ever towards DYN_KVBM_ZMQ_MAX_PEERS (the ranks' sockets likewise).
            keep_alive(sock)
            limit_receive_buffer(sock)
            # libzmq keeps a connection until its queued reports are read, however it was
            # cut: a churn of connections that queue reports and leave must not outrun this
            # thread. While more than MAX_BEHIND connections arrived since the socket was last
            # read empty, new ones are held off (the kernel drops their attempts; the ranks'
            # PUSH sockets retry and keep their reports meanwhile). A connection that gets in
            # anyway is cut: what a rank connecting just then had sent on it is lost (its
            # established connection is never touched), and the leader fails such ops after
            # leader/op_completions.py's REPORT_DEADLINE_S.
            cap = PeerCap("report receiver", sock, self._max_peers, max_unread=MAX_BEHIND)
            sock.bind(self._bind)
        except zmq.ZMQError as exc:
            self._error = exc
            if cap is not None:
                cap.close()
            sock.close(0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(cap.signal_fd, zmq.POLLIN)  # connection events: a turn frees them
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                cap.drain()
                turn: list[OpReport] = []  # handed off together: the leader folds a batch
                for _ in range(REPORTS_PER_TURN):
                    try:
                        report = decode_report(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        cap.caught_up()
                        break
                    except (ValueError, zmq.ZMQError) as exc:  # must not kill the channel
                        self.malformed += 1
                        self._log.log(logging.ERROR, "malformed", "dropping a completion "
                                      "report: %s", exc)
                        continue
                    turn.append(report)
                self._hub.put_many(turn)
        finally:
            cap.close()
            sock.close(0)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("report receiver thread did not stop within %.1f s", timeout)


# How long a closing rank waits for its last reports to reach the leader (a leader that is gone
# or unreachable: they are lost after this, with a warning).
REPORT_DELIVERY_TIMEOUT_S = 10.0


class ZmqReportSender:
    """Worker side of the cross-process channel; used from one worker thread at a time.

    Owns its ZMQ context, so that :meth:`close` can wait until the reports are delivered: a
    rank process exits right after its worker shut down, and pyzmq does not terminate the
    shared context at interpreter exit, so a socket's linger would not be waited for and the
    last reports (or all of them, when the connection was not up yet) would be lost.
    """

    def __init__(self, connect: str) -> None:
        import zmq

        from kvbm_plugin.wire.reconnect import keep_alive

        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # reports must not be dropped
        # A connection gone silent is dropped and made again (wire/reconnect.py): reports
        # written into it until TCP gave up, some 15 minutes, would be lost (the leader fails
        # such ops after leader/op_completions.py's REPORT_DEADLINE_S).
        keep_alive(self._sock)
        self._sock.connect(connect)
        self._connect = connect
        self._lock = threading.Lock()

    def put(self, report: OpReport) -> None:
        with self._lock:
            self._sock.send(encode_report(report))

    def put_many(self, reports: list[OpReport]) -> None:
        with self._lock:
            for report in reports:
                self._sock.send(encode_report(report))

    def close(self, timeout: float = REPORT_DELIVERY_TIMEOUT_S) -> None:
        """Wait until every report sent reached the leader's socket, at most ``timeout``
        seconds (then the rest is dropped, with a warning), and release the socket and its
        context. Called by the worker's shutdown; idempotent."""
        with self._lock:
            if self._ctx.closed:
                return
            began = time.monotonic()
            self._sock.close(linger=max(0, int(timeout * 1000)))
            self._ctx.term()  # returns once the queue is delivered or the linger ran out
            # Whole milliseconds on ZMQ's clock: the linger may end a little before ours.
            if time.monotonic() - began >= timeout - 0.05:
                logger.warning("completion reports not delivered to %s within %.1f s may be "
                               "lost", self._connect, timeout)
