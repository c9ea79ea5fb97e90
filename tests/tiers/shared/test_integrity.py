"""Integrity of shared-tier objects: a header (magic, layout digest, key, length, checksum)
checked on every load before any byte reaches the pool; a refused object is a counted,
logged load error whose device block is reported for recomputation, and it is removed from the
store if it still holds those bytes, so the next correct write repairs the key. Run on the
in-memory store, a private redis-server and a private mooncake_master."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest
import torch
from _kvwire import wait_until
from conftest import settings_for

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin._util.ratelimit import RateLimitedLog
from kvbm_plugin.connector.meta import ERR_CORRUPT, ERR_FAILED, ERR_NONE, LoadCopy, SharedSaveOp
from kvbm_plugin.testing.memory_store import MemoryStore
from kvbm_plugin.tiers.shared import frame
from kvbm_plugin.tiers.shared.keys import SharedLayout, chain_digests
from kvbm_plugin.tiers.shared.store import MISSING, OK
from kvbm_plugin.worker import shared_io
from kvbm_plugin.worker.shared_io import SharedIO, worker_layout

SHAPE = (2, 2, 50)  # a page of 800 bytes: one 512-byte row and a 288-byte tail
SENTINEL = -7.0


def _page(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g)


def _sealed(layout: SharedLayout, digest: bytes, seed: int) -> torch.Tensor:
    buf = torch.empty(frame.HEADER_BYTES + 800, dtype=torch.uint8)
    buf[frame.HEADER_BYTES:].view(torch.float32).copy_(_page(seed).flatten())
    frame.seal(buf, layout, digest, frame.layout_digest(layout))
    return buf


LAYOUT = SharedLayout("kvbm", "test-model", 1, 0, 0, 4, 800, "float32", "v1pool")
DIGEST = chain_digests(list(range(4)), 4, None)[0]


@pytest.fixture(params=["torch", "compiled"])
def checksum_way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Seal and check through the torch reference, then the compiled pass (skipped where
    it was not built), whichever ``DYN_KVBM_NATIVE`` says."""
    loops = _compiled.loops("shared_frame", {}) if request.param == "compiled" else None
    if request.param == "compiled" and loops is None:
        pytest.skip("kvbm_plugin.tiers.shared._frame_c was not built")
    monkeypatch.setattr(frame, "_default_loops", lambda: loops)
    return str(request.param)


def test_a_sealed_object_passes_and_a_flipped_byte_anywhere_is_refused(
        checksum_way: str) -> None:
    lay = frame.layout_digest(LAYOUT)
    buf = _sealed(LAYOUT, DIGEST, 1)
    frame.check(buf, DIGEST, lay)
    for i in range(buf.numel()):  # every header byte, every payload byte (rows and tail)
        buf[i] ^= 0x01
        with pytest.raises(frame.Refusal):
            frame.check(buf, DIGEST, lay)
        buf[i] ^= 0x01
    frame.check(buf, DIGEST, lay)


def test_wrong_key_layout_length_and_moved_rows_are_refused(checksum_way: str) -> None:
    lay = frame.layout_digest(LAYOUT)
    other = chain_digests(list(range(8)), 4, None)[1]
    with pytest.raises(frame.Refusal, match="another block"):
        frame.check(_sealed(LAYOUT, DIGEST, 1), other, lay)
    wide = SharedLayout("kvbm", "test-model", 2, 0, 0, 4, 800, "float32", "v1pool")
    with pytest.raises(frame.Refusal, match="another model"):
        frame.check(_sealed(wide, DIGEST, 1), DIGEST, lay)
    big = torch.zeros(frame.HEADER_BYTES + 1024, dtype=torch.uint8)
    big[frame.HEADER_BYTES:].copy_(torch.arange(1024) % 251)
    frame.seal(big, LAYOUT, DIGEST, lay)
    frame.check(big, DIGEST, lay)
    swapped = big.clone()  # two 512-byte rows exchanged: the word sum cannot see it
    swapped[frame.HEADER_BYTES:frame.HEADER_BYTES + 512] = big[frame.HEADER_BYTES + 512:]
    swapped[frame.HEADER_BYTES + 512:] = big[frame.HEADER_BYTES:frame.HEADER_BYTES + 512]
    with pytest.raises(frame.Refusal, match="checksum"):
        frame.check(swapped, DIGEST, lay)


