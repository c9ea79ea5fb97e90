"""KvbmConnectorWorker: TensorRT-LLM's connector worker; one per rank, moves the bytes.

Every method below is called by TensorRT-LLM's ``KvCacheConnectorManager`` on the rank's
executor (event-loop) thread, in this order per iteration:

* ``bind_connector_meta(meta)``: the leader's :class:`~kvbm_plugin.connector.meta.ConnectorMetadata`
  for this iteration (same object on every rank).
* ``start_load_kv(stream)``: enqueue onboarding (host → device, disk → host staging → device).
* ``wait_for_layer_load`` / ``save_kv_layer`` per decoder layer (forward hooks, enqueue time).
* the forward-pass callable (end of the forward, on the forward stream): record an event and
  enqueue this iteration's offloads behind it.
* ``wait_for_save(stream)``: nothing to wait for; saves are asynchronous and tracked per request.
* ``get_finished(saving_ids, loading_ids)``: requests whose transfers reached a terminal state.

The executor thread only records CUDA events and enqueues jobs. A transfer thread issues the
copies (whole blocks, contiguous runs coalesced into one copy, on a side stream that waits on the
forward's event); on CUDA a completion thread sleeps on each batch's event (blocking sync, no
polling) and reports it the moment it fires, while the transfer thread fails any batch still
unfinished after ``OP_TIMEOUT_S``; a disk thread reads, verifies and writes block files. None
ever makes the executor thread wait. The shared tier's writer and reader threads are in
connector/shared_io.py. Every op reaches a terminal state (done, failed, or timed
out) and is reported once to the leader (see connector/meta.py), and every request id passed to
``get_finished`` is eventually returned.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvbm_plugin._util.plugins import TIERS_GROUP, get_plugin
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector.copy_runs import chunked as _chunked
from kvbm_plugin.connector.copy_runs import count_down as _count_down
from kvbm_plugin.connector.copy_runs import runs as _runs
from kvbm_plugin.connector.disk_jobs import DiskJobs
from kvbm_plugin.connector.layer_group_worker import LayerGroupWorker
from kvbm_plugin.connector.layer_groups import refuse_unsupported as _refuse_layer_groups
from kvbm_plugin.connector.load_errors import LoadErrors
from kvbm_plugin.connector.meta import (
    DISK,
    ERR_FAILED,
    ERR_NONE,
    HOST,
    SHARED,
    ConnectorMetadata,
    DemoteOp,
    LoadCopy,
    LoadOp,
    OpReport,
    SaveOp,
    SharedSaveOp,
    TierLayout,
    ZmqReportSender,
    find_hub,
    publish_pool_layout,
    publish_shared_layout,
)
from kvbm_plugin.connector.metrics import get_metrics
from kvbm_plugin.connector.shared_io import SharedIO
from kvbm_plugin.connector.trtllm_compat import KvCacheConnectorWorker, has_layer_group_api
from kvbm_plugin.consolidator_config import load_tier_settings
from kvbm_plugin.tiers.base import OffloadTier, TierSpec
from kvbm_plugin.tiers.copies import HostCopier
from kvbm_plugin.wire.events import MEDIUM_CPU

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
# Failures that can repeat once per block (a full or failing disk): one line per interval each.
_repeating = RateLimitedLog(logger)

OP_TIMEOUT_S = 60.0  # an op whose copy has not completed by then is failed (GPU hang, etc.)
LOAD_ORPHAN_TIMEOUT_S = 120.0  # a loading id with no LoadOp seen is returned after this
COPY_BATCH_BYTES = 64 << 20  # host copies complete and report in batches of about this size



class KvbmConnectorWorker(DiskJobs, LoadErrors, LayerGroupWorker,  # type: ignore[misc]
                          KvCacheConnectorWorker):  # type: ignore[misc, valid-type]
    """Worker-side connector; runs on every rank, holds this rank's head shard of each block."""

    # Attention DP: transfers, endpoints and reports are the rank's own (its leader waits for
    # it alone; connectors/kv_cache_connector.py @ 035ab91cad04, validate_attention_dp).
    supports_attention_dp = True

    def __init__(self, llm_args: Any) -> None:
        """Called once per rank on a thread-pool thread, concurrently with the leader's
        constructor on rank 0. Reads settings only; allocates nothing until
        ``register_kv_caches``; never waits on the leader."""
        super().__init__(llm_args)
        self._env = _llm_args.env_of(llm_args)
        _refuse_layer_groups(llm_args, self._env, has_layer_group_api())
        self._metrics = get_metrics()
        self._par = _llm_args.parallel_of(llm_args)
        self._rank = self._par.tp_rank  # in its group (attention DP: rank 0 of its own)
        self._group = _llm_args.group_of(llm_args, self._env)
        self._tier_settings = load_tier_settings(self._env)
        self._block_size = _llm_args.block_size_of(llm_args)
        self._disk_identity = _llm_args.disk_identity(llm_args, self._block_size,
                                                      self._par.tp_size)
        self._pool: torch.Tensor | None = None
        # One view per block of the device pool and of the host tier, made once: building two
        # views per copied block on every batch cost ~2 us per block on the transfer thread.
        self._pool_blocks: tuple[torch.Tensor, ...] = ()
        self._host_blocks: tuple[torch.Tensor, ...] = ()
        self._cuda = False
        self._host: OffloadTier | None = None
        self._disk: OffloadTier | None = None
        self._layout: TierLayout | None = None
        self._side_stream: Any = None
        self._disk_stream: Any = None
        self._disk_staging: torch.Tensor | None = None
        self._lock = threading.Lock()
        # Per request, under _lock: saves not yet terminal, loads not yet terminal.
        self._save_inflight: dict[int, int] = {}
        self._load_inflight: dict[int, int] = {}
        self._loads_done: set[int] = set()
        self._fenced: set[int] = set()  # requests whose queued loads must never write
        self._writing: dict[int, int] = {}  # request -> its copies writing device blocks now
        self._save_waiting: set[int] = set()  # ids given as finished_gen_req_ids
        self._load_waiting: dict[int, float] = {}  # ... as started_loading_req_ids, since
        self._pending_save_meta: ConnectorMetadata | None = None  # bound, saves not enqueued
        self._reporter: Any = None
        self._report_warned = False
        self._jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._disk_jobs: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        # CUDA copy batches in flight, in issue order: the completion thread waits on their
        # events; whoever pops a batch's entry here (completion, or the transfer thread's
        # timeout) finishes it, exactly once. Under _lock.
        self._copies: dict[int, tuple[float, Callable[[bool], None]]] = {}
        self._completions: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._copy_ids = itertools.count()
        self._host_copier: HostCopier | None = None
        self._copy_batch_blocks = 0  # 0: a job's host copies are one batch
        # Each thread with what tells it to stop (None: another thread's stop ends it).
        self._threads: list[tuple[threading.Thread, Callable[[], None] | None]] = []
        self._closed = False
        self._stats = {"bytes_offloaded": 0, "bytes_onboarded": 0, "bytes_demoted": 0,
                       "blocks_offloaded": 0, "blocks_onboarded": 0, "blocks_demoted": 0,
                       "ops_failed": 0, "corrupt_blocks": 0, "copies_issued": 0,
                       "jobs_failed": 0, "loads_fenced": 0, "load_error_blocks": 0}
        self._load_errors: set[int] = set()  # device blocks not loaded (connector/load_errors)
        self._block_bytes = 0
        self._shared: SharedIO | None = None  # the shared tier's I/O (connector/shared_io.py)
        self._last_layer = -1  # the forward's last layer (save_kv_layer enqueues there)
        self._tier_shape: tuple[int, ...] = ()  # a tier slot's shape and dtype (_start_tiers)

    # ------------------------------------------------------------------ bring-up

    def register_forward_pass_callable(self) -> Callable[[], None]:
        """Called once after construction; TRT-LLM invokes the callable at the end of every
        forward pass, on the forward stream. It records an event there and enqueues the
        iteration's offloads behind it (no host sync)."""
        return self._on_forward_done

    def register_kv_caches(self, kv_cache_tensor: torch.Tensor,
                           secondary_kv_cache_tensor: torch.Tensor | None = None) -> None:
        """Called once per rank on the main thread before the first iteration with the device
        pool ``[num_blocks, num_layers, kv_factor, tokens_per_block * heads * head_dim]``
        (this rank's heads). Allocates the host pool to match and starts the transfer threads.

        ``secondary_kv_cache_tensor`` (one upstream branch) is a staging pool for connectors
        that opt into persistence staging; this connector does not, and ignores it. The pool
        may be a strided view (KVCacheManagerV2's ``as_single_pool_tensor``: slot ``i`` at
        ``base + stride * i``) as long as each block's bytes are contiguous; any other layout
        is refused with its shape and strides named.
        """
        if kv_cache_tensor.dim() != 4:
            raise ValueError(f"{type(self).__name__}.register_kv_caches: expected a 4-D pool "
                             "[blocks, layers, kv_factor, block elements], got shape "
                             f"{tuple(kv_cache_tensor.shape)}")
        if not kv_cache_tensor.is_contiguous():
            block_elems = kv_cache_tensor[0].numel() if kv_cache_tensor.shape[0] else 0
            if not (kv_cache_tensor.shape[0] == 0 or kv_cache_tensor[0].is_contiguous()) \
                    or kv_cache_tensor.stride(0) < block_elems:
                raise ValueError(
                    f"{type(self).__name__}.register_kv_caches: unsupported pool layout: shape "
                    f"{tuple(kv_cache_tensor.shape)}, strides {kv_cache_tensor.stride()} "
                    "(elements). Supported: [blocks, layers, kv_factor, block elements] with "
                    "each block's bytes contiguous (strides (>= "
                    f"{block_elems}, {kv_cache_tensor.shape[2] * kv_cache_tensor.shape[3]}, "
                    f"{kv_cache_tensor.shape[3]}, 1)); a layer-major or otherwise interleaved "
                    "view cannot be offloaded block by block")
            logger.info("%s: KV pool is a strided view (block stride %d elements, block %d "
                        "elements): copies go block by block", type(self).__name__,
                        kv_cache_tensor.stride(0), block_elems)
        self._pool = kv_cache_tensor
        self._pool_blocks = kv_cache_tensor.unbind(0)
        self._last_layer = kv_cache_tensor.shape[1] - 1
        self._start_tiers(kv_cache_tensor, tuple(kv_cache_tensor.shape[1:]),
                          kv_cache_tensor.dtype, kv_cache_tensor.shape[0])

    def _start_tiers(self, pool: torch.Tensor, block_shape: tuple[int, ...],
                     dtype: torch.dtype, num_blocks: int) -> None:
        """The host tier, streams and threads for device blocks of ``block_shape`` (a tier
        slot's shape); ``pool`` gives the device (and, for one layer group, the shared tier's
        pages). Called once, from register_kv_caches or register_kv_cache_layout."""
        import torch

        self._cuda, self._tier_shape, self._tier_dtype = pool.is_cuda, block_shape, dtype
        self._block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        if self._rank == 0:
            publish_pool_layout(self._group, num_blocks, self._block_bytes)
        settings = self._tier_settings
        if settings.host_enabled:
            spec = TierSpec(settings.host_blocks(self._block_bytes), block_shape,
                            dtype, self._rank, pin_memory=self._cuda)
            self._host = get_plugin(TIERS_GROUP, "host")(spec)
            self._host_blocks = self._host.pool.unbind(0)  # type: ignore[attr-defined]
        if self._cuda:
            self._side_stream = torch.cuda.Stream(device=pool.device)
            self._disk_stream = torch.cuda.Stream(device=pool.device)
            # Each ~COPY_BATCH_BYTES batch completes and is reported on its own: the leader
            # hears of early blocks while later ones still copy, and the bookkeeping after the
            # last copy is one batch's, not the whole job's. (On CPU the copy is synchronous on
            # the transfer thread, so batches would only add hand-offs.)
            self._copy_batch_blocks = max(1, COPY_BATCH_BYTES // self._block_bytes)
        else:
            self._host_copier = HostCopier(torch.get_num_threads())
        self._disk_staging = torch.empty(block_shape, dtype=dtype, pin_memory=self._cuda)
        # Stop order = this order: the transfer thread first (the jobs it still runs may queue
        # disk writes, which the disk thread must see before its own stop); on its way out it
        # stops the completion thread, after the batches already issued.
        loops: list[tuple[Callable[[], None], str, Callable[[], None] | None]] = [
            (self._transfer_loop, "kvbm-transfer", lambda: self._jobs.put(("stop",))),
            (self._disk_loop, "kvbm-disk", lambda: self._disk_jobs.put(("stop",)))]
        if self._cuda:
            loops.insert(1, (self._completion_loop, "kvbm-completion", None))
        for target, name, stop in loops:
            thread = threading.Thread(target=target, name=f"{name}-r{self._rank}", daemon=True)
            thread.start()
            self._threads.append((thread, stop))
        if self._groups_io is not None:  # several layer groups: refused with the leader's
            return
        self._shared = SharedIO.open(self._env, pool, self._cuda, self._par.tp_size,
                                     self._rank, self._block_size, self)
        if self._shared is not None and self._rank == 0:
            publish_shared_layout(self._group, self._shared.layout)

    # ------------------------------------------------------------------ per iteration

    def bind_connector_meta(self, metadata: object) -> None:
        """Called every iteration on every rank with the leader's broadcast metadata, before
        ``start_load_kv``. Records per-request in-flight counts so ``get_finished`` can answer."""
        if self._pending_save_meta is not None:
            # The previous iteration had no forward pass (or no hook fired): its offloads still
            # go out, ahead of this iteration's.
            self._enqueue_saves(None)
        super().bind_connector_meta(metadata)
        if not isinstance(metadata, ConnectorMetadata):
            return
        self._apply_layout(metadata.layout)
        if metadata.fences:
            self._fence(metadata.fences)
        with self._lock:
            for op in metadata.saves:
                self._save_inflight[op.req_id] = self._save_inflight.get(op.req_id, 0) + 1
            for load in metadata.loads:
                if load.copies:
                    self._load_inflight[load.req_id] = len(load.copies)
                else:
                    self._loads_done.add(load.req_id)
        if metadata.saves or metadata.demotes or metadata.shared_saves:
            self._pending_save_meta = metadata

    def _fence(self, req_ids: Sequence[int]) -> None:
        """TRT-LLM freed these requests' blocks (a cancel during an async load): queued copies
        into them never write; the ones writing now (a disk block, a host batch) end before
        this pass's forward or loads. Executor thread; at most ``OP_TIMEOUT_S``."""
        deadline = time.monotonic() + OP_TIMEOUT_S
        with self._lock:  # ids whose loads all ended already need nothing
            self._fenced.update(r for r in req_ids if self._load_inflight.get(r, 0) > 0)
        while True:
            with self._lock:
                busy = [r for r in req_ids if self._writing.get(r, 0) > 0]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.0002)  # a copy in progress: one block or one batch
        if busy:
            logger.error("rank %d: loads of terminated requests %s still writing after %.0f s",
                         self._rank, busy, OP_TIMEOUT_S)
        self._count(loads_fenced=len(req_ids))

    def start_load_kv(self, stream: Any) -> None:
        """Called every iteration on every rank after ``bind_connector_meta``, before the forward
        pass. Enqueues this iteration's onboarding; the requests are async-loading (TRT-LLM keeps
        them out of the batch until ``get_finished`` returns them), so nothing waits here."""
        meta = self.get_connector_meta()
        if isinstance(meta, ConnectorMetadata) and meta.loads:
            self._jobs.put(("load", meta.loads))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Called before each decoder layer is enqueued. Loads are asynchronous (whole
        requests), so no layer ever waits."""
        return None

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Called after each decoder layer is enqueued. On the last layer, enqueues the
        iteration's offloads behind an event on ``stream``, in case the engine does not call
        the forward-pass callable (it is idempotent per iteration)."""
        if self._pool is not None and layer_idx == self._last_layer:
            self._enqueue_saves(stream)

    def wait_for_save(self, stream: Any) -> None:
        """Called at the end of the forward pass. Saves are asynchronous; this only makes sure
        they were enqueued (no host sync)."""
        self._enqueue_saves(stream)

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """Called every iteration on every rank. Returns (ids whose offloads are all terminal,
        ids whose onboarding is terminal); an id only after it was passed in, each once. A failed
        transfer counts as terminal. TRT-LLM acts on an id once every rank returned it."""
        now = time.monotonic()
        with self._lock:
            self._save_waiting.update(finished_gen_req_ids)
            for req_id in started_loading_req_ids:
                self._load_waiting.setdefault(req_id, now)
            saved = [r for r in self._save_waiting if self._save_inflight.get(r, 0) == 0]
            self._save_waiting.difference_update(saved)
            loaded: list[int] = []
            for req_id, since in list(self._load_waiting.items()):
                if req_id in self._loads_done:
                    self._loads_done.discard(req_id)
                    loaded.append(req_id)
                elif (req_id not in self._load_inflight
                      and now - since > LOAD_ORPHAN_TIMEOUT_S):
                    logger.error("rank %d: request %d was marked loading but no load op arrived "
                                 "in %.0f s; returning it so the ranks do not hang",
                                 self._rank, req_id, LOAD_ORPHAN_TIMEOUT_S)
                    loaded.append(req_id)
            for req_id in loaded:
                del self._load_waiting[req_id]
        return sorted(saved), sorted(loaded)

    # ------------------------------------------------------------------ helpers (executor)

    def _on_forward_done(self) -> None:
        import torch

        self._enqueue_saves(torch.cuda.current_stream() if self._cuda else None)

    def _enqueue_saves(self, stream: Any) -> None:
        meta = self._pending_save_meta
        if meta is None:
            return
        self._pending_save_meta = None
        event = None
        if self._cuda:
            import torch

            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream())
        box = self._issue_barrier()  # several layer groups: see connector.layer_group_worker
        self._jobs.put(("save", meta, event, box))
        self._await_issue(box, stream)

    def _apply_layout(self, layout: TierLayout) -> None:
        if layout == self._layout:
            return
        self._layout = layout
        host_capacity = 0 if self._host is None else self._host.capacity
        if layout.host_blocks != host_capacity:
            logger.error("rank %d: leader sized the host tier at %d blocks, this rank has %d; "
                         "ops outside this rank's pool will fail", self._rank,
                         layout.host_blocks, host_capacity)
        if layout.disk_blocks and self._disk is None and self._pool is not None:
            spec = TierSpec(layout.disk_blocks, self._tier_shape, self._tier_dtype,
                            self._rank, directory=layout.disk_dir,
                            identity=self._disk_identity)
            self._disk = get_plugin(TIERS_GROUP, "disk")(spec)

    # ------------------------------------------------------------------ completion

    def _report(self, op_id: int, ok: bool, error: int = ERR_NONE,
                signature: tuple[int, int] | None = None) -> None:
        """Tell the leader op ``op_id`` is terminal on this rank (transfer/disk threads)."""
        if not ok:
            with self._lock:
                self._stats["ops_failed"] += 1
        report = OpReport(op_id, self._rank, ok, error, signature)
        try:
            reporter = self._get_reporter()
            if reporter is not None:
                reporter.put(report)
        except Exception:
            # Called from done callbacks on the transfer/disk threads: raising here would leave
            # the rest of the batch unreported and their request ids never returned.
            logger.exception("rank %d: could not report op %d", self._rank, op_id)

    def _report_all(self, results: Sequence[tuple[int, bool]]) -> None:
        """:meth:`_report` for a whole copy batch: ``(op_id, ok)`` pairs, one pass."""
        failed = sum(not ok for _, ok in results)
        if failed:
            with self._lock:
                self._stats["ops_failed"] += failed
        rank = self._rank
        try:
            reporter = self._get_reporter()
            if reporter is None:
                return
            reporter.put_many([OpReport(op_id, rank, ok, ERR_NONE if ok else ERR_FAILED)
                               for op_id, ok in results])
        except Exception:
            logger.exception("rank %d: could not report %d ops", self._rank, len(results))

    def _get_reporter(self) -> Any:
        """Where reports go: the in-process hub, else (TP ranks in other processes) the ZMQ
        channel to the leader; None (logged once) when there is neither."""
        if self._reporter is None:
            hub = find_hub(self._group)
            if hub is not None:
                self._reporter = hub
            elif self._par.tp_size > 1:
                env = self._env
                self._reporter = ZmqReportSender(
                    f"tcp://{_llm_args.leader_host(env)}:{_llm_args.report_port(env, self._par)}")
            else:
                if not self._report_warned:
                    logger.error("rank %d: no leader found for group %r; tier blocks "
                                 "written by this worker will not be advertised",
                                 self._rank, self._group)
                    self._report_warned = True
                return None
        return self._reporter

    def _begin_writing(self, req_id: int, n: int = 1) -> bool:
        """``n`` copies of ``req_id`` start writing device blocks; False when the request is
        fenced (TRT-LLM freed its blocks: nothing may write them)."""
        with self._lock:
            if req_id in self._fenced:
                return False
            self._writing[req_id] = self._writing.get(req_id, 0) + n
            return True

    def _written(self, req_ids: Sequence[int]) -> None:
        """Copies of ``req_ids`` (one per entry) stopped writing device blocks."""
        with self._lock:
            _count_down(self._writing, req_ids)

    def _save_terminal(self, req_id: int) -> None:
        self._save_terminal_all((req_id,))

    def _save_terminal_all(self, req_ids: Sequence[int]) -> None:
        with self._lock:
            _count_down(self._save_inflight, req_ids)

    def _load_terminal(self, req_id: int) -> None:
        self._load_terminal_all((req_id,))

    def _load_terminal_all(self, req_ids: Sequence[int]) -> None:
        with self._lock:
            drained = _count_down(self._load_inflight, req_ids)
            self._loads_done.update(drained)
            self._fenced.difference_update(drained)  # nothing of theirs is left to write

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._stats[name] += delta

    # ------------------------------------------------------------------ transfer thread

    def _transfer_loop(self) -> None:
        """Owns the side stream: issues batched copies (completed on CPU right away, on CUDA by
        the completion thread) and fails CUDA batches that outlive ``OP_TIMEOUT_S``. Job order =
        metadata order, so a demotion reads a host slot before a later save of the same or a
        later iteration overwrites it."""
        while True:
            try:
                job = self._jobs.get(timeout=0.05)
            except queue.Empty:
                job = None
            if job is not None:
                if job[0] == "stop":
                    break
                try:
                    if job[0] == "load":
                        self._run_loads(job[1])
                    elif job[0] == "save":
                        try:  # (a save wait_for_save gave up on: its saves fail)
                            self._run_saves(self._claim(job[1], job[3]), job[2])
                        finally:
                            self._issued(job[3])
                except Exception:  # never lose the thread; the job's ops were failed inside
                    self._count(jobs_failed=1)
                    logger.exception("rank %d: transfer job failed", self._rank)
            if self._copies:
                self._fail_overdue_copies(time.monotonic())
        self._completions.put(None)  # the completion thread finishes what was issued, then stops

    def _completion_loop(self) -> None:
        """CUDA only. Sleeps on each batch's event in issue order (the side stream runs them in
        that order) and finishes the batch when it fires. The wait has no timeout of its own:
        a hung GPU keeps this thread waiting, and the transfer thread fails the batch instead."""
        while (item := self._completions.get()) is not None:
            copy_id, event = item
            try:
                event.synchronize()
                ok = True
            except Exception:  # a CUDA error: fail the ops rather than lose the thread
                logger.exception("rank %d: waiting for a copy failed; failing its ops",
                                 self._rank)
                ok = False
            with self._lock:
                entry = self._copies.pop(copy_id, None)
            if entry is not None:
                entry[1](ok)

    def _fail_overdue_copies(self, now: float) -> None:
        """Fail the copy batches whose deadline is before ``now`` (``math.inf``: all left)."""
        with self._lock:
            overdue = [copy_id for copy_id, (deadline, _) in self._copies.items()
                       if now > deadline]
            finish = [self._copies.pop(copy_id)[1] for copy_id in overdue]
        if finish:
            logger.error("rank %d: %d copy batch(es) did not complete in time (timeout %.1f s); "
                         "failing their ops", self._rank, len(finish), OP_TIMEOUT_S)
        for done in finish:
            done(False)

    def _issue(self, copies: Sequence[tuple[Any, Any]], wait_event: Any,
               done: Callable[[bool], None], direction: str) -> None:
        """Copy each (dst, src) pair; on CUDA on the side stream behind ``wait_event``, with
        ``done`` called by the completion thread when the recorded event fires. The batch's
        latency (issue to completion, so on CUDA it includes waiting for the forward pass) and
        bytes go to the ``kvbm_transfer_*`` histograms."""
        started = time.perf_counter()
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        finish = done

        def done(ok: bool) -> None:
            finish(ok)
            if ok:
                self._metrics.observe_transfer(direction, MEDIUM_CPU,
                                               time.perf_counter() - started, nbytes)

        import torch

        try:
            if not self._cuda:
                assert self._host_copier is not None
                self._host_copier.copy(copies)
            else:
                with torch.cuda.stream(self._side_stream):
                    if wait_event is not None:
                        self._side_stream.wait_event(wait_event)
                    for dst, src in copies:
                        dst.copy_(src, non_blocking=True)
                    # Blocking sync: the completion thread sleeps instead of spinning a core.
                    event = torch.cuda.Event(blocking=True)
                    event.record(self._side_stream)
        except Exception:
            # A copy that cannot be issued (shape mismatch, CUDA error) fails its ops now;
            # otherwise they would never be reported and their request ids never returned.
            logger.exception("rank %d: %s copy of %d blocks failed", self._rank, direction,
                             len(copies))
            done(False)
            return
        if not self._cuda:
            done(True)
            return
        copy_id = next(self._copy_ids)
        with self._lock:
            self._copies[copy_id] = (time.monotonic() + OP_TIMEOUT_S, done)
        self._completions.put((copy_id, event))

    def _run_loads(self, loads: Sequence[LoadOp]) -> None:
        assert self._pool is not None
        host_copies: list[tuple[LoadCopy, int]] = []
        for load in loads:
            shared: list[LoadCopy] = []
            with self._lock:
                fenced = load.req_id in self._fenced
                if not fenced:  # its host copies write from now until their done()
                    n_host = sum(c.tier == HOST for c in load.copies)
                    if n_host:
                        self._writing[load.req_id] = self._writing.get(load.req_id, 0) + n_host
            for copy in load.copies:
                if fenced:  # TRT-LLM freed the blocks: never write them
                    self._report(copy.op_id, False, ERR_FAILED)
                    self._load_terminal(load.req_id)
                elif copy.tier == HOST and self._host is not None \
                        and 0 <= copy.slot < self._host.capacity:
                    host_copies.append((copy, load.req_id))
                elif copy.tier == DISK and self._disk is not None:
                    self._disk_jobs.put(("load", copy, load.req_id))
                elif copy.tier == SHARED and self._shared is not None:
                    shared.append(copy)
                else:
                    if copy.tier == HOST:
                        self._written((load.req_id,))
                    self._load_errors_add(load.req_id, (copy.device_block,))
                    self._report(copy.op_id, False, ERR_FAILED)
                    self._load_terminal(load.req_id)
            if shared:
                self._shared.submit_load(shared, load.req_id)  # type: ignore[union-attr]
        for chunk in _chunked(host_copies, self._copy_batch_blocks):
            self._load_from_host(chunk)

    def _load_from_host(self, host_copies: Sequence[tuple[LoadCopy, int]]) -> None:
        host, pool = self._host, self._pool
        assert host is not None and pool is not None
        pairs = [(c.slot, c.device_block) for c, _ in host_copies]
        pool_blocks, host_blocks = self._pool_blocks, self._host_blocks
        copies = [(pool_blocks[d], host_blocks[s]) if n == 1
                  else (pool[d:d + n], host.pool[s:s + n])  # type: ignore[attr-defined]
                  for s, d, n in _runs(pairs)] if self._groups_io is None \
            else self._group_copies([(c.pages or (c.device_block,), c.slot)
                                     for c, _ in host_copies], load=True)
        keys_ok = {c.op_id: host.keys[c.slot] == c.key for c, _ in host_copies}  # type: ignore[attr-defined]

        def done(ok: bool) -> None:
            results = [(copy.op_id, ok and keys_ok[copy.op_id]) for copy, _ in host_copies]
            self._written([req_id for _, req_id in host_copies])
            for (copy, req_id), (_, good) in zip(host_copies, results, strict=True):
                if not good:
                    self._load_errors_add(req_id, (copy.device_block,))
            self._report_all(results)
            self._load_terminal_all([req_id for _, req_id in host_copies])
            moved = sum(good for _, good in results)
            self._count(bytes_onboarded=moved * self._block_bytes, blocks_onboarded=moved,
                        copies_issued=len(copies))

        self._issue(copies, None, done, "onboard")

    def _run_saves(self, meta: ConnectorMetadata, fwd_event: Any) -> None:
        assert self._pool is not None
        # 1. Demotions: copy the host slot out *now*, before this job's saves reuse it.
        for op in meta.demotes:
            self._demote(op)
        # 2. Saves into the host pool, batched; saves straight to disk via a CPU copy.
        host_ops: list[SaveOp] = []
        # Write-through to the shared tier: staged from its host slot now (before this job's
        # saves may reuse it), or in the host copy batch of the same block.
        followers = {op.after: op for op in meta.shared_saves if op.after >= 0}
        from_host = [op for op in meta.shared_saves if op.after < 0]
        for op in from_host if self._shared is None else ():
            self._report(op.op_id, False, ERR_FAILED)
        if from_host and self._shared is not None:
            self._shared.stage_from_host(from_host, self._host)
        for op in meta.saves:
            if op.tier == HOST and self._host is not None and 0 <= op.slot < self._host.capacity:
                host_ops.append(op)
            elif op.tier == DISK and self._disk is not None:
                self._save_to_disk(op, fwd_event)
            else:
                self._report(op.op_id, False, ERR_FAILED)
                self._save_terminal(op.req_id)
        for chunk in _chunked(host_ops, self._copy_batch_blocks):
            self._save_to_host(chunk, fwd_event, followers)
        for follower in followers.values():  # its host save did not run here
            self._report(follower.op_id, False, ERR_FAILED)

    def _save_to_host(self, host_ops: Sequence[SaveOp], fwd_event: Any,
                      followers: dict[int, SharedSaveOp]) -> None:
        host, pool = self._host, self._pool
        assert host is not None and pool is not None
        pool_blocks, host_blocks = self._pool_blocks, self._host_blocks
        copies = [(host_blocks[s], pool_blocks[d]) if n == 1
                  else (host.pool[s:s + n], pool[d:d + n])  # type: ignore[attr-defined]
                  for d, s, n in _runs((o.device_block, o.slot) for o in host_ops)] \
            if self._groups_io is None \
            else self._group_copies([(o.pages or (o.device_block,), o.slot) for o in host_ops],
                                    load=False)
        shared = self._shared
        staged = shared.stage(host_ops, followers) if followers and shared is not None else []
        copies += [(buf, pool_blocks[op.device_block]) for op, buf in staged]

        def done(ok: bool) -> None:
            keys = host.keys  # type: ignore[attr-defined]
            for op in host_ops:
                keys[op.slot] = op.key if ok else None
            self._report_all([(op.op_id, ok) for op in host_ops])
            if staged:
                shared.staged_done(staged, ok)  # type: ignore[union-attr]
            self._save_terminal_all([op.req_id for op in host_ops])
            if ok:
                self._count(bytes_offloaded=len(host_ops) * self._block_bytes,
                            blocks_offloaded=len(host_ops))
            self._count(copies_issued=len(copies))

        self._issue(copies, fwd_event, done, "offload")

    def _demote(self, op: DemoteOp) -> None:
        import torch

        host, disk = self._host, self._disk
        if host is None or disk is None or not 0 <= op.host_slot < host.capacity:
            self._report(op.op_id, False, ERR_FAILED)
            return
        staging = torch.empty(host.spec.block_shape, dtype=host.spec.dtype)
        if not host.read(op.host_slot, op.key, staging):
            self._report(op.op_id, False, ERR_FAILED)
            return
        self._disk_jobs.put(("write", op.op_id, None, op.disk_slot, op.key, staging, True))

    def _save_to_disk(self, op: SaveOp, fwd_event: Any) -> None:
        """No host tier: device block → CPU copy (background sync is fine here) → disk."""
        assert self._pool is not None
        try:
            if self._cuda:
                import torch

                with torch.cuda.stream(self._side_stream):
                    if fwd_event is not None:
                        self._side_stream.wait_event(fwd_event)
                    staging = self._pool[op.device_block].to("cpu", non_blocking=False)
            else:
                staging = self._pool[op.device_block].clone()
        except Exception:
            logger.exception("rank %d: device → staging copy failed", self._rank)
            self._report(op.op_id, False, ERR_FAILED)
            self._save_terminal(op.req_id)
            return
        self._disk_jobs.put(("write", op.op_id, op.req_id, op.slot, op.key, staging, False))

    def _staging_to_device(self, staging: Any, device_block: int,
                           pages: tuple[int, ...] = ()) -> bool:
        assert self._pool is not None
        if self._groups_io is not None:  # several layer groups: every group's live page
            return self._group_staging_to_device(staging, pages or (device_block,),
                                                 OP_TIMEOUT_S)
        if not self._cuda:
            self._pool[device_block].copy_(staging)
            return True
        import torch

        with torch.cuda.stream(self._disk_stream):
            self._pool[device_block].copy_(staging, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._disk_stream)
        deadline = time.monotonic() + OP_TIMEOUT_S
        # The staging buffer is reused by the next read, so wait (on this thread) for the copy.
        while not event.query():
            if time.monotonic() > deadline:
                # The copy may still run some day: later reads get a buffer of their own
                # (torch's pinned allocator keeps this one until its pending copy is done).
                self._disk_staging = torch.empty(staging.shape, dtype=staging.dtype,
                                                 pin_memory=True)
                return False
            time.sleep(0.0002)
        return True

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, int]:
        """Counters (bytes/blocks moved, failures); any thread."""
        with self._lock:
            out = dict(self._stats)
            out["saves_inflight"] = sum(self._save_inflight.values())
            out["loads_inflight"] = sum(self._load_inflight.values())
        if self._shared is not None:
            out.update(self._shared.stats())
        return out

    def idle(self) -> bool:
        """True when no transfer is queued or in flight on this rank (tests, benchmarks)."""
        with self._lock:
            busy = bool(self._save_inflight or self._load_inflight)
        return not busy and self._jobs.empty() and self._disk_jobs.empty() \
            and self._pending_save_meta is None and (self._shared is None or self._shared.idle())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the threads after they ran what is queued (bounded by ``timeout``; pending
        copies still unfinished then are failed), close tiers; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._enqueue_saves(None)
        deadline = time.monotonic() + timeout
        for thread, stop in self._threads:  # in start order (no threads: no pool registered)
            if stop is not None:
                stop()
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("rank %d: %s did not stop within %.1f s", self._rank, thread.name,
                               timeout)
        self._fail_overdue_copies(math.inf)  # only left when a copy outlived the timeout
        if self._shared is not None:  # after the transfer thread: nothing stages any more
            self._shared.close(max(0.0, deadline - time.monotonic()))
        if self._host_copier is not None:
            self._host_copier.close()
        for tier in (self._host, self._disk):
            if tier is not None:
                tier.close()
        if isinstance(self._reporter, ZmqReportSender):
            self._reporter.close()
