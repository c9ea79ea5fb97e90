"""A spawned child process that answers one message at a time over a pipe.

The parent's side of every simulated process: a TP rank (:mod:`.processes`), an attention-DP
rank (:mod:`.adp`) and a whole engine (:mod:`.engine_process`). The child function gets its end
of the pipe first, sends ``("ok", value)`` or ``("error", text)`` for each message, and stops
on its shutdown message. ``multiprocessing``'s spawn start method: the child inherits nothing.
Called from one parent thread at a time (the engine's executor thread, or the test's; a
rank's shutdown from a thread of the engine's shutdown); no thread of its own.

Ctrl-C belongs to the parent: a terminal sends SIGINT to the whole foreground process group,
and a child that died of it mid-call would leave the parent's clean-up talking to a dead pipe
(or reading the answer to an earlier message). So a child ignores SIGINT and is stopped by the
parent's shutdown message (or by EOF on its pipe when the parent is gone). A call whose answer
the parent never read (a KeyboardInterrupt between ``send`` and ``reply``) has its answer
discarded before the next call, so every later call gets its own answer.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
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
        self._proc = ctx.Process(target=_child_entry, name=name, args=(target, child, *args),
                                 daemon=daemon)
        # Ignored while the child is started: an ignored signal stays ignored across fork and
        # exec and Python then installs no Ctrl-C handler, so a Ctrl-C during the child's
        # start-up (before _child_entry runs) cannot reach it. This process ignores it for the
        # fork and exec only (signal handlers can be set on the main thread alone).
        main = threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is not None  # None: a handler set outside Python
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self._proc.start()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
        child.close()  # the child's end lives on in the child only: EOF when it dies
        self._closed = False
        self._unanswered = 1  # answers not read yet: the first is the bring-up's (every child)

    def send(self, *msg: Any) -> None:
        try:
            self._conn.send(msg)
        except OSError as exc:  # BrokenPipeError, ConnectionResetError: it is gone
            raise RuntimeError(f"{self.label} exited (code {self._proc.exitcode}): "
                               f"{exc}") from exc
        self._unanswered += 1

    def reply(self) -> Any:
        """The child's answer to the last message: its value, or its error raised here.
        Polls with a deadline, so that a child that died or hangs is an error, not a stall."""
        deadline = time.monotonic() + self.reply_timeout_s
        while not self._conn.poll(0.2):
            if not self._proc.is_alive() and not self._conn.poll(0):
                self._unanswered = 0  # nothing more will come
                raise RuntimeError(f"{self.label} exited (code {self._proc.exitcode}) "
                                   "without answering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.label} did not answer within "
                                   f"{self.reply_timeout_s:.0f} s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:  # it died while answering (a signal to the group)
            self._unanswered = 0
            raise RuntimeError(f"{self.label} exited (code {self._proc.exitcode}) without "
                               "answering") from exc
        self._unanswered -= 1
        if status == "error":
            raise RuntimeError(f"{self.label} failed: {value}")
        return value

    def call(self, *msg: Any) -> Any:
        """Send ``msg`` and return its answer; answers of earlier messages that were never
        read (an interrupted step) are read and dropped first."""
        while self._unanswered > 0:
            # That earlier message's error, if any: nobody asks for it any more.
            with contextlib.suppress(RuntimeError):
                self.reply()
        self.send(*msg)
        return self.reply()

    def kill(self) -> None:
        """End the child at once (SIGKILL), skipping its shutdown: for a caller that is
        ending on a signal and must exit promptly. Its own children see EOF and exit."""
        if self._closed:
            return
        self._closed = True
        self._proc.kill()
        self._proc.join(5)
        self._conn.close()

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


def _child_entry(target: Callable[..., None], conn: Any, *args: Any) -> None:
    """The child's first frame: ignore Ctrl-C (see the module docstring), then run ``target``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(conn, *args)
