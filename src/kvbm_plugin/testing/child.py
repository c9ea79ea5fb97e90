"""A spawned child process that answers one message at a time over a pipe.

The parent's side of every simulated process: a TP rank (:mod:`.processes`), an attention-DP
rank (:mod:`.adp`) and a whole engine (:mod:`.engine_process`). The child function gets its end
of the pipe first, sends ``("ok", value)`` or ``("error", text)`` for each message, and stops
on its shutdown message. ``multiprocessing``'s spawn start method: the child inherits nothing.
Called from one parent thread (the engine's executor thread, or the test's); no thread of its
own.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from typing import Any


class ChildProcess:
    """One child. ``label`` names it in errors ("rank 1 process", "engine A")."""

    def __init__(self, label: str, target: Callable[..., None], args: Sequence[Any], *,
                 name: str, daemon: bool, reply_timeout_s: float) -> None:
        self.label = label
        self.reply_timeout_s = reply_timeout_s
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=target, name=name, args=(child, *args), daemon=daemon)
        self._proc.start()
        child.close()  # the child's end lives on in the child only: EOF when it dies
        self._closed = False

    def send(self, *msg: Any) -> None:
        try:
            self._conn.send(msg)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise RuntimeError(f"{self.label} exited (code {self._proc.exitcode}): "
                               f"{exc}") from exc

    def reply(self) -> Any:
        """The child's answer to the last message: its value, or its error raised here.
        Polls with a deadline, so that a child that died or hangs is an error, not a stall."""
        deadline = time.monotonic() + self.reply_timeout_s
        while not self._conn.poll(0.2):
            if not self._proc.is_alive() and not self._conn.poll(0):
                raise RuntimeError(f"{self.label} exited (code {self._proc.exitcode}) "
                                   "without answering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label} did not answer within "
                                   f"{self.reply_timeout_s:.0f} s")
        status, value = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.label} failed: {value}")
        return value

    def call(self, *msg: Any) -> Any:
        self.send(*msg)
        return self.reply()

    def stop(self, shutdown_msg: tuple[Any, ...], wait_s: float) -> None:
        """Ask the child to shut down, wait up to ``wait_s`` for it, then kill it. Once."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                self._conn.send(shutdown_msg)
                self._conn.poll(wait_s)
        except (BrokenPipeError, EOFError, OSError):
            pass
        self._proc.join(wait_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
