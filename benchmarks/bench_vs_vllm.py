"""The GPU-tier publish path's CPU per block, beside vLLM's own KV-event publisher, in one run.

What is compared, per published block (stored + removed), all threads of the publishing side:

- ours, dict input: ``KvEventSink.ingest`` of TensorRT-LLM's buffered event dicts (the C++
  ``KVCacheManager``'s events in ``KVCacheEventSerializer`` form) and ``flush``, on the engine
  thread, which (``sends="caller"``) also sends; plus our publisher's service thread.
- ours, V2 hooks: KVCacheManagerV2's event-manager calls on the sink and
  ``flush_iteration_events``; plus the service thread.
- vLLM 0.34: what its engine thread does for the same blocks only because events are on
  (``vllm/v1/core/block_pool.py`` of the 0.34.0 wheel: for a newly cached full block, under
  ``if self.enable_kv_cache_events``, the parent's and the block's 32-byte hashes made wire
  ints by ``maybe_convert_block_hash`` (``int.from_bytes`` masked to 64 bits: the default
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), the block's token ids sliced from
  ``request.all_token_ids`` and a ``BlockStored``; for an evicted one,
  ``_emit_block_removed_events``: the hash and group id cut from the ``BlockHashWithGroupId``
  and a ``BlockRemoved``), the ``KVEventBatch`` around them and ``ZmqEventPublisher.publish``
  (a queue put), plus its ``zmq-publisher`` thread (msgspec encode, seq, 3-frame send, replay
  buffer). Not counted, in vLLM's favour: ``generate_event_extra_keys`` (LoRA, multimodal
  and salt keys; none here) and the scheduler's hand-over of the queue. The publisher's source
  is ``vllm/distributed/kv_events.py`` of the wheel, executed here with the four vLLM imports
  it needs stubbed (``KVEventsConfig``, ``init_logger``, the network helpers,
  ``ExternalBlockHash``); nothing else of vLLM is loaded, and the steps above are written
  out here as the wheel's lines do them. The input each side reads (our event dicts or V2
  block objects; vLLM's hash bytes and token lists) is built right before each iteration,
  untimed.

Stream: per iteration, N requests each fill one block of 32 tokens and one old block is
evicted before each (N stored + N removed, interleaved), N = 64 and 256. The prefill shape:
per iteration N / 64 requests each store a 64-block prompt after 64 evictions (ours: one
removal of 64 hashes, as TensorRT-LLM's event manager merges them, and one store of the 64
blocks and the prompt's partial last block, which the sink suppresses; vLLM's
``cache_full_blocks``: a ``BlockRemoved`` per evicted block and one ``BlockStored`` of the
64, its extra keys not generated, in its favour). Each side's messages go
over tcp loopback to a SUB in another process that decodes them and must count every block.
CPU is each thread's own clock (``time.thread_time``, ``pthread_getcpuclockid``). Target:
ours <= 0.5x of vLLM's on every input path at both sizes.

Where the vLLM source is found: ``KVBM_BENCH_VLLM_SOURCE`` (the wheel, or its
``kv_events.py``), else an installed ``vllm`` package's file (located without importing it).
Without it the rows say so and measure nothing: ``pip download --no-deps vllm==0.34.0``.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import random
import statistics
import sys
import time
import types
import zipfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks._table import Row, print_table
from benchmarks.bench_event_sink import (
    _free_port,
    _publisher_thread_clock,
    _start_receiver,
    _thread_cpu_clock,
    _v2_feed,
    _wait_sent,
)
from kvbm_plugin.consolidator_config import Endpoint, PublisherSettings
from kvbm_plugin.event_sink import KvEventSink
from kvbm_plugin.events.source import SERIALIZE_CHUNK
from kvbm_plugin.wire.publisher import ZmqEventPublisher

BLOCK_SIZE = 32
SIZES = (64, 256)  # blocks stored (and as many removed) per iteration
TARGET = 0.5
_SOURCE_ENV = "KVBM_BENCH_VLLM_SOURCE"
_MEMBER = "vllm/distributed/kv_events.py"


def _vllm_source() -> str | None:
    """vLLM's ``kv_events.py`` text (module docstring: where it is looked for), or None."""
    given = os.environ.get(_SOURCE_ENV)
    if given:
        path = Path(given)
        if path.suffix == ".whl":
            with zipfile.ZipFile(path) as wheel:
                return wheel.read(_MEMBER).decode("utf-8")
        return path.read_text("utf-8")
    spec = importlib.util.find_spec("vllm")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "distributed" / "kv_events.py"
    return path.read_text("utf-8") if path.is_file() else None


