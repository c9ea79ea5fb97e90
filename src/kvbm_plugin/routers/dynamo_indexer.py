"""NVIDIA Dynamo's own KV indexer (``ai-dynamo-runtime`` 1.6.1, ``python -m dynamo.indexer``: the
radix tree behind Dynamo's KV router), run beside our streams as a second router to ask.

Who uses it: ``kvbm-plugin demo --real-router``, ``benchmarks/bench_router_accuracy.py --real``
and the interop tests (tests/interop). One :class:`Indexer` is one indexer process; its owner
(one thread) registers streams, reads ``/dump`` and asks ``/query``, and must :meth:`close` it.

The indexer's HTTP API always binds ``0.0.0.0`` and has no flag to bind elsewhere
(``lib/kv-router/src/services/indexer/``), so it runs inside a private network namespace
(``unshare -n``, root only) where that address is the namespace's own loopback; this module,
run as ``python -m kvbm_plugin.routers.dynamo_indexer SOCKET LOG THREADS`` inside the namespace,
starts it and serves its HTTP API on a Unix socket, the way in from outside. Its listeners
*connect* to the publishers: ``ipc://`` paths reach them across the namespace boundary.

Facts relied on (ai-dynamo-runtime 1.6.1, checked against the running indexer):
``/register`` takes ``instance_id``, ``endpoint``, ``replay_endpoint``, ``model_name``,
``block_size``, ``dp_rank``; ``/dump`` re-emits the trees as ``stored`` chains per (worker,
dp rank, storage tier), each node under the first hash stored for its content, hashes as u64;
``/query`` answers matched tokens per worker and dp rank (device tier in ``scores``,
``longest_matched``/``cpu``/``disk`` in ``instances``); with ``--threads 1`` each store skipped
for a missing parent logs one ``Failed to find parent block`` line. All logs go to stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "m"

# Log lines the indexer's decoder or tree writes for an event it could not apply as sent.
WARNING_TEXTS = ("Failed to find parent block", "Failed to find block to remove",
                 "Failed to decode", "Block not published", "Self-referencing",
                 "Unexpected ZMQ frame count", "Invalid sequence number", "batches lost",
                 "Failed to apply event")
PARENT_MISSING = "Failed to find parent block"
# The indexer's storage tiers, as the media our streams name them.
TIERS = {"device": "GPU", "host_pinned": "CPU", "disk": "DISK", "external": "EXTERNAL"}


class IndexerError(RuntimeError):
    """The indexer did not start, or answered an HTTP call with an unexpected status."""


def unavailable() -> str | None:
    """Why the real indexer cannot run on this machine, or None when it can."""
    if importlib.util.find_spec("dynamo") is None:
        return "ai-dynamo-runtime is not installed (pip install 'kvbm-plugin[interop]')"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare/ip not found: cannot give the indexer a private network namespace"
    if os.geteuid() != 0:
        return ("not root: `unshare -n` needs root, and the indexer's HTTP API binds 0.0.0.0 "
                "(it must not run outside a private network namespace)")
    return None


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("indexer", timeout=10)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self._path)


class Indexer:
    """One indexer process in its own network namespace, files under ``tmp``; :meth:`close`
    always stops it (the indexer is also killed if the wrapper dies)."""

    def __init__(self, tmp: Path, threads: int = 1) -> None:
        self.sock = str(tmp / "indexer-http.sock")
        self.log = tmp / "indexer.log"
        script = (f"ip link set lo up && exec {sys.executable} -m {__name__} "
                  f"{self.sock} {self.log} {int(threads)}")
        self.proc = subprocess.Popen(["unshare", "-n", "sh", "-c", script],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if line != "ready":
            self.close()
            raise IndexerError(f"indexer did not start: {line!r}; log: "
                               f"{self.log_text()[-2000:]}")

    def __enter__(self) -> Indexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def http(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        conn = _UnixHTTP(self.sock)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw else None)
        finally:
            conn.close()

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None,
                 block_size: int, dp_rank: int = 0) -> None:
        """Subscribe the indexer to one (worker, dp rank) stream."""
        body: dict[str, Any] = {"instance_id": instance_id, "endpoint": endpoint,
                                "model_name": MODEL, "block_size": block_size,
                                "dp_rank": dp_rank}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        status, answer = self.http("POST", "/register", body)
        if status != 201:
            raise IndexerError(f"/register {body}: HTTP {status} {answer}")

    def dump_edges(self) -> dict[tuple[int, int, str], set[tuple[int | None, int]]]:
        """``(parent hash, hash)`` of every block held, per (worker, dp rank, medium), as
        ``/dump`` shows them (signed int64; a chain's first parent as the event names it)."""
        status, dump = self.http("GET", "/dump")
        if status != 200:
            raise IndexerError(f"/dump: HTTP {status} {dump}")
        out: dict[tuple[int, int, str], set[tuple[int | None, int]]] = {}
        for entry in dump.get(f"{MODEL}:default", {}).get("events", []):
            key = (int(entry["worker_id"]), int(entry["event"]["dp_rank"] or 0),
                   TIERS.get(entry["storage_tier"], entry["storage_tier"]))
            stored = entry["event"]["data"].get("stored")
            if not stored:
                continue
            parent = _signed(stored.get("parent_hash"))
            for block in stored.get("blocks", []):
                h = _signed(block["block_hash"])
                out.setdefault(key, set()).add((parent, h))
                parent = h
        return out

    def held(self) -> dict[tuple[int, int, str], set[int]]:
        """Blocks per (worker, dp rank, medium) as ``/dump`` shows them (signed int64)."""
        return {k: {h for _, h in v} for k, v in self.dump_edges().items()}

    def query(self, tokens: list[int], *, cache_salt: str | None = None,
              lora_name: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": tokens, "model_name": MODEL}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if lora_name is not None:
            body["lora_name"] = lora_name
        status, answer = self.http("POST", "/query", body)
        if status == 404:  # no worker registered a block yet: no indexer for the model
            return {"scores": {}, "instances": {}}
        if status != 200:
            raise IndexerError(f"/query: HTTP {status} {answer}")
        return answer

    def cached_tokens(self, tokens: list[int], **kw: Any) -> int:
        """Tokens the best worker matches on any tier (the longest of device, host, disk)."""
        best = 0
        for inst in self.query(tokens, **kw).get("instances", {}).values():
            best = max(best, int(inst.get("longest_matched", 0)), int(inst.get("cpu", 0)),
                       int(inst.get("disk", 0)), int(inst.get("gpu", 0)))
        return best

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def warnings(self) -> list[str]:
        """The indexer's log lines about events it could not apply as sent."""
        return [line for line in self.log_text().splitlines()
                if " WARN " in line and any(t in line for t in WARNING_TEXTS)]

    def count(self, text: str) -> int:
        """Log lines containing ``text``."""
        return sum(text in line for line in self.log_text().splitlines())

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        """Poll ``cond`` until true (the indexer applies events asynchronously); raises
        TimeoutError naming ``what`` and the first warnings."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"indexer: timed out waiting for {what}; warnings "
                                   f"{self.warnings()[:5]}")
            time.sleep(0.01)  # poll interval: the indexer applies events asynchronously

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the wrapper stops the indexer and exits
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def ask_like_the_view(indexer: Indexer, held_by_view: Callable[[], int],
                      settle_s: float = 2.0, salt_form: str = "client",
                      ) -> Callable[[list[int], str | None, str | None], int]:
    """The question a :class:`~kvbm_plugin.testing.chat_workload.RouterProbe` asks another
    router (prompt, the tenant's cache salt and the adapter's name in, cached tokens on any
    tier out), put to
    ``indexer`` through ``/query`` with the salt as ``cache_salt`` in the stream's
    ``salt_form`` (``DYN_KVBM_KV_EVENTS_SALT_FORM``): ``client``, the string itself, as a
    client's request carries it; ``id``, its id's namespace
    (:func:`~kvbm_plugin.wire.identity.salt_namespace`). Only that one: asking both ways would
    credit a tenant the router could not credit from a client's request.

    The indexer applies events asynchronously and says nothing of how far it got: before
    each answer this waits, up to ``settle_s``, until it holds as many blocks as
    ``held_by_view()`` says the view does (the view has everything published by then)."""
    from kvbm_plugin.wire.identity import cache_salt_id, salt_namespace

    def held() -> int:
        return sum(len(v) for v in indexer.held().values())

    def ask(prompt: list[int], salt: str | None, lora_name: str | None = None) -> int:
        want = held_by_view()
        deadline = time.monotonic() + settle_s
        while held() != want and time.monotonic() < deadline:
            time.sleep(0.002)  # poll interval: the indexer applies events asynchronously
        if salt is not None and salt_form != "client":
            salt = salt_namespace(cache_salt_id(salt))
        return indexer.cached_tokens(prompt, cache_salt=salt, lora_name=lora_name)

    return ask


def _signed(h: Any) -> int | None:
    if h is None:
        return None
    h = int(h)
    return h - (1 << 64) if h >= 1 << 63 else h


# ---------------------------------------------------------------- inside the namespace

def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _serve(server: socket.socket, port: int) -> None:
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", port))
        threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()


def _serve_in_namespace(path: str, log: str, threads: str) -> int:
    """Start the indexer on a free loopback port of this (private) namespace, print ``ready``
    once ``/health`` answers, proxy ``path`` to it, and stop it when stdin closes or SIGTERM
    comes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DYN_SDK_DISABLE_ANSI_LOGGING="1", DYN_LOG="info")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(port),
                                 "--threads", threads], stdout=out, stderr=out, env=env,
                                preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                print(f"indexer exited rc={proc.returncode}", flush=True)
                return 1
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                c.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                if b" 200 " in c.recv(100):
                    break
            if time.monotonic() > deadline:
                print("indexer /health never answered", flush=True)
                return 1
            time.sleep(0.02)  # poll interval for the child's start-up, not synchronisation
        # Listening before "ready": the owner connects as soon as it reads it.
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(64)
        threading.Thread(target=_serve, args=(server, port), daemon=True).start()
        print("ready", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        sys.stdin.read()  # until the owner closes the pipe (or SIGTERM)
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print("usage: python -m kvbm_plugin.routers.dynamo_indexer SOCKET LOG THREADS",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_serve_in_namespace(*sys.argv[1:]))


__all__ = ["MODEL", "PARENT_MISSING", "TIERS", "WARNING_TEXTS", "Indexer", "IndexerError",
           "ask_like_the_view", "unavailable"]
