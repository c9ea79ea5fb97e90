"""A worker's shared-tier I/O: its own store client, a writer thread and a reader thread.

Built by ``KvbmConnectorWorker.register_kv_caches`` (every rank, main thread, before the first
iteration) when ``DYN_KVBM_SHARED_TIER`` names a store; the worker's transfer thread is a thin
caller:

* writes (write-through host → shared): the worker's transfer thread calls :meth:`SharedIO.stage`
  while it builds a host-save copy batch; each :class:`~kvbm_plugin.connector.meta.SharedSaveOp`
  that follows one of the batch's host saves gets a staging buffer, and the device block is
  copied into it in the same batch (so the staged bytes are exactly what the host slot gets,
  whatever reuses that slot later). When the batch completed (:meth:`staged_done`, transfer or
  completion thread) the staged write goes to the writer thread, which ``put`` s it under this
  rank's key. The staging buffers are the bounded queue: at most ``DYN_KVBM_SHARED_QUEUE_BLOCKS``
  writes wait or run; one more is dropped, reported failed and counted
  (``shared_writes_dropped``), and the leader never advertises it.
* loads: the transfer thread hands a request's shared copies to :meth:`submit_load`; the
  reader thread reads them with one ``get_into`` batch into registered staging (pinned on
  CUDA), checks every object there (``tiers.shared.frame``: magic, layout digest, key, length,
  checksum) and only then copies the good ones into the pool (on CUDA on a stream of its own),
  so no byte of a refused object ever reaches the pool. A read of another size, an object that
  fails its check or is gone is a failed load: counted (``shared_loads_short``,
  ``shared_loads_corrupt``, ``shared_loads_failed``), logged rate-limited, and its device block
  goes to the worker's load errors (``get_block_ids_with_load_errors``), so TensorRT-LLM
  recomputes the request where its version asks for that set. A refused object is removed
  from the store if it still holds the bytes read (``SharedStore.remove_if``), one of another
  size if it still has another size (``remove_if_size_not``): the next correct write of that
  key replaces it, so one bad writer cannot poison a key for its lifetime.
* writes carry the same header: the writer thread seals each staged block (``frame.seal``)
  right before its ``put``.

Every op is reported to the leader exactly once (``OpReporter``, worker/op_reports.py) and
a load's request is told of it (``RequestProgress``, worker/request_progress.py); no store
call ever runs on the executor thread. Waiting for a staging → device copy is
``worker.device_copy.wait_for_copy``. The store client is the ``kvbm_plugin.tiers`` entry
point named by the settings, wrapped in a circuit breaker (``tiers.shared.breaker``): while the
store is down each call fails at once (counted), and the client reconnects by itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import (
    ERR_CORRUPT,
    ERR_DROPPED,
    ERR_FAILED,
    ERR_NONE,
    LoadCopy,
    SharedSaveOp,
)
from kvbm_plugin.settings.shared import SharedSettings, load_shared_settings
from kvbm_plugin.tiers.shared import frame
from kvbm_plugin.tiers.shared.keys import SharedLayout
from kvbm_plugin.tiers.shared.store import CODE_NAMES, FAILED, OK
from kvbm_plugin.worker.device_copy import wait_for_copy
from kvbm_plugin.worker.op_reports import OpReporter
from kvbm_plugin.worker.request_progress import RequestProgress

if TYPE_CHECKING:
    import torch

    from kvbm_plugin.tiers.shared.store import SharedStore

logger = logging.getLogger(__name__)
_log = RateLimitedLog(logger)

POOL_LAYOUT = "v1pool"  # the bytes of pool[block]: every layer of one block, this rank's heads
WRITE_BATCH = 64  # staged writes one put() takes at most
LOAD_STAGING_BLOCKS = 64  # CUDA: registered pinned staging blocks of the reader
DEVICE_COPY_TIMEOUT_S = 60.0


def open_store(settings: SharedSettings, *, segment_bytes: int | None = None) -> SharedStore:
    """A new client of the store ``settings.store`` names (its ``kvbm_plugin.tiers`` entry
    point), behind the circuit breaker (``tiers.shared.factory``). ``segment_bytes=0``: the
    leader's client, which contributes no memory to the pool and transfers nothing. Connects:
    called at bring-up, never on the executor thread."""
    from kvbm_plugin.tiers.shared.factory import open_store as factory_open

    if segment_bytes is not None:
        settings = replace(settings, segment_bytes=segment_bytes,
                           buffer_bytes=settings.buffer_bytes if segment_bytes else 0)
    return factory_open(settings)


def worker_layout(settings: SharedSettings, pool: torch.Tensor, world: int, rank: int,
                  tokens_per_block: int) -> SharedLayout:
    """This rank's key layout: its page is ``pool[block]`` (bytes and dtype of its shard)."""
    page = pool[0].numel() * pool.element_size() if pool.shape[0] else 0
    return SharedLayout(settings.namespace, settings.model_key, world, rank, 0,
                        tokens_per_block, page, str(pool.dtype).removeprefix("torch."),
                        POOL_LAYOUT)