def load_vllm_kv_events(source: str) -> types.ModuleType:
    """Execute vLLM's ``kv_events.py`` with the imports it needs from vLLM stubbed."""
    stubs: dict[str, types.ModuleType] = {}

    def stub(name: str, **attrs: Any) -> None:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        stubs[name] = module

    for parent in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"):
        stub(parent)
    stub("vllm.config.kv_events", KVEventsConfig=lambda **kw: SimpleNamespace(**kw))
    stub("vllm.logger", init_logger=logging.getLogger)
    stub("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
         get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
         is_valid_ipv6_address=lambda ip: False,
         split_zmq_path=lambda path: tuple(path.rsplit(":", 2)))
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        module = types.ModuleType("vllm_kv_events_0_34")
        sys.modules[module.__name__] = module  # msgspec resolves the Structs' annotations here
        exec(compile(source, _MEMBER, "exec"), module.__dict__)  # noqa: S102 (vLLM's source)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def _blocks(per_iter: int, iterations: int, seed: int
            ) -> Iterator[list[tuple[int, int, int, list[int]]]]:
    """Per iteration: (evicted hash, parent hash, new hash, token ids) for each request, each
    iteration made when asked for. Hashes are unsigned 64-bit (TensorRT-LLM's)."""
    rnd = random.Random(seed)
    chains = [rnd.getrandbits(64) for _ in range(per_iter)]
    for it in range(iterations):
        rows = []
        for r in range(per_iter):
            h = rnd.getrandbits(64)
            base = (it * per_iter + r) * BLOCK_SIZE
            rows.append((rnd.getrandbits(64), chains[r], h, list(range(base, base + BLOCK_SIZE))))
            chains[r] = h
        yield rows


