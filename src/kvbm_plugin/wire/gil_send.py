"""Sending a publisher's frames without releasing the GIL, and its thread's wake-up fd.

Split from :mod:`kvbm_plugin.wire.publisher` (which re-exports :func:`gil_holding_sender`), whose
``ZmqEventPublisher`` is the only user: see its class docstring for why the executor thread's
sends keep the GIL. No torch or TensorRT-LLM import.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable
from typing import Any

import zmq

_SNDMORE_NOBLOCK = zmq.SNDMORE | zmq.NOBLOCK


def gil_holding_sender(sock: zmq.Socket) -> Callable[[bytes, bytes, bytes], None] | None:
    """``send(topic, seq, payload)`` for ``sock`` that keeps the GIL, or None if unavailable.

    pyzmq releases the GIL around every frame it sends. On the publisher thread that is costly
    when the executor thread is running Python: after each release the publisher thread has to
    win the GIL back, which takes up to ``sys.getswitchinterval()`` (5 ms) per frame, so a
    3-frame batch could wait ~15 ms and the queue backs up. A non-blocking send on a PUB socket
    never waits (PUB drops at its high-water mark instead), so holding the GIL across it costs
    the other threads ~1 us per frame. This calls ``zmq_send`` of the libzmq that pyzmq itself
    loaded through ``ctypes.PyDLL`` (which does not release the GIL). It returns None (callers
    fall back to pyzmq) when that library cannot be identified unambiguously, e.g. when libzmq
    is linked statically into pyzmq or not on Linux. Only for sockets used by one thread; the
    socket must stay open while the sender is used. Errors raise :class:`zmq.ZMQError`.
    """
    functions = _libzmq_send_functions()
    if functions is None:
        return None
    zmq_send, zmq_errno = functions
    handle = sock.underlying
    more, last = _SNDMORE_NOBLOCK, zmq.NOBLOCK

    def send(topic: bytes, seq: bytes, payload: bytes) -> None:
        if (zmq_send(handle, topic, len(topic), more) < 0
                or zmq_send(handle, seq, len(seq), more) < 0
                or zmq_send(handle, payload, len(payload), last) < 0):
            raise zmq.ZMQError(zmq_errno())

    return send


_lib: list[ctypes.PyDLL | None] = []  # found once per process
_libzmq: list[tuple[Any, Any] | None] = []


def loaded_libzmq() -> ctypes.PyDLL | None:
    """The libzmq pyzmq loaded, through ``ctypes.PyDLL`` (its calls keep the GIL), or None
    when it cannot be identified unambiguously (one ``libzmq*.so`` mapped into the process,
    of pyzmq's libzmq version). Also used by :mod:`kvbm_plugin.wire.conn_gate`."""
    if _lib:
        return _lib[0]
    found: ctypes.PyDLL | None = None
    try:
        paths = set()
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if re.search(r"/libzmq[^/]*\.so", path) and os.path.exists(path):
                    paths.add(path)
        if len(paths) == 1:
            lib = ctypes.PyDLL(paths.pop())
            major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            lib.zmq_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
            if (major.value, minor.value, patch.value) == zmq.zmq_version_info():
                found = lib
    except (OSError, AttributeError, ValueError, TypeError):
        found = None
    _lib.append(found)
    return found


def _libzmq_send_functions() -> tuple[Any, Any] | None:
    """``(zmq_send, zmq_errno)`` of :func:`loaded_libzmq` (calls keep the GIL), or None."""
    if _libzmq:
        return _libzmq[0]
    found: tuple[Any, Any] | None = None
    lib = loaded_libzmq()
    if lib is not None:
        try:
            zmq_send = lib.zmq_send
            zmq_send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                 ctypes.c_int]
            zmq_send.restype = ctypes.c_int
            zmq_errno = lib.zmq_errno
            zmq_errno.argtypes = []
            zmq_errno.restype = ctypes.c_int
            found = (zmq_send, zmq_errno)
        except AttributeError:
            found = None
    _libzmq.append(found)
    return found


WAKE = (1).to_bytes(8, "little")  # an eventfd increment; any byte for a pipe


def wake_fds() -> tuple[int, int]:
    """(read end, write end) of a non-blocking wake-up channel: one eventfd where the OS has
    it, else a pipe."""
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w
