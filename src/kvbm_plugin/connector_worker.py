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

The executor thread only records CUDA events and enqueues jobs. The class is the face
TensorRT-LLM calls; the work is done by collaborators that own their state, each built once
at bring-up and handed what it needs:

* ``RequestProgress`` (worker/request_progress.py): per-request in-flight counts, fences,
  and the ids ``get_finished`` returns; it holds the ``LoadErrorRecord``
  (worker/load_errors.py) behind ``get_block_ids_with_load_errors``;
* ``OpReporter`` (worker/op_reports.py): each op's one report to the leader;
* ``TransferThread`` (worker/transfer_thread.py): turns each iteration's loads and saves into
  copies, in metadata order;
* ``CopyEngine`` (worker/copy_engine.py): host ↔ device copy batches, on CUDA on a side
  stream behind the forward's event, finished by its completion thread (blocking sync, no
  polling) or failed after ``OP_TIMEOUT_S``;
* ``DiskIO`` (worker/disk_io.py): the disk tier and its thread (reads, verifies and writes
  block files; a load goes through ``DiskStaging``, worker/device_copy.py);
* ``SharedIO`` (worker/shared_io.py): the shared tier's writer and reader threads;
* with several KV layer groups, ``GroupSaveBarrier`` (worker/layer_groups.py).