class SharedIO:
    """One rank's shared-tier reads and writes (see the module docstring).

    It reports ops through ``reporter`` and tells ``progress`` of a load's writes, failures
    and ends (both thread-safe); it knows nothing else of the worker.
    """

    def __init__(self, settings: SharedSettings, store: SharedStore, layout: SharedLayout,
                 pool: torch.Tensor, cuda: bool, progress: RequestProgress,
                 reporter: OpReporter) -> None:
        self.settings = settings
        self.layout = layout
        self._store = store
        self._pool = pool
        self._pool_blocks = pool.unbind(0)
        self._page = layout.bytes_per_page
        self._object = frame.HEADER_BYTES + self._page  # what one key holds
        self._lay = frame.layout_digest(layout)
        # Staged payload views (pool-block shaped) -> their whole object buffer (uint8).
        self._whole: dict[int, torch.Tensor] = {}
        self._cuda = cuda
        self._progress = progress
        self._reporter = reporter
        self._rank = layout.rank if layout.rank is not None else 0
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []  # staging buffers not in use (registered)
        self._allocated = 0
        self._registered: list[int] = []
        self._writes: queue.SimpleQueue[tuple[SharedSaveOp, torch.Tensor] | None] = \
            queue.SimpleQueue()
        self._reads: queue.SimpleQueue[tuple[tuple[LoadCopy, ...], int] | None] = \
            queue.SimpleQueue()
        self._busy = 0  # writes staged or queued + loads queued or running, under _lock
        self._load_staging: list[torch.Tensor] = []
        self._stream: Any = None
        self._closed = False
        self._stats = dict.fromkeys((
            "shared_writes", "shared_writes_failed", "shared_writes_dropped",
            "shared_bytes_written", "shared_loads", "shared_loads_failed",
            "shared_loads_short", "shared_loads_corrupt", "shared_objects_removed",
            "shared_bytes_read", "shared_store_unavailable"), 0)
        if cuda:
            import torch

            self._stream = torch.cuda.Stream(device=pool.device)
        self._threads = [threading.Thread(target=loop, name=f"{name}-r{self._rank}",
                                          daemon=True)
                         for loop, name in ((self._writer_loop, "kvbm-shared-write"),
                                            (self._reader_loop, "kvbm-shared-read"))]
        for thread in self._threads:
            thread.start()

    @classmethod
    def open(cls, env: Mapping[str, str], pool: torch.Tensor, cuda: bool, world: int,
             rank: int, tokens_per_block: int, progress: RequestProgress,
             reporter: OpReporter) -> SharedIO | None:
        """The rank's shared-tier I/O, or None when no shared tier is configured; raises
        ConfigError (naming the variable) for bad settings. ``register_kv_caches``, main
        thread: connects to the store."""
        settings = load_shared_settings(env)
        if settings is None:
            return None
        layout = worker_layout(settings, pool, world, rank, tokens_per_block)
        store = open_store(settings)
        try:
            return cls(settings, store, layout, pool, cuda, progress, reporter)
        except BaseException:
            store.close()
            raise

    def _register(self, address: int, size: int) -> None:
        self._store.register(address, size)
        self._registered.append(address)

    # ------------------------------------------------------------ writes (transfer thread)

    def stage(self, host_ops: Sequence[Any], followers: dict[int, SharedSaveOp]
              ) -> list[tuple[SharedSaveOp, torch.Tensor]]:
        """For the host saves of one copy batch: the shared saves that follow them (taken out of
        ``followers``), each with a staging buffer the batch copies its device block into.
        A follower for which no buffer is free is dropped: reported failed, counted."""
        staged: list[tuple[SharedSaveOp, torch.Tensor]] = []
        for op in host_ops:
            follower = followers.pop(op.op_id, None)
            if follower is None:
                continue
            buf = self._acquire()
            if buf is None:
                self._drop(follower)
                continue
            staged.append((follower, buf))
        return staged

    def stage_from_host(self, ops: Sequence[SharedSaveOp], host: Any) -> None:
        """Shared saves of blocks resident in the host tier (transfer thread, when it takes
        their metadata): each host slot is copied into a staging buffer now and queued for the
        writer; a slot that no longer holds its block fails its op."""
        for op in ops:
            keys = getattr(host, "keys", None)
            if keys is None or not 0 <= op.host_slot < len(keys) \
                    or keys[op.host_slot] != op.host_key:
                self._count(shared_writes_failed=1)
                self._reporter.report(op.op_id, False, ERR_FAILED)
                continue
            buf = self._acquire()
            if buf is None:
                self._drop(op)
                continue
            buf.copy_(host.pool[op.host_slot])
            self.staged_done(((op, buf),), True)

    def _drop(self, op: SharedSaveOp) -> None:
        self._count(shared_writes_dropped=1)
        _log.log(logging.WARNING, f"shared-drop-{self._rank}", "rank %d: shared-tier write "
                 "queue full (%d blocks, %s); write dropped", self._rank,
                 self.settings.queue_blocks, "DYN_KVBM_SHARED_QUEUE_BLOCKS")
        self._reporter.report(op.op_id, False, ERR_DROPPED)

    def staged_done(self, staged: Sequence[tuple[SharedSaveOp, torch.Tensor]], ok: bool) -> None:
        """The copy batch that filled ``staged`` ended (transfer or completion thread): its
        staged writes go to the writer thread, or fail with it."""
        for op, buf in staged:
            if ok and not self._closed:
                with self._lock:
                    self._busy += 1
                self._writes.put((op, buf))
            else:
                self._release(buf)
                self._count(shared_writes_failed=1)
                self._reporter.report(op.op_id, False, ERR_FAILED)

    def _acquire(self) -> torch.Tensor | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._allocated >= self.settings.queue_blocks:
                return None
            self._allocated += 1
        try:
            whole = self._new_object_buffer()
        except Exception:
            with self._lock:
                self._allocated -= 1
            logger.exception("rank %d: cannot allocate a shared-tier staging buffer", self._rank)
            return None
        buf = self._payload(whole)
        with self._lock:
            self._whole[buf.data_ptr()] = whole
        return buf

    def _new_object_buffer(self) -> torch.Tensor:
        """A registered buffer of one object (header + page), pinned on CUDA."""
        import torch

        whole = torch.empty(self._object, dtype=torch.uint8, pin_memory=self._cuda)
        self._register(whole.data_ptr(), self._object)
        return whole

    def _payload(self, whole: torch.Tensor) -> torch.Tensor:
        """The pool-block shaped view of an object buffer's payload (64-byte aligned)."""
        pool = self._pool
        return whole[frame.HEADER_BYTES:].view(pool.dtype).view(pool.shape[1:])

    def _release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    # ------------------------------------------------------------ writer thread

    def _writer_loop(self) -> None:
        """Puts staged blocks, up to WRITE_BATCH per call, and reports each call's together
        (writer thread)."""
        while True:
            item = self._writes.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < WRITE_BATCH:
                try:
                    nxt = self._writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._put(batch)
            if stop:
                return

    def _put(self, batch: list[tuple[SharedSaveOp, torch.Tensor]]) -> None:
        keys = [self.layout.key(op.digest) for op, _ in batch]
        with self._lock:
            wholes = [self._whole[buf.data_ptr()] for _, buf in batch]
        try:
            for (op, _), whole in zip(batch, wholes, strict=True):
                frame.seal(whole, self.layout, op.digest, self._lay)
            codes = self._store.put(keys, [(w.data_ptr(), self._object) for w in wholes])
        except Exception:  # a store client must not raise; if it does, the ops still end
            logger.exception("rank %d: shared-tier put of %d blocks raised", self._rank,
                             len(batch))
            codes = [FAILED] * len(batch)
        failed = 0
        results: list[tuple[int, bool]] = []
        for (op, buf), code in zip(batch, codes, strict=True):
            ok = code == OK
            if not ok:
                failed += 1
                self._note_failure("put", code)
            self._release(buf)
            results.append((op.op_id, ok))
        # One hand-off for the batch (a failure is ERR_FAILED, as one by one): the leader
        # folds a run's consecutive ids in one step, not a report per block.
        self._reporter.report_all(results)
        self._count(shared_writes=len(batch) - failed, shared_writes_failed=failed,
                    shared_bytes_written=(len(batch) - failed) * self._page)
        with self._lock:
            self._busy -= len(batch)

    def _note_failure(self, what: str, code: int) -> None:
        if code == -2:
            self._count(shared_store_unavailable=1)
        _log.log(logging.WARNING, f"shared-{what}-{self._rank}-{code}", "rank %d: shared-tier "
                 "%s failed: %s", self._rank, what, CODE_NAMES.get(code, code))

    # ------------------------------------------------------------ loads

    def submit_load(self, copies: Sequence[LoadCopy], req_id: int) -> None:
        """Queue one request's shared copies for the reader thread (transfer thread)."""
        with self._lock:
            self._busy += 1
        self._reads.put((tuple(copies), req_id))

    def _reader_loop(self) -> None:
        while (job := self._reads.get()) is not None:
            copies, req_id = job
            try:
                self._load(copies, req_id)
            except Exception:  # never lose the thread (_load reports every op it was given)
                logger.exception("rank %d: shared-tier load failed", self._rank)
            finally:
                with self._lock:
                    self._busy -= 1

    def _load(self, copies: tuple[LoadCopy, ...], req_id: int) -> None:
        n_blocks = self._pool.shape[0]
        results: dict[int, int] = {}  # op id -> ERR_NONE / ERR_FAILED / ERR_CORRUPT
        good = [c for c in copies if c.digest is not None and 0 <= c.device_block < n_blocks]
        for c in copies:
            if c not in good:
                results[c.op_id] = ERR_FAILED
        for start in range(0, len(good), LOAD_STAGING_BLOCKS):
            chunk = good[start:start + LOAD_STAGING_BLOCKS]
            try:
                results.update(self._load_via_staging(chunk, req_id))
            except Exception:
                # A bug or a failed allocation must not leave these ops unreported: the
                # request would wait for them forever. Failed, they become load errors
                # (recomputed) like any other failed read.
                logger.exception("rank %d: shared-tier load of %d blocks raised", self._rank,
                                 len(chunk))
                results.update({c.op_id: ERR_FAILED for c in chunk})
        failed = [c.device_block for c in copies if results.get(c.op_id, ERR_FAILED)]
        if failed:  # before the reports: the request is "loaded" only after its last one
            self._progress.load_failed(req_id, failed)
        ok_n = 0
        for c in copies:
            error = results.get(c.op_id, ERR_FAILED)
            ok_n += error == ERR_NONE
            self._reporter.report(c.op_id, error == ERR_NONE, error)
            self._progress.load_ended((req_id,))
        self._count(shared_loads=ok_n, shared_loads_failed=len(copies) - ok_n,
                    shared_bytes_read=ok_n * self._page)

    def _get(self, copies: Sequence[LoadCopy], staging: list[torch.Tensor]) -> list[int]:
        """Read each copy's object into its staging buffer and check it: per copy ERR_NONE,
        ERR_FAILED (the store failed, the object is gone or of another size) or ERR_CORRUPT
        (it failed its check; removed from the store if it still holds those bytes)."""
        keys = [self.layout.key(c.digest) for c in copies]  # type: ignore[arg-type]
        try:
            # Promised to TensorRT-LLM already: tried even while this client's breaker
            # is open (a failure is a load error; the wait is this thread's).
            codes = self._store.get_promised(keys, [(b.data_ptr(), self._object)
                                                    for b in staging])
        except Exception:
            logger.exception("rank %d: shared-tier get of %d blocks raised", self._rank,
                             len(copies))
            codes = [FAILED] * len(copies)
        out = []
        for c, key, buf, code in zip(copies, keys, staging, codes, strict=True):
            if code != self._object:
                if code >= 0 or code == FAILED:  # another size (FAILED: larger, or an error)
                    if code >= 0:
                        self._count(shared_loads_short=1)
                        code = FAILED
                    self._remove_other_size(key)
                self._note_failure("get", code)
                out.append(ERR_FAILED)
                continue
            try:
                frame.check(buf, c.digest, self._lay)  # type: ignore[arg-type]
            except frame.Refusal as why:
                self._refused(key, buf, str(why))
                out.append(ERR_CORRUPT)
                continue
            out.append(ERR_NONE)
        return out

    def _remove_other_size(self, key: str) -> None:
        """A read of ``key`` failed or found another size: remove it if it is not one object
        long (another format, a bad writer), so the next correct write replaces it."""
        try:
            code = self._store.remove_if_size_not(key, self._object)
        except Exception:  # a store client must not raise; the object stays until evicted
            logger.exception("rank %d: shared-tier remove_if_size_not raised", self._rank)
            return
        if code == OK:
            self._count(shared_objects_removed=1)

    def _refused(self, key: str, buf: torch.Tensor, why: str) -> None:
        """An object failed its check: count, log (rate-limited), and remove it from the store
        if it still holds exactly these bytes, so the next correct write replaces it."""
        self._count(shared_loads_corrupt=1)
        try:
            code = self._store.remove_if(key, frame.fingerprint(buf))
        except Exception:  # a store client must not raise; the object stays until evicted
            logger.exception("rank %d: shared-tier remove_if raised", self._rank)
            code = FAILED
        if code == OK:
            self._count(shared_objects_removed=1)
        _log.log(logging.WARNING, f"shared-corrupt-{self._rank}", "rank %d: shared-tier object "
                 "%s refused: %s; not loaded (the request recomputes where TensorRT-LLM asks "
                 "for load errors), %s", self._rank, key, why,
                 "removed from the store" if code == OK else
                 f"not removed ({CODE_NAMES.get(code, code)})")

    def _load_via_staging(self, copies: list[LoadCopy], req_id: int) -> dict[int, int]:
        """Store → registered staging (pinned on CUDA) → checked → device block: on CPU a
        plain copy, on CUDA on this reader's own stream, waited for here (the staging is reused
        by the next read). Only checked objects are copied; while they are, the copies count
        as writing the request's blocks (a fence waits for them)."""
        while len(self._load_staging) < len(copies):
            self._load_staging.append(self._new_object_buffer())
        staging = self._load_staging[:len(copies)]
        errors = self._get(copies, staging)
        out = {c.op_id: e for c, e in zip(copies, errors, strict=True)}
        todo = [(c, self._payload(b)) for c, b, e in zip(copies, staging, errors, strict=True)
                if e == ERR_NONE]
        if not todo:
            return out
        progress = self._progress
        if not progress.begin_writing(req_id, len(todo)):  # TRT-LLM freed the blocks
            return {c.op_id: ERR_FAILED for c in copies}
        try:
            if not self._cuda:
                for c, b in todo:
                    self._pool_blocks[c.device_block].copy_(b)
                return out
            import torch

            with torch.cuda.stream(self._stream):
                for c, b in todo:
                    self._pool_blocks[c.device_block].copy_(b, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            if not wait_for_copy(event, DEVICE_COPY_TIMEOUT_S):
                # The copy may still run: later reads get staging of their own.
                self._load_staging = []
                return {c.op_id: ERR_FAILED for c in copies}
        finally:
            progress.written([req_id] * len(todo))
        return out

    # ------------------------------------------------------------ lifecycle

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._stats[name] += delta

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._stats)
            out["shared_staging_blocks"] = self._allocated
            out["shared_io_busy"] = self._busy
        return out

    def idle(self) -> bool:
        with self._lock:
            return self._busy == 0

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes and loads (bounded by ``timeout``), then release the
        buffers and the client. Called by the worker's shutdown after its transfer thread
        stopped (no more staging); idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        self._writes.put(None)
        self._reads.put(None)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("rank %d: %s did not stop within %.1f s", self._rank,
                               thread.name, timeout)
        for address in self._registered:
            try:
                self._store.unregister(address)
            except Exception:
                logger.exception("rank %d: shared-tier unregister failed", self._rank)
        self._registered = []
        self._store.close()
