"""TensorRT-LLM's ``KvCacheConnectorManager`` for the simulated engine.

Follows the classic manager (``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``,
NVIDIA/TensorRT-LLM@00fdcbff5ad8; the same logic moved to
``connectors/kv_cache_connector.py`` in 1.3.0rc14):

* every scheduler call goes through ``_run_on_leader(lambda: scheduler.<call>(...))``, whose
  result is broadcast (``mpi_broadcast``: here a pickle round trip), so the connector sees the
  same call stack depth as on the real engine: ``PyExecutor._kv_connector_start_batch`` →
  ``handle_metadata`` → ``_run_on_leader`` → the lambda → ``build_connector_meta``;
* ``get_num_new_matched_tokens`` records ``external_loads``; ``build_scheduler_output`` skips
  requests that start an async load this iteration, subtracts ``external_loads`` from the first
  report's ``computed_position``, and then clears ``external_loads`` (every build): a request
  whose async load finishes later therefore first appears with its full position;
* ``get_finished`` calls every rank's worker, then acts on an id only once every rank returned
  it (the ``mpi_allgather`` intersection);
* attention DP (``enable_attention_dp``, ``connectors/kv_cache_connector.py`` @ 035ab91cad04):
  both classes must declare ``supports_attention_dp = True`` (``validate_attention_dp``), every
  rank has its own manager and scheduler, ``_run_on_leader`` runs locally (no broadcast), and
  ``build_scheduler_output`` names the rank (``SchedulerOutput.attention_dp_rank``).

Called only from the engine's executor thread.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

from kvbm_plugin.testing.fake_trtllm import RequestData, SchedulerOutput


class SimKvCacheConnectorManager:
    """Connector state across ranks: the scheduler (rank 0) and every rank's worker."""

    def __init__(self, scheduler: Any, ranks: Sequence[Any], *,
                 attention_dp_rank: int | None = None) -> None:
        if attention_dp_rank is not None:
            for connector in (scheduler, *(getattr(r, "worker", None) for r in ranks)):
                if connector is not None and \
                        getattr(type(connector), "supports_attention_dp", False) is not True:
                    raise NotImplementedError(
                        "The connector must declare supports_attention_dp=True and implement "
                        "owner-local scheduling/transfers against a shared pool.")
        self.attention_dp_rank = attention_dp_rank
        self.scheduler = scheduler
        self.ranks = list(ranks)
        self.external_loads: dict[int, int] = {}
        self.new_saving: list[int] = []  # not yet passed to get_finished
        self.new_loading: list[int] = []
        self._local_saved: list[set[int]] = [set() for _ in self.ranks]
        self._local_loaded: list[set[int]] = [set() for _ in self.ranks]
        self._reported: set[int] = set()  # requests already in some SchedulerOutput
        self._scheduler_output: SchedulerOutput | None = None
        self.get_finished_calls = 0
        self.metadata_builds = 0

    def _run_on_leader(self, f: Callable[[], Any]) -> Any:
        """Run on rank 0 and broadcast: every rank gets its own unpickled copy (attention DP:
        locally, no broadcast)."""
        if self.attention_dp_rank is not None:
            return f()
        return pickle.loads(pickle.dumps(f()))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        num_tokens, load_async = self._run_on_leader(
            lambda: self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens))
        if num_tokens == 0 and load_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if load_async:
            self.new_loading.append(request.request_id)
        self.external_loads[request.request_id] = num_tokens
        return num_tokens

    def is_loading(self, req_id: int) -> bool:
        return req_id in self.new_loading

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Rank 0 only, no broadcast."""
        self.scheduler.update_state_after_alloc(request, block_ids)

    def update_state_after_alloc_by_layer_group(self, request: Any,
                                                block_ids_by_layer_group: list[list[int]]
                                                ) -> None:
        """Rank 0 only: the per-group form, called instead of the flat one when the cache has
        several layer groups (``connectors/kv_cache_connector.py`` @ 035ab91cad04)."""
        self.scheduler.update_state_after_alloc_by_layer_group(request,
                                                               block_ids_by_layer_group)

    def pending_load_ids(self) -> set[int]:
        """Requests whose async load started in this pass (``new_async_requests.loading``)."""
        return set(self.new_loading)

    def take_scheduled_requests_pending_load(self, scheduled: Sequence[int]) -> set[int]:
        """The scheduled requests that wait for an async load and leave the batch (called
        after the building ``handle_metadata``, as ``_kv_connector_start_batch`` does)."""
        return set(scheduled) & set(self.new_loading)

    def build_scheduler_output(self, entries: Sequence[tuple[int, RequestData]]) -> None:
        """``entries``: (request id, RequestData with the cumulative-delta fields filled and
        ``computed_position`` as TRT-LLM reads it from the request) for the scheduled batch,
        after the token-budget trim; requests that start an async load this pass are left
        out, as upstream."""
        output = SchedulerOutput(attention_dp_rank=self.attention_dp_rank)
        loading = set(self.new_loading)
        for req_id, data in entries:
            if req_id in loading:
                continue
            if req_id in self.external_loads:
                data.computed_position -= self.external_loads[req_id]
            if req_id in self._reported:
                output.cached_requests.append(data)
            else:
                self._reported.add(req_id)
                output.new_requests.append(data)
        self.external_loads = {}
        self._scheduler_output = output

    def handle_metadata(self) -> None:
        """``build_connector_meta`` on rank 0 through ``_run_on_leader``; the pickled result is
        bound on every rank. Returns at once when no scheduler output was built this pass
        (``kv_cache_connector.py`` @ 035ab91cad04: ``if self._scheduler_output is None``)."""
        output = self._scheduler_output
        if output is None:
            return  # no batch was prepared this pass: no build, no bind (upstream)
        metadata = self._run_on_leader(lambda: self.scheduler.build_connector_meta(output))
        self._scheduler_output = None
        self.metadata_builds += 1
        meta_bytes = pickle.dumps(metadata)
        for rank in self.ranks:
            rank.bind(meta_bytes)

    def request_finished(self, request: Any, cache_block_ids: list[int],
                         cache_block_ids_by_layer_group: list[list[int]] | None = None
                         ) -> bool:
        """Upstream's form: with per-group lists (several layer groups) the scheduler's
        ``request_finished_by_layer_group``, else the flat ``request_finished``."""
        if cache_block_ids_by_layer_group:
            saving = self._run_on_leader(
                lambda: self.scheduler.request_finished_by_layer_group(
                    request, cache_block_ids_by_layer_group))
        else:
            saving = self._run_on_leader(
                lambda: self.scheduler.request_finished(request, cache_block_ids))
        if saving:
            self.new_saving.append(request.request_id)
        return bool(saving)

    def forget(self, req_id: int) -> None:
        self._reported.discard(req_id)

    def handle_load_errors(self, requests: Sequence[Any], kv_cache_manager: Any) -> list[Any]:
        """The requests among ``requests`` that use a block whose load failed on any rank.

        Upstream's manager (``handle_load_errors(requests, kv_cache_manager)``, as its stored
        test shows it: TensorRT-LLM ``tests/unittest/_torch/test_connector.py``, stored id
        56134997080): the worker's ``get_block_ids_with_load_errors()`` is called once (here
        on every rank, united: each rank's worker knows only its own copies); no failed block:
        ``[]``; else each request's ``kv_cache_manager.get_cache_indices(req)`` is read, a
        request whose indices cannot be read (already freed) is skipped, and the requests
        holding a failed block are returned, in ``requests`` order."""
        failed: set[int] = set()
        for rank in self.ranks:
            failed.update(rank.load_errors())
        if not failed:
            return []
        affected = []
        for request in requests:
            try:
                indices = kv_cache_manager.get_cache_indices(request)
            except Exception:
                continue
            if failed.intersection(indices):
                affected.append(request)
        return affected

    def get_finished(self) -> tuple[set[int], set[int]]:
        """Every rank's ``get_finished``, then the all-rank intersection: (saved, loaded)."""
        self.get_finished_calls += 1
        saving, loading = self.new_saving, self.new_loading
        self.new_saving, self.new_loading = [], []
        for rank in self.ranks:
            rank.start_get_finished(saving, loading)
        for i, rank in enumerate(self.ranks):
            saved, loaded = rank.finish_get_finished()
            self._local_saved[i].update(saved)
            self._local_loaded[i].update(loaded)
        done_saving = set.intersection(*self._local_saved)
        done_loading = set.intersection(*self._local_loaded)
        for s in self._local_saved:
            s.difference_update(done_saving)
        for s in self._local_loaded:
            s.difference_update(done_loading)
        return done_saving, done_loading
