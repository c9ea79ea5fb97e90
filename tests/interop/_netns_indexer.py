"""Runs NVIDIA Dynamo's KV indexer inside the network namespace this process is in, and serves
its HTTP API on a Unix socket (the indexer binds 0.0.0.0 and has no flag to bind elsewhere: in a
private namespace that address is this namespace's loopback only, and the Unix socket is how the
test outside reaches it).

Run by tests/interop/_indexer.py as ``unshare -n sh -c 'ip link set lo up && exec python
_netns_indexer.py SOCKET LOG THREADS'``; prints ``ready`` once ``/health`` answers, stops the
indexer when it gets SIGTERM or its stdin closes (the indexer also gets SIGKILL if this process
dies: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time


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
        try:
            upstream = socket.create_connection(("127.0.0.1", port))
        except OSError:
            client.close()  # the test sees the connection drop, the proxy goes on
            continue
        threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()


def main() -> int:
    path, log, threads = sys.argv[1], sys.argv[2], sys.argv[3]
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
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"GET /health HTTP/1.0\r\n\r\n")
                    if b" 200 " in c.recv(100):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                print("indexer /health never answered", flush=True)
                return 1
            time.sleep(0.02)  # poll interval for the child's start-up, not synchronisation
        # Listening before "ready" is printed: the test connects as soon as it reads it.
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(64)
        threading.Thread(target=_serve, args=(server, port), daemon=True).start()
        print("ready", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        sys.stdin.read()  # until the test closes the pipe (or SIGTERM)
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