None ever makes the executor thread wait (a several-group save's issue alone, see
``GroupSaveBarrier``). Every op reaches a terminal state (done, failed, or timed out) and is
reported once to the leader (see connector/meta.py), and every request id passed to
``get_finished`` is eventually returned.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvbm_plugin.connector import llm_args as _llm_args
from kvbm_plugin.connector.meta import (
    ConnectorMetadata,
    TierLayout,
    publish_pool_layout,
    publish_shared_layout,
)
from kvbm_plugin.connector.metrics import get_metrics
from kvbm_plugin.connector.trtllm_compat import KvCacheConnectorWorker, has_layer_group_api
from kvbm_plugin.consolidator_config import load_tier_settings
from kvbm_plugin.leader.layer_groups import refuse_unsupported as _refuse_layer_groups
from kvbm_plugin.tiers.base import OffloadTier, TierSpec
from kvbm_plugin.tiers.selection import disk_tier_class, host_tier_class
from kvbm_plugin.worker.copy_engine import CopyEngine
from kvbm_plugin.worker.device_copy import OP_TIMEOUT_S, DiskStaging
from kvbm_plugin.worker.disk_io import DiskIO
from kvbm_plugin.worker.layer_group_copies import GroupPages
from kvbm_plugin.worker.layer_groups import GroupSaveBarrier, SaveIssue, open_group_pages
from kvbm_plugin.worker.load_errors import LoadErrorRecord
from kvbm_plugin.worker.op_reports import OpReporter
from kvbm_plugin.worker.request_progress import RequestProgress
from kvbm_plugin.worker.shared_io import SharedIO
from kvbm_plugin.worker.transfer_counters import TransferCounters
from kvbm_plugin.worker.transfer_thread import DevicePool, TierIO, TransferThread

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class KvbmConnectorWorker(KvCacheConnectorWorker):  # type: ignore[misc, valid-type]
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
        self._par = _llm_args.parallel_of(llm_args)
        self._rank = self._par.tp_rank  # in its group (attention DP: rank 0 of its own)
        self._group = _llm_args.group_of(llm_args, self._env)
        self._tier_settings = settings = load_tier_settings(self._env)
        # The tier implementations, by name (tiers/selection.py): a bad name is refused
        # here, not on the executor thread when the leader's first layout opens the disk tier.
        self._host_tier_class = host_tier_class(settings)
        self._disk_tier_class = disk_tier_class(settings)
        self._block_size = _llm_args.block_size_of(llm_args)
        self._disk_identity = _llm_args.disk_identity(llm_args, self._block_size,
                                                      self._par.tp_size)
        self._counters = TransferCounters()
        self._progress = RequestProgress(self._rank, self._counters,
                                         LoadErrorRecord(self._rank, self._counters))
        self._reporter = OpReporter(self._group, self._par, self._env, self._counters)
        # Set at bring-up (register_kv_caches / register_kv_cache_layout), main thread.
        self._pool: torch.Tensor | None = None
        self._groups_io: GroupPages | None = None  # several KV layer groups
        self._last_layer = -1  # the forward's last layer (save_kv_layer enqueues there)
        self._cuda = False
        self._block_bytes = 0  # of one tier slot
        self._tier_shape: tuple[int, ...] = ()  # a tier slot's shape and dtype (_start_tiers)
        self._tier_dtype: Any = None
        self._host: OffloadTier | None = None
        self._shared: SharedIO | None = None
        self._copy_engine: CopyEngine | None = None
        self._disk_io: DiskIO | None = None
        self._transfers: TransferThread | None = None
        self._barrier: GroupSaveBarrier | None = None
        # Executor thread only.
        self._layout: TierLayout | None = None
        self._pending_save_meta: ConnectorMetadata | None = None  # bound, saves not enqueued
        self._closed = False

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
        self._last_layer = kv_cache_tensor.shape[1] - 1
        self._start_tiers(kv_cache_tensor, kv_cache_tensor.unbind(0),
                          tuple(kv_cache_tensor.shape[1:]), kv_cache_tensor.dtype,
                          kv_cache_tensor.shape[0])

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Called once per rank (main thread, before the first iteration) by TensorRT-LLM
        revisions with KVCacheManagerV2 instead of ``register_kv_caches``. One group of one
        region: that pool tensor goes to ``register_kv_caches`` (the flat path). Several
        groups: every group's page of a block shares one tier slot
        (worker/layer_groups.py). A hybrid model (recurrent state roles) raises
        ValueError naming them."""
        # (One group of several regions, e.g. block scales beside K/V: the composite path
        # below with one group; its ops are flat, the device block being the page.)
        single = layout.as_single_pool_tensor() if len(layout.groups) == 1 else None
        if single is not None:
            self.register_kv_caches(single)
            return
        import torch

        pages = self._groups_io = open_group_pages(layout, self._env, self._rank, self._group)
        self._disk_identity += pages.identity  # read when the disk tier opens (_apply_layout)
        first = pages.segments[0].region
        self._pool = first  # bring-up done (its blocks are never addressed: see GroupPages)
        self._last_layer = pages.last_layer
        self._start_tiers(first, (), (pages.block_bytes,), torch.uint8, pages.num_slots)

    def _start_tiers(self, pool: torch.Tensor, pool_blocks: tuple[torch.Tensor, ...],
                     block_shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int) -> None:
        """The host tier, the shared tier's I/O and the worker's threads, for device blocks of
        ``block_shape`` (a tier slot's shape); ``pool`` gives the device (and, for one layer
        group, the shared tier's pages). Called once, from register_kv_caches or
        register_kv_cache_layout."""
        import torch

        self._cuda, self._tier_shape, self._tier_dtype = pool.is_cuda, block_shape, dtype
        self._block_bytes = math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()
        if self._rank == 0:
            publish_pool_layout(self._group, num_blocks, self._block_bytes)
        settings = self._tier_settings
        host_blocks: tuple[torch.Tensor, ...] = ()
        if settings.host_enabled:
            self._host = self._host_tier_class(TierSpec(
                settings.host_blocks(self._block_bytes), block_shape, dtype, self._rank,
                pin_memory=self._cuda))
            host_blocks = self._host.pool.unbind(0)  # type: ignore[attr-defined]
        if self._groups_io is None:  # (several layer groups: refused with the leader's)
            self._shared = SharedIO.open(self._env, pool, self._cuda, self._par.tp_size,
                                         self._rank, self._block_size, self._progress,
                                         self._reporter)
            if self._shared is not None and self._rank == 0:
                publish_shared_layout(self._group, self._shared.layout)
        metrics = get_metrics()
        copies = self._copy_engine = CopyEngine(pool.device, self._cuda, self._block_bytes,
                                                self._rank, metrics)
        staging = DiskStaging(pool, block_shape, dtype, self._groups_io, copies.side_stream)
        self._disk_io = DiskIO(self._rank, self._block_bytes, staging, self._progress,
                               self._reporter, self._counters, metrics)
        if self._groups_io is not None:
            self._barrier = GroupSaveBarrier(self._groups_io, self._rank, copies.side_stream,
                                             self._progress, self._reporter, self._counters)
        self._transfers = TransferThread(
            self._rank, DevicePool(pool, pool_blocks, self._groups_io, self._block_bytes),
            TierIO(self._host, host_blocks, self._disk_io, self._shared), copies,
            self._barrier, self._progress, self._reporter, self._counters)

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
            # TRT-LLM freed these requests' blocks (a cancel during an async load): queued
            # copies into them never write; the ones writing now end before this pass's
            # forward or loads (at most OP_TIMEOUT_S).
            self._progress.fence(metadata.fences, OP_TIMEOUT_S)
        self._progress.expect(metadata)
        if metadata.saves or metadata.demotes or metadata.shared_saves:
            self._pending_save_meta = metadata

    def start_load_kv(self, stream: Any) -> None:
        """Called every iteration on every rank after ``bind_connector_meta``, before the forward
        pass. Enqueues this iteration's onboarding; the requests are async-loading (TRT-LLM keeps
        them out of the batch until ``get_finished`` returns them), so nothing waits here."""
        meta = self.get_connector_meta()
        if isinstance(meta, ConnectorMetadata) and meta.loads and self._transfers is not None:
            self._transfers.put_loads(meta.loads)

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
        return self._progress.finished(finished_gen_req_ids, started_loading_req_ids)

    def get_block_ids_with_load_errors(self) -> list[int]:
        """Device block ids whose promised load failed since the last call (each reported
        once; worker/load_errors.py). Called by TensorRT-LLM's connector manager
        (``handle_load_errors``) on the rank's executor thread; no I/O, no wait."""
        return self._progress.load_errors.take()

    # ------------------------------------------------------------------ helpers (executor)

    def _on_forward_done(self) -> None:
        import torch

        self._enqueue_saves(torch.cuda.current_stream() if self._cuda else None)

    def _enqueue_saves(self, stream: Any) -> None:
        meta = self._pending_save_meta
        if meta is None or self._transfers is None:
            return
        self._pending_save_meta = None
        event = None
        if self._cuda:
            import torch

            event = torch.cuda.Event()
            event.record(stream if stream is not None else torch.cuda.current_stream())
        barrier = self._barrier  # several layer groups: see worker.layer_groups
        issue = SaveIssue() if barrier is not None else None
        self._transfers.put_saves(meta, event, issue)
        if barrier is not None and issue is not None:
            barrier.await_issue(issue, stream)

    def _apply_layout(self, layout: TierLayout) -> None:
        if layout == self._layout:
            return
        self._layout = layout
        host_capacity = 0 if self._host is None else self._host.capacity
        if layout.host_blocks != host_capacity:
            logger.error("rank %d: leader sized the host tier at %d blocks, this rank has %d; "
                         "ops outside this rank's pool will fail", self._rank,
                         layout.host_blocks, host_capacity)
        disk = self._disk_io
        if layout.disk_blocks and disk is not None and disk.tier is None:
            disk.tier = self._disk_tier_class(TierSpec(
                layout.disk_blocks, self._tier_shape, self._tier_dtype, self._rank,
                directory=layout.disk_dir, identity=self._disk_identity))

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, int]:
        """Counters (bytes/blocks moved, failures); any thread."""
        out = self._counters.snapshot()
        out["saves_inflight"], out["loads_inflight"] = self._progress.inflight()
        if self._shared is not None:
            out.update(self._shared.stats())
        return out

    def idle(self) -> bool:
        """True when no transfer is queued or in flight on this rank (tests, benchmarks)."""
        return not self._progress.busy() and self._pending_save_meta is None \
            and (self._transfers is None or self._transfers.idle()) \
            and (self._disk_io is None or self._disk_io.idle()) \
            and (self._shared is None or self._shared.idle())

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the threads after they ran what is queued (bounded by ``timeout``; pending
        copies still unfinished then are failed), close tiers; idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        transfers, copies, disk = self._transfers, self._copy_engine, self._disk_io
        if transfers is not None and copies is not None and disk is not None:
            self._enqueue_saves(None)
            # Stop order: the transfer thread first (the jobs it still runs may queue disk
            # writes, which the disk thread must see before its own stop); on its way out it
            # stops the copy engine's completion thread, after the batches already issued.
            transfers.stop()
            self._join(transfers.thread, deadline, timeout)
            copies.close(deadline)
            disk.stop()
            self._join(disk.thread, deadline, timeout)
        if self._shared is not None:  # after the transfer thread: nothing stages any more
            self._shared.close(max(0.0, deadline - time.monotonic()))
        if disk is not None:
            disk.close()
        if self._host is not None:
            self._host.close()
        self._reporter.close()

    def _join(self, thread: Any, deadline: float, timeout: float) -> None:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            logger.warning("rank %d: %s did not stop within %.1f s", self._rank, thread.name,
                           timeout)
