"""The ranks of a simulated engine: in the engine's process, or each in its own process.

On a real TP>1 deployment every rank is its own MPI process: rank 0 holds the scheduler (the
leader) and a worker; ranks 1.. hold only a worker, receive the leader's metadata as a pickled
broadcast and send their completion reports to the leader over ZMQ
(``DYN_KVBM_LEADER_ZMQ_PUB_PORT``, see connector/meta.py). :class:`RemoteRank` reproduces that:
a ``multiprocessing`` child (spawn start method, nothing inherited) builds its own
``KvbmConnectorWorker`` and pool shard, gets the pickled metadata and the forward's work over a
pipe, runs the iteration's worker calls in TRT-LLM's order, and answers ``get_finished``.

Both rank kinds have the same interface; the engine starts an iteration on every rank before
waiting for any (ranks run concurrently) and calls them from its executor thread only.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvbm_plugin.testing.child import ChildProcess
from kvbm_plugin.testing.kvmodel import BatchItems, KvModel

_REPLY_TIMEOUT_S = 120.0


class LocalRank:
    """A rank whose worker lives in the engine's process (rank 0, or every rank in-process)."""

    def __init__(self, rank: int, worker: Any, model: KvModel, pool: Any) -> None:
        self.rank = rank
        self.worker = worker
        self.model = model
        self.pool = pool
        self._callable = worker.register_forward_pass_callable()
        worker.register_kv_caches(self.pool)
        self._finished: tuple[list[int], list[int]] = ([], [])

    def _stream(self) -> Any:
        if self.pool.is_cuda:
            import torch

            return torch.cuda.current_stream()
        return None

    def bind(self, meta_bytes: bytes) -> None:
        """The metadata broadcast reaching this rank: ``bind_connector_meta``."""
        self.worker.bind_connector_meta(pickle.loads(meta_bytes))

    def start_iteration(self, items: BatchItems) -> None:
        run_iteration(self.worker, self._callable, self.model, self.pool, items, self._stream())

    def finish_iteration(self) -> None:
        return None

    def start_get_finished(self, saving: list[int], loading: list[int]) -> None:
        saved, loaded = self.worker.get_finished(list(saving), list(loading))
        self._finished = (list(saved), list(loaded))

    def load_errors(self) -> list[int]:
        """``get_block_ids_with_load_errors`` (after this pass's ``get_finished``)."""
        return list(self.worker.get_block_ids_with_load_errors())

    def finish_get_finished(self) -> tuple[list[int], list[int]]:
        return self._finished

    def mismatches(self, computed: int, tokens: list[int], blocks: list[int]) -> int:
        return self.model.mismatches(self.pool, computed, tokens, blocks)

    def block_bytes(self, blocks: list[int]) -> list[bytes]:
        return pool_block_bytes(self.pool, blocks)

    def stats(self) -> dict[str, int]:
        return dict(self.worker.stats())

    def idle(self) -> bool:
        return bool(self.worker.idle())

    def shutdown(self, timeout: float) -> None:
        self.worker.shutdown(timeout)


def pool_block_bytes(pool: Any, blocks: list[int]) -> list[bytes]:
    """The raw bytes of each device block of ``pool`` (tests compare them across engines)."""
    import ctypes

    out = []
    for b in blocks:
        block = pool[b].detach().to("cpu").contiguous()
        out.append(ctypes.string_at(block.data_ptr(), block.numel() * block.element_size()))
    return out


def run_iteration(worker: Any, forward_callable: Any, model: KvModel, pool: Any,
                  items: BatchItems, stream: Any) -> None:
    """One rank's part of an iteration after the metadata was bound, in TRT-LLM's order:
    ``start_load_kv``; per decoder layer ``wait_for_layer_load``, the layer, ``save_kv_layer``
    (forward hooks); the forward-pass callable; ``wait_for_save`` (inside ``_forward_step``, so
    not without a forward)."""
    worker.start_load_kv(stream)
    if not items:
        return  # no forward pass this iteration (everything scheduled is loading)
    for layer in range(model.num_layers):
        worker.wait_for_layer_load(layer, stream)
        model.write_layer(pool, layer, items)
        worker.save_kv_layer(layer, stream)
    if forward_callable is not None:
        forward_callable()
    worker.wait_for_save(stream)


