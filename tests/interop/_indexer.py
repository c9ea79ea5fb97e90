"""NVIDIA Dynamo's real KV indexer (``ai-dynamo-runtime`` 1.6.1, ``python -m dynamo.indexer``)
for the interop tests: started in a private network namespace, reached over a Unix socket.

Facts relied on (checked against 1.6.1 here; source ``lib/kv-router/src/services/indexer/``):
the HTTP API always binds 0.0.0.0 (hence the namespace); ``/register`` takes ``instance_id``,
``endpoint``, ``replay_endpoint``, ``model_name``, ``block_size``, ``dp_rank``; the listeners
connect to the publishers, ``ipc://`` paths included (a path socket is reachable across
network namespaces); ``/dump`` re-emits the trees as ``stored`` chains per (worker, dp rank,
storage tier), each node under the first hash stored for its content; ``/query`` answers
matched tokens per worker and dp rank, device tier in ``scores``, ``cpu``/``disk`` in
``instances``. With ``--threads 1`` each parent miss logs one ``Failed to find parent block``
line. All logs go to stderr.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "m"
_HERE = Path(__file__).parent

# Log lines a decoder or the tree writes for an event it could not apply as sent.
WARNING_TEXTS = ("Failed to find parent block", "Failed to find block to remove",
                 "Failed to decode", "Block not published", "Self-referencing",
                 "Unexpected ZMQ frame count", "Invalid sequence number", "batches lost",
                 "Failed to apply event")
TIERS = {"device": "GPU", "host_pinned": "CPU", "disk": "DISK"}


def unavailable() -> str | None:
    """Why the real indexer cannot run here, or None."""
    if importlib.util.find_spec("dynamo") is None:
        return "ai-dynamo-runtime is not installed (pip install '.[interop]')"
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
    """One indexer process in its own network namespace; :meth:`close` always stops it."""

    def __init__(self, tmp: Path, threads: int = 1) -> None:
        self.sock = str(tmp / "indexer-http.sock")
        self.log = tmp / "indexer.log"
        script = (f"ip link set lo up && exec {sys.executable} {_HERE / '_netns_indexer.py'} "
                  f"{self.sock} {self.log} {threads}")
        self.proc = subprocess.Popen(["unshare", "-n", "sh", "-c", script],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"indexer did not start: {line!r}; log: {self.log_text()[-2000:]}")

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
        body: dict[str, Any] = {"instance_id": instance_id, "endpoint": endpoint,
                                "model_name": MODEL, "block_size": block_size,
                                "dp_rank": dp_rank}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        status, answer = self.http("POST", "/register", body)
        assert status == 201, (status, answer)

    def held(self) -> dict[tuple[int, int, str], set[int]]:
        """Blocks per (worker, dp rank, medium) as ``/dump`` shows them (signed int64)."""
        status, dump = self.http("GET", "/dump")
        assert status == 200, (status, dump)
        out: dict[tuple[int, int, str], set[int]] = {}
        for entry in dump.get(f"{MODEL}:default", {}).get("events", []):
            key = (int(entry["worker_id"]), int(entry["event"]["dp_rank"] or 0),
                   TIERS.get(entry["storage_tier"], entry["storage_tier"]))
            for block in entry["event"]["data"].get("stored", {}).get("blocks", []):
                h = int(block["block_hash"])
                out.setdefault(key, set()).add(h - (1 << 64) if h >= 1 << 63 else h)
        return out

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
        assert status == 200, (status, answer)
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
        return [line for line in self.log_text().splitlines()
                if " WARN " in line and any(t in line for t in WARNING_TEXTS)]

    def count(self, text: str) -> int:
        return sum(text in line for line in self.log_text().splitlines())

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"indexer: timed out waiting for {what}; warnings "
                                     f"{self.warnings()[:5]}")
            time.sleep(0.01)  # poll interval: the indexer applies events asynchronously

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # the wrapper stops the indexer and exits
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