class _Worker:
    """What SharedIO calls on its request progress and its op reporter (one stand-in for
    both)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: dict[int, tuple[bool, int]] = {}
        self.errors: list[int] = []

    def report(self, op_id: int, ok: bool, error: int = 0, signature: Any = None) -> None:
        with self.lock:
            self.reports[op_id] = (ok, error)

    def report_all(self, results: Any) -> None:  # (OpReporter's: a failure is ERR_FAILED)
        for op_id, ok in results:
            self.report(op_id, ok, ERR_NONE if ok else ERR_FAILED)

    def begin_writing(self, req_id: int, n: int = 1) -> bool:
        return True

    def written(self, req_ids: Any) -> None:
        return None

    def load_failed(self, req_id: int, blocks: Any) -> None:
        with self.lock:
            self.errors.extend(blocks)

    def load_ended(self, req_ids: Any) -> None:
        return None


@pytest.fixture(params=["memory", "redis", "mooncake"])
def two_engines(request: pytest.FixtureRequest) -> Any:
    """``make()``: a SharedIO of one more engine (its own client) on one store; ``raw`` a
    client of that store that writes whatever bytes it is given (a bad writer)."""
    kind = request.param
    ios: list[SharedIO] = []
    if kind == "memory":
        store = MemoryStore(lease_s=10.0)

        def client() -> Any:
            return store
        settings = settings_for("memory", "")
    elif kind == "redis":
        server = request.getfixturevalue("redis_server")
        factory = request.getfixturevalue("redis_store_factory")
        settings = settings_for("redis", server.address)

        def client() -> Any:
            return factory(server.address)
    else:  # the session's lent clients: the raw writer and each engine its own
        lender = request.getfixturevalue("mooncake_lender")
        # The lent master keeps other tests' objects: this test's keys are under its scope.
        settings = settings_for("mooncake", lender.master.address, model_key=lender.salt)

        def client() -> Any:
            return lender.client()

    raw = client()

    def make() -> tuple[SharedIO, _Worker, torch.Tensor]:
        pool = torch.full((4, *SHAPE), SENTINEL)
        worker = _Worker()
        layout = worker_layout(settings, pool, 1, 0, 4)
        io = SharedIO(settings, client() if kind != "memory" else store, layout, pool, False,
                      worker, worker)  # type: ignore[arg-type]
        ios.append(io)
        return io, worker, pool

    yield make, raw
    for io in ios:
        io._store = _Unclosed(io._store)  # the factories or the session close the clients
        io.close()


class _Unclosed:
    def __init__(self, store: Any) -> None:
        self.store = store

    def unregister(self, address: int) -> None:
        self.store.unregister(address)

    def close(self) -> None:
        return None


def _write(io: SharedIO, worker: _Worker, op_id: int, digest: bytes, seed: int) -> None:
    buf = io._acquire()
    assert buf is not None
    buf.copy_(_page(seed))
    io.staged_done([(SharedSaveOp(op_id, -1, -1, digest), buf)], True)
    wait_until(lambda: op_id in worker.reports, 10, "the write")
    assert worker.reports[op_id] == (True, ERR_NONE)


def _load(io: SharedIO, worker: _Worker, op_id: int, digest: bytes, block: int) -> int:
    io.submit_load([LoadCopy(op_id, 3, -1, 0, block, digest)], 1)
    wait_until(lambda: op_id in worker.reports, 10, "the load")
    return worker.reports[op_id][1]


def test_a_wrong_bytes_object_is_refused_counted_removed_and_repaired(
        two_engines: Any, caplog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_io, "_log", RateLimitedLog(shared_io.logger))  # a fresh limit
    make, raw = two_engines
    good_io, good, _ = make()
    reader, rw, pool = make()
    digests = chain_digests(list(range(12)), 4, None)
    _write(good_io, good, 1, digests[0], seed=10)
    assert _load(reader, rw, 2, digests[0], block=0) == ERR_NONE
    assert torch.equal(pool[0], _page(10))
    # A bad writer: the right key and length, wrong bytes (another block's sealed object).
    key = reader.layout.key(digests[1])
    forged = _sealed(reader.layout, digests[2], 11)
    assert raw.put([key], [(forged.data_ptr(), forged.numel())]) == [OK]
    good_io.staged_done([], True)
    assert _load(reader, rw, 3, digests[1], block=1) == ERR_CORRUPT
    assert torch.all(pool[1] == SENTINEL)  # never a byte of it in the pool
    assert rw.errors == [1]
    stats = reader.stats()
    assert stats["shared_loads_corrupt"] == 1 and stats["shared_loads_failed"] == 1
    assert stats["shared_objects_removed"] == 1
    assert "refused: holds another block's key" in caplog.text
    # Removed: the next correct write stores it (first-writer-wins no longer keeps the bad).
    _write(good_io, good, 4, digests[1], seed=12)
    assert _load(reader, rw, 5, digests[1], block=1) == ERR_NONE
    assert torch.equal(pool[1], _page(12))


def test_a_flipped_payload_byte_in_the_store_is_refused_and_a_gone_object_fails(
        two_engines: Any) -> None:
    make, raw = two_engines
    good_io, good, _ = make()
    reader, rw, pool = make()
    digests = chain_digests(list(range(8)), 4, None)
    _write(good_io, good, 1, digests[0], seed=20)
    key = reader.layout.key(digests[0])
    stored = torch.empty(frame.HEADER_BYTES + 800, dtype=torch.uint8)
    got = raw.get_into([key], [(stored.data_ptr(), stored.numel())])
    assert got == [stored.numel()]
    stored[frame.HEADER_BYTES + 700] ^= 0x10  # in the tail
    if raw.name != "mooncake":  # compare-and-delete: other bytes are left alone
        assert raw.remove_if(key, "0" * 40) == MISSING
    assert raw.remove_if(key, _fingerprint_of(raw, key)) == OK  # Mooncake: removes, no compare
    assert raw.put([key], [(stored.data_ptr(), stored.numel())]) == [OK]
    assert _load(reader, rw, 2, digests[0], block=2) == ERR_CORRUPT
    assert torch.all(pool[2] == SENTINEL)
    assert _load(reader, rw, 3, digests[1], block=3) == ERR_FAILED  # never written: gone
    assert rw.errors == [2, 3]


def _fingerprint_of(store: Any, key: str) -> str:
    buf = torch.empty(frame.HEADER_BYTES + 800, dtype=torch.uint8)
    assert store.get_into([key], [(buf.data_ptr(), buf.numel())]) == [buf.numel()]
    return frame.fingerprint(buf)


def test_a_fingerprint_is_the_sha1_redis_compares() -> None:
    import hashlib

    buf = _sealed(LAYOUT, DIGEST, 3)
    assert frame.fingerprint(buf) == hashlib.sha1(
        ctypes.string_at(buf.data_ptr(), buf.numel())).hexdigest()


@pytest.mark.parametrize("two_engines", ["memory", "redis", "mooncake"], indirect=True)
@pytest.mark.parametrize("extra", [-frame.HEADER_BYTES, 100], ids=["page-only", "longer"])
def test_an_object_of_another_size_is_not_loaded_and_is_removed_for_the_next_write(
        two_engines: Any, extra: int, expect_errors: Any) -> None:
    """Another length under the right key (an older format's bare page, a bad writer): a
    failed load, removed, and the next correct write stores the key again."""
    make, raw = two_engines
    good_io, good, _ = make()
    reader, rw, pool = make()
    digest = chain_digests(list(range(4)), 4, None)[0]
    key = reader.layout.key(digest)
    other = torch.ones(frame.HEADER_BYTES + 800 + extra, dtype=torch.uint8)
    assert raw.put([key], [(other.data_ptr(), other.numel())]) == [OK]
    assert _load(reader, rw, 1, digest, block=0) == ERR_FAILED
    assert torch.all(pool[0] == SENTINEL) and rw.errors == [0]
    assert reader.stats()["shared_objects_removed"] == 1
    _write(good_io, good, 2, digest, seed=30)
    assert _load(reader, rw, 3, digest, block=0) == ERR_NONE
    assert torch.equal(pool[0], _page(30))