class RemoteRank(ChildProcess):
    """A rank in a child process; the same interface as :class:`LocalRank`."""

    def __init__(self, rank: int, llm_args: Any, model_kwargs: Mapping[str, Any],
                 num_blocks: int) -> None:
        self.rank = rank
        super().__init__(f"rank {rank} process", _rank_main,
                         (llm_args, dict(model_kwargs), num_blocks), name=f"sim-rank-{rank}",
                         daemon=True, reply_timeout_s=_REPLY_TIMEOUT_S)
        self._bound: bytes | None = None
        self._load_errors: list[int] = []

    def wait_ready(self) -> None:
        """Block until the child built its worker and registered its pool (raises its error)."""
        self.reply()

    def bind(self, meta_bytes: bytes) -> None:
        self._bound = meta_bytes  # sent with the iteration: one message per iteration

    def start_iteration(self, items: BatchItems) -> None:
        meta, self._bound = self._bound, None
        self.send("iteration", meta, items)

    def finish_iteration(self) -> None:
        self.reply()

    def start_get_finished(self, saving: list[int], loading: list[int]) -> None:
        self.send("get_finished", list(saving), list(loading))

    def finish_get_finished(self) -> tuple[list[int], list[int]]:
        saved, loaded, self._load_errors = self.reply()  # one message: errors come along
        return list(saved), list(loaded)

    def load_errors(self) -> list[int]:
        errors, self._load_errors = self._load_errors, []
        return errors

    def mismatches(self, computed: int, tokens: list[int], blocks: list[int]) -> int:
        return int(self.call("mismatches", computed, list(tokens), list(blocks)))

    def block_bytes(self, blocks: list[int]) -> list[bytes]:
        return list(self.call("block_bytes", list(blocks)))

    def stats(self) -> dict[str, int]:
        return dict(self.call("stats"))

    def idle(self) -> bool:
        return bool(self.call("idle"))

    def shutdown(self, timeout: float) -> None:
        self.stop(("shutdown", timeout), timeout + 5)


def shutdown_ranks(ranks: list[LocalRank | RemoteRank], timeout: float) -> None:
    """An engine's shutdown of its ranks (the engine's executor thread): each rank process
    shuts down side by side with the in-process ranks, as every rank of a deployment does in
    its own process (a worker's shutdown closes its shared-tier client: 1-2 s for Mooncake's).
    The pool's threads only send the shutdown message and wait for the child."""
    with ThreadPoolExecutor(max(1, len(ranks)), thread_name_prefix="sim-rank-shutdown") as pool:
        stopping = [pool.submit(rank.shutdown, timeout) for rank in ranks
                    if isinstance(rank, RemoteRank)]
        for rank in ranks:
            if not isinstance(rank, RemoteRank):
                rank.shutdown(timeout)
        for stopped in stopping:
            stopped.result()


def _rank_main(conn: Any, llm_args: Any, model_kwargs: dict[str, Any], num_blocks: int) -> None:
    """Child process: TRT-LLM's per-rank bring-up (worker on a 2-thread pool, the forward-pass
    callable, ``register_kv_caches``), then one request per message until shutdown."""
    worker = None
    try:
        from kvbm_plugin.connector_worker import KvbmConnectorWorker

        with ThreadPoolExecutor(max_workers=2) as pool_executor:
            worker = pool_executor.submit(KvbmConnectorWorker, llm_args).result(timeout=60)
        model = KvModel(**model_kwargs)
        kv_pool = model.new_pool(num_blocks)
        forward_callable = worker.register_forward_pass_callable()
        worker.register_kv_caches(kv_pool)
        stream = None
        if kv_pool.is_cuda:
            import torch

            stream = torch.cuda.current_stream()
        conn.send(("ok", None))
    except BaseException as exc:  # the parent raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        kind = msg[0]
        try:
            if kind == "iteration":
                _, meta, items = msg
                if meta is not None:
                    worker.bind_connector_meta(pickle.loads(meta))
                run_iteration(worker, forward_callable, model, kv_pool, items, stream)
                reply: Any = None
            elif kind == "get_finished":
                saved, loaded = worker.get_finished(msg[1], msg[2])
                reply = (list(saved), list(loaded), worker.get_block_ids_with_load_errors())
            elif kind == "mismatches":
                reply = model.mismatches(kv_pool, msg[1], msg[2], msg[3])
            elif kind == "block_bytes":
                reply = pool_block_bytes(kv_pool, msg[1])
            elif kind == "stats":
                reply = dict(worker.stats())
            elif kind == "idle":
                reply = bool(worker.idle())
            elif kind == "shutdown":
                worker.shutdown(msg[1])
                conn.send(("ok", None))
                break
            else:
                raise ValueError(f"unknown command {kind!r}")
            conn.send(("ok", reply))
        except BaseException as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    conn.close()
