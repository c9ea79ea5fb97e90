"""A private store server on loopback for tests, the demo and benchmarks: one child process,
started, polled until it answers (with a deadline), stopped (SIGTERM, then SIGKILL).

Subclassed by :mod:`.mooncake_master` and :mod:`.redis_server`. Called from the caller's thread
(a pytest fixture, the demo's main thread); no thread of its own. The server's output goes to a
log file in the server's directory, whose tail an error carries.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path


class ServerError(RuntimeError):
    """The server could not be started (missing binary, exited, not ready by the deadline)."""


# Ports this process handed out lately. The kernel may hand the same ephemeral port to two
# probes in a row (the first probe's socket is closed before the second binds), and callers
# often take two at once (publish and replay, RPC and metrics): never return one twice.
_HANDED_OUT: OrderedDict[int, None] = OrderedDict()
_HANDED_OUT_CAP = 4096


# The plugin's default ports (the leader's 56001 and its consolidated output's 57001) lie in
# Linux's ephemeral range: a test handed one of them would collide with a default, a
# configuration error, instead of testing what it meant to.
_DEFAULT_PORTS = frozenset({56001, 57001})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's choice), never one this process was
    handed lately. Another process may still take it before the caller binds it:
    :meth:`LocalServer.start` retries with new ports then."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port not in _HANDED_OUT and port not in _DEFAULT_PORTS:
            _HANDED_OUT[port] = None
            if len(_HANDED_OUT) > _HANDED_OUT_CAP:
                _HANDED_OUT.popitem(last=False)  # the oldest
            return port
    raise OSError(f"free_port: no new free port on {host} in 64 probes")


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook that has Linux kill the server when the process that started it dies
    (``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a test run killed outright leaves no server
    behind; None elsewhere. Linux ties this to the starting *thread*: start servers from a
    thread that outlives them (the main thread, a fixture's)."""
    if not sys.platform.startswith("linux"):
        return None

    def hook() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

    return hook


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "<no log>"
    return data[-limit:].decode("utf-8", "replace")


class LocalServer:
    """One server process. Subclasses provide :meth:`_command` and :meth:`_ready`."""

    kind = "server"
    start_attempts = 3  # new ports each attempt: a port taken meanwhile is not fatal

    def __init__(self, directory: str | os.PathLike[str], ready_timeout_s: float = 20.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ready_timeout_s = ready_timeout_s
        self.log_path = self.directory / f"{self.kind}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # Subclass hooks ---------------------------------------------------------------------
    def _command(self) -> Sequence[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        """True once the server answers (called every few ms until the deadline)."""
        raise NotImplementedError

    def _pick_ports(self) -> None:
        """Choose fresh ports (before a first start, and after a start that failed)."""

    # Life cycle -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> LocalServer:
        """Start on fresh ports and return once the server answers; raises ServerError."""
        error: ServerError | None = None
        for _ in range(self.start_attempts):
            self._pick_ports()
            try:
                self._launch()
                return self
            except ServerError as exc:
                error = exc
        assert error is not None
        raise error

    def restart(self) -> LocalServer:
        """Start again on the same ports (after :meth:`stop` or :meth:`kill`): clients that
        knew the old address reconnect. Raises ServerError (a port taken meanwhile too)."""
        if self.running:
            raise ServerError(f"{self.kind} is still running (pid {self.proc.pid})")
        self._launch()
        return self

    def _launch(self) -> None:
        command = list(self._command())
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- start: {' '.join(command)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, cwd=self.directory,
                                             env=self._env(), preexec_fn=_die_with_parent())
            except OSError as exc:
                raise ServerError(f"cannot run {command[0]}: {exc}") from exc
        self.starts += 1
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"{self.kind} exited with status {code} at start; log "
                                  f"{self.log_path}:\n{_tail(self.log_path)}")
            if self._ready():
                return
            if time.monotonic() >= deadline:
                self.kill()
                raise ServerError(f"{self.kind} not ready within {self.ready_timeout_s:g} s; "
                                  f"log {self.log_path}:\n{_tail(self.log_path)}")
            time.sleep(0.02)  # a readiness poll's period, bounded by the deadline above

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; idempotent."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL now (a crash, for fault tests); idempotent."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait()

    def __enter__(self) -> LocalServer:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