def _dicts(rows: list[tuple[int, int, int, list[int]]]) -> list[dict[str, Any]]:
    """One iteration as TensorRT-LLM's serializer hands it over (removed, stored, ...)."""
    evs: list[dict[str, Any]] = []
    for i, (gone, parent, h, tokens) in enumerate(rows):
        evs.append({"event_id": 2 * i, "window_size": 4096,
                    "data": {"type": "removed", "block_hashes": [gone]}})
        evs.append({"event_id": 2 * i + 1, "window_size": 4096, "data": {
            "type": "stored", "parent_hash": parent, "blocks": [{
                "type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                           for t in tokens]}]}})
    return evs


PROMPT = 64  # blocks per prompt in the prefill shape


def _prompts(per_iter: int, iterations: int, seed: int
             ) -> Iterator[list[tuple[list[int], list[int], list[int]]]]:
    """Per iteration, per_iter // PROMPT prompts: (evicted hashes, new hashes, token ids of
    the full blocks). Hashes are unsigned 64-bit (TensorRT-LLM's)."""
    rnd = random.Random(seed)
    for it in range(iterations):
        rows = []
        for r in range(per_iter // PROMPT):
            base = (it * per_iter + r * PROMPT) * BLOCK_SIZE
            rows.append(([rnd.getrandbits(64) for _ in range(PROMPT)],
                         [rnd.getrandbits(64) for _ in range(PROMPT)],
                         list(range(base, base + PROMPT * BLOCK_SIZE))))
        yield rows


def _prompt_dicts(rows: list[tuple[list[int], list[int], list[int]]]) -> list[dict[str, Any]]:
    """One prefill iteration as TensorRT-LLM's serializer hands it over: per prompt the merged
    removal, then the store of its blocks (the last one partial: 5 tokens)."""
    evs: list[dict[str, Any]] = []
    for gone, hashes, tokens in rows:
        evs.append({"event_id": len(evs), "window_size": 4096,
                    "data": {"type": "removed", "block_hashes": gone}})
        blocks = [{"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                   "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                              for t in tokens[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE]]}
                  for k, h in enumerate(hashes)]
        blocks.append({"type": "stored_block", "block_hash": (hashes[-1] + 1) & _U64,
                       "cache_level": 0, "priority": 35,
                       "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                  for t in range(5)]})
        evs.append({"event_id": len(evs), "window_size": 4096, "data": {
            "type": "stored", "parent_hash": None, "blocks": blocks}})
    return evs


def _v2_calls(per_iter: int, iterations: int) -> Iterator[list[tuple[str, Any]]]:
    """Per iteration, KVCacheManagerV2's hook calls for the same shape of stream: each store
    after the eviction of a block published earlier (unknown keys in the first iterations)."""
    rnd = random.Random(2)
    root = SimpleNamespace(ordinal=-1, key=b"\0" * 32)
    heads: list[Any] = [root] * per_iter
    stored: list[bytes] = []
    for it in range(iterations):
        calls: list[tuple[str, Any]] = []
        for r in range(per_iter):
            calls.append(("remove", stored.pop(0) if len(stored) > 2 * per_iter
                          else rnd.randbytes(32)))
            parent = heads[r]
            prev = parent if parent is root else SimpleNamespace(key=parent.key,
                                                                 ordinal=parent.ordinal)
            base = (it * per_iter + r) * BLOCK_SIZE
            block = SimpleNamespace(key=rnd.randbytes(32),
                                    tokens=list(range(base, base + BLOCK_SIZE)),
                                    prev=prev, ordinal=prev.ordinal + 1)
            calls.append(("store", block))
            stored.append(block.key)
            heads[r] = block
        yield calls


def _run_ours(per_iter: int, iterations: int, feed: Callable[[KvEventSink, Any], float],
              inputs: Iterator[Any], expect: int) -> float:
    """Publish-side CPU us per block of our sink + publisher (engine + service thread);
    ``feed`` feeds one iteration and returns the engine thread's CPU seconds it timed."""
    port = _free_port()
    pub = ZmqEventPublisher(PublisherSettings(), Endpoint("tcp", port=port))
    sink = KvEventSink(pub, block_size=BLOCK_SIZE)
    proc, conn = _start_receiver(port, expect, lambda: pub.publish([]))
    _wait_sent(pub)
    service = _publisher_thread_clock(pub)
    gc.collect()
    cpu, s0 = 0.0, service()
    for item in inputs:
        cpu += feed(sink, item)
    _wait_sent(pub)
    cpu += service() - s0
    got = conn.recv()[0] if conn.poll(60) else 0
    proc.join(5)
    sink.shutdown()
    if got != expect:
        raise RuntimeError(f"ours, {per_iter} blocks per iteration: {got} of {expect} blocks "
                           "received")
    return cpu / expect * 1e6


def _feed_whole(sink: KvEventSink, rows: list[tuple[int, int, int, list[int]]]) -> float:
    """The iteration's dicts all built first, then ingested (the source before it sliced)."""
    events = _dicts(rows)  # untimed: TensorRT-LLM's serializer
    t0 = time.thread_time()
    sink.ingest(events)
    sink.flush()
    return time.thread_time() - t0


def _feed_sliced(sink: KvEventSink, rows: list[tuple[int, int, int, list[int]]]) -> float:
    """As ``events.source`` feeds a drain: SERIALIZE_CHUNK events serialized (untimed),
    ingested, the next slice; then the iteration's flush."""
    cpu = 0.0
    per_slice = SERIALIZE_CHUNK // 2  # two events (a removal, a store) per row
    for start in range(0, len(rows), per_slice):
        events = _dicts(rows[start:start + per_slice])
        t0 = time.thread_time()
        sink.ingest(events)
        cpu += time.thread_time() - t0
        del events
    t0 = time.thread_time()
    sink.flush()
    return cpu + time.thread_time() - t0


def _feed_prompts(sink: KvEventSink, rows: list[tuple[list[int], list[int], list[int]]]
                  ) -> float:
    """The prefill shape, as the source feeds a drain (its events serialized untimed)."""
    events = _prompt_dicts(rows)
    t0 = time.thread_time()
    sink.ingest(events)
    sink.flush()
    return time.thread_time() - t0


def _feed_v2(sink: KvEventSink, calls: list[tuple[str, Any]]) -> float:
    t0 = time.thread_time()
    _v2_feed(sink, calls)
    return time.thread_time() - t0


_U64 = (1 << 64) - 1
_GROUP_0 = (0).to_bytes(4, "big")


def _vllm_rows(per_iter: int, iterations: int) -> Iterator[list[tuple[bytes, bytes, bytes,
                                                                         list[int]]]]:
    """vLLM's side of :func:`_blocks`: per request the evicted block's ``BlockHashWithGroupId``
    (32-byte hash + group id), the parent's and the new block's 32-byte hashes and the
    request's token ids so far (its last block the new one)."""
    rnd = random.Random(5)
    chains = [rnd.randbytes(32) for _ in range(per_iter)]
    for it in range(iterations):
        rows = []
        for r in range(per_iter):
            h = rnd.randbytes(32)
            base = (it * per_iter + r) * BLOCK_SIZE
            rows.append((rnd.randbytes(32) + _GROUP_0, chains[r], h,
                         list(range(base - BLOCK_SIZE, base + BLOCK_SIZE))))
            chains[r] = h
        yield rows


def _run_vllm(kv: types.ModuleType, expect: int, inputs: Iterator[Any],
              events_of: Callable[[types.ModuleType, Any], list[Any]], what: str) -> float:
    """Publish-side CPU us per block of vLLM's engine-thread events and its publisher: for
    each item of ``inputs`` (built untimed), ``events_of`` makes the iteration's events as
    vLLM's engine thread does (timed), published as one ``KVEventBatch``; ``expect`` blocks
    must reach the receiver."""
    port = _free_port()
    pub = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", topic="")  # "*": binds
    batch = kv.KVEventBatch
    proc, conn = _start_receiver(port, expect, lambda: pub.publish(batch(ts=time.time(),
                                                                         events=[])))
    thread_cpu = _thread_cpu_clock(pub._thread)
    deadline = time.monotonic() + 30
    while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.001)  # poll: the probes are sent before timing starts
    gc.collect()
    cpu, p0 = 0.0, thread_cpu()
    for item in inputs:
        t0 = time.thread_time()
        pub.publish(batch(ts=time.time(), events=events_of(kv, item)))
        cpu += time.thread_time() - t0
    deadline = time.monotonic() + 60
    while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.001)  # poll: until its thread has sent every batch
    cpu += thread_cpu() - p0
    got = conn.recv()[0] if conn.poll(60) else 0
    proc.join(5)
    pub.shutdown()
    if got != expect:
        raise RuntimeError(f"vLLM, {what}: {got} of {expect} blocks received")
    return cpu / expect * 1e6


def _vllm_decode(kv: types.ModuleType, rows: list[tuple[bytes, bytes, bytes, list[int]]]
                 ) -> list[Any]:
    """One decode iteration's events (``block_pool.py``: ``_emit_block_removed_events``,
    then the cached block's ``BlockStored``), per request."""
    stored, removed, gpu = kv.BlockStored, kv.BlockRemoved, kv.MEDIUM_GPU
    start, end = BLOCK_SIZE, 2 * BLOCK_SIZE
    events: list[Any] = []
    for gone, parent, h, all_token_ids in rows:
        events.append(removed(block_hashes=[int.from_bytes(gone[:-4], "big") & _U64],
                              medium=gpu, group_idx=int.from_bytes(gone[-4:], "big")))
        events.append(stored(block_hashes=[int.from_bytes(h, "big") & _U64],
                             parent_block_hash=int.from_bytes(parent, "big") & _U64,
                             token_ids=all_token_ids[start:end], block_size=end - start,
                             lora_id=None, medium=gpu, lora_name=None, extra_keys=None,
                             group_idx=0, session_id=None, lookahead_token_ids=None))
    return events


def _vllm_prompts(per_iter: int, iterations: int
                  ) -> Iterator[list[tuple[list[bytes], list[bytes], list[int]]]]:
    """vLLM's side of :func:`_prompts`: per prompt the evicted blocks'
    ``BlockHashWithGroupId`` s, the new blocks' 32-byte hashes and the prompt's token ids."""
    rnd = random.Random(6)
    for _ in range(iterations):
        yield [([rnd.randbytes(32) + _GROUP_0 for _ in range(PROMPT)],
                [rnd.randbytes(32) for _ in range(PROMPT)],
                list(range(PROMPT * BLOCK_SIZE + 5))) for _ in range(per_iter // PROMPT)]


def _vllm_prefill(kv: types.ModuleType,
                  prompts: list[tuple[list[bytes], list[bytes], list[int]]]) -> list[Any]:
    """One prefill iteration's events: per prompt a ``BlockRemoved`` per evicted block
    (``_emit_block_removed_events``) and one ``BlockStored`` of its blocks
    (``cache_full_blocks``: each hash made a wire int, the token ids sliced once)."""
    stored, removed, gpu = kv.BlockStored, kv.BlockRemoved, kv.MEDIUM_GPU
    events: list[Any] = []
    for gone, hashes, all_token_ids in prompts:
        for g in gone:
            events.append(removed(block_hashes=[int.from_bytes(g[:-4], "big") & _U64],
                                  medium=gpu, group_idx=int.from_bytes(g[-4:], "big")))
        events.append(stored(block_hashes=[int.from_bytes(h, "big") & _U64 for h in hashes],
                             parent_block_hash=None,
                             token_ids=all_token_ids[0:PROMPT * BLOCK_SIZE],
                             block_size=BLOCK_SIZE, lora_id=None, medium=gpu, lora_name=None,
                             extra_keys=None, group_idx=0, session_id=None,
                             lookahead_token_ids=None))
    return events


def _v2_expected(per_iter: int, iterations: int) -> int:
    from kvbm_plugin.wire.publisher import NullEventPublisher

    counter = KvEventSink(NullEventPublisher(PublisherSettings()), block_size=BLOCK_SIZE)
    for calls in _v2_calls(per_iter, iterations):
        _v2_feed(counter, calls)
    st = counter.stats()
    return int(st["blocks_stored"] + st["blocks_removed"])


def run(quick: bool = False) -> list[Row]:
    """Paired rounds per size (ours dict, ours V2, vLLM back to back); medians."""
    name = "publish_vs_vllm"
    source = _vllm_source()
    if source is None:
        return [Row(name, f"skipped: vLLM 0.34's kv_events.py not found (set {_SOURCE_ENV})",
                    0.0, "-")]
    kv = load_vllm_kv_events(source)
    rounds = 1 if quick else 5
    rows: list[Row] = []
    for per_iter in SIZES:
        iterations = max(20, (3000 if not quick else 600) // per_iter)
        expect = 2 * per_iter * iterations
        v2_expect = _v2_expected(per_iter, iterations)
        dict_rows = partial(_blocks, per_iter, iterations, 5)
        paths: dict[str, tuple[Callable[[KvEventSink, Any], float], Callable[[], Any], int]] = {
            "dict input (sliced, as the source feeds it)": (_feed_sliced, dict_rows, expect),
            "V2 hooks": (_feed_v2, partial(_v2_calls, per_iter, iterations), v2_expect),
            "dict input, whole iteration at once (info)": (_feed_whole, dict_rows, expect),
        }
        ours: dict[str, list[float]] = {label: [] for label in paths}
        ratios: dict[str, list[float]] = {label: [] for label in paths}
        vllm_us = []
        for _ in range(rounds):  # paired: each round runs every path and vLLM back to back
            b = _run_vllm(kv, expect, _vllm_rows(per_iter, iterations), _vllm_decode,
                          f"{per_iter} blocks per iteration")
            vllm_us.append(b)
            for label, (feed, inputs, want) in paths.items():
                v = _run_ours(per_iter, iterations, feed, inputs(), want)
                ours[label].append(v)
                ratios[label].append(v / b)
        prefill, prefill_ratio, vllm_prefill = [], [], []
        for _ in range(rounds):  # the prefill shape, paired the same way
            b = _run_vllm(kv, expect, _vllm_prompts(per_iter, iterations), _vllm_prefill,
                          f"prefill, {per_iter} blocks per iteration")
            v = _run_ours(per_iter, iterations, _feed_prompts,
                          _prompts(per_iter, iterations, 7), expect)
            prefill.append(v)
            prefill_ratio.append(v / b)
            vllm_prefill.append(b)
        ratio = statistics.median(prefill_ratio)
        rows.append(Row(name, "publish CPU per block, dict input, the prefill shape (one "
                              f"{PROMPT}-block store per prompt), {per_iter}+{per_iter} "
                              f"blocks/iteration (median ratio {ratio:.2f}x, "
                              f"{min(prefill_ratio):.2f}-{max(prefill_ratio):.2f}x over "
                              f"{rounds} rounds)", statistics.median(prefill), "us/blk",
                        statistics.median(vllm_prefill),
                        f"<= {TARGET}x vLLM 0.34", ratio <= TARGET))
        base = statistics.median(vllm_us)
        for label in paths:
            ratio = statistics.median(ratios[label])
            info = label.endswith("(info)")
            rows.append(Row(name, f"publish CPU per block, {label}, {per_iter}+{per_iter} "
                                  f"blocks/iteration (median ratio {ratio:.2f}x, "
                                  f"{min(ratios[label]):.2f}-{max(ratios[label]):.2f}x over "
                                  f"{rounds} rounds)",
                            statistics.median(ours[label]), "us/blk", base,
                            "" if info else f"<= {TARGET}x vLLM 0.34",
                            None if info else ratio <= TARGET))
    return rows


if __name__ == "__main__":
    print_table(run(quick="--quick" in sys.argv))
