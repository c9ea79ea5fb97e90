"""The compiled connection gate (wire/_gate_c.c): the hold follows the accepts while this
process's interpreter is busy, and the gate starts anew in a forked child.

A connection libzmq accepted holds about 60 KiB until its socket's owner takes a turn, so the
memory bound of a capped socket is how soon the hold follows the accepts. The Python gate's
reader needs the GIL; on a loaded machine it once read the 129th accept of a churn after
1,081 had been taken in (74 MiB, over the soak's 64 MiB bound).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import traceback

import _churn as churn
import pytest
import zmq
from _kvwire import wait_until
from _zmtp import RawPeer
from conftest import compiled_gate_or_skip

from kvbm_plugin.wire import conn_gate
from kvbm_plugin.wire.conn_watch import WATCH
from kvbm_plugin.wire.peers import PeerCap

MAX_UNREAD = 8


def _connect(port: int, n: int) -> list[RawPeer]:
    """``n`` connection attempts; those the gate cuts or holds off (past ``max_unread``) fail."""
    peers = []
    for _ in range(n):
        with contextlib.suppress(OSError):
            peers.append(RawPeer("127.0.0.1", port, b"SUB", timeout=1.0))
    return peers


def test_the_compiled_gate_holds_a_churn_off_while_the_gil_is_held(ctx) -> None:
    """An outsider process churns connections while this process's GIL is held for 1.5 s (a
    ``PyDLL`` call keeps it: no Python thread runs). The compiled gate holds new connections off
    once more than ``max_unread`` arrived: what libzmq accepted in that time stays within
    ``max_unread`` + what was in flight. The Python gate cannot read a single event meanwhile
    (about 400 accepted in the same window here)."""
    compiled_gate_or_skip()
    # A ROUTER: an unguarded XPUB would keep every subscription of a failed run in its trie.
    pub = ctx.socket(zmq.ROUTER)
    cap = PeerCap("t", pub, 1024, max_unread=MAX_UNREAD)
    assert conn_gate.is_compiled(cap._gate)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    outsider = churn.start("replay", port, 30)
    try:
        wait_until(lambda: cap.accept_events >= 1, what="the outsider's first connection")
        cap.caught_up()
        before = cap.accept_events
        ctypes.PyDLL(None).usleep(1_500_000)  # the GIL stays held throughout
        during = cap.accept_events - before
        assert cap.refuse_new
        # Past max_unread: the connections whose handshake the kernel completed before the
        # filter was attached (the listen backlog), at most.
        assert MAX_UNREAD < during <= MAX_UNREAD + 100, during
    finally:
        outsider.kill()
        outsider.wait()
        cap.close()
        pub.close(linger=0)


# The fork is the point: a process with the gate's thread running forks (multiprocessing's fork
# start method does), which Python 3.12 warns about.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_starts_its_own_gate(ctx) -> None:
    """The child of a fork has no gate thread (nor the parent's gates): its first cap starts
    one, which holds its own socket off; the parent's gate goes on."""
    compiled_gate_or_skip()
    parent_pub = ctx.socket(zmq.XPUB)
    parent_cap = PeerCap("parent", parent_pub, 64, max_unread=2)
    parent_port = parent_pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        pid = os.fork()
        if pid == 0:  # the child: only async-signal-safe exits from here on failure
            code = 1
            try:
                child_ctx = zmq.Context()
                pub = child_ctx.socket(zmq.XPUB)
                cap = PeerCap("child", pub, 64, max_unread=2)
                port = pub.bind_to_random_port("tcp://127.0.0.1")
                peers = _connect(port, 3)
                wait_until(lambda: cap.refuse_new, what="the child's hold")
                code = 0 if conn_gate.is_compiled(cap._gate) else 2
                for peer in peers:
                    peer.close()
                cap.close()
                pub.close(linger=0)
                child_ctx.term()
            except BaseException:
                traceback.print_exc()  # pytest shows the child's stderr with the failure
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        peers = _connect(parent_port, 3)
        wait_until(lambda: parent_cap.refuse_new, what="the parent's hold")
        for peer in peers:
            peer.close()
    finally:
        parent_cap.close()
        parent_pub.close(linger=0)


def _gate_still_holds(ctx: zmq.Context) -> None:
    pub = ctx.socket(zmq.ROUTER)
    cap = PeerCap("after", pub, 64, max_unread=0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    peers = _connect(port, 1)
    try:
        wait_until(lambda: cap.refuse_new, what="the gate thread's hold")
    finally:
        for peer in peers:
            peer.close()
        cap.close()
        pub.close(linger=0)


def test_a_context_destroyed_under_a_cap_left_open_is_let_go_first(ctx) -> None:
    """A test that failed halfway leaves its caps open; the ctx fixture lets their monitors go
    (ConnWatch.release: the gate thread too) before it destroys the context, and the gate
    thread goes on for the other caps."""
    compiled_gate_or_skip()
    context = zmq.Context()
    pub = context.socket(zmq.ROUTER)
    cap = PeerCap("left open", pub, 64, max_unread=4)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    peers = _connect(port, 2)
    try:
        wait_until(lambda: cap.accept_events >= 1, what="an accept")
        WATCH.release(context)
        context.destroy(linger=0)
    finally:
        for peer in peers:
            peer.close()
    _gate_still_holds(ctx)



def test_doctor_and_the_log_say_which_gate_runs(monkeypatch, caplog, ctx) -> None:  # noqa: ANN001
    """Where the compiled gate cannot run, the first capped socket logs it once (no silent
    fallback) and ``doctor`` warns; where it runs, ``doctor`` says so."""
    from kvbm_plugin.cli.doctor import run_checks

    monkeypatch.setattr(conn_gate, "_gate_c", None)
    monkeypatch.setattr(conn_gate, "_started", {})
    caps = []
    with caplog.at_level(logging.WARNING, logger="kvbm_plugin.wire.conn_gate"):
        for _ in range(2):
            caps.append(PeerCap("t", ctx.socket(zmq.ROUTER), 4))
    assert [r.getMessage() for r in caplog.records].count(
        "connection gate: " + conn_gate.describe()[1]) == 1
    assert not any(conn_gate.is_compiled(cap._gate) for cap in caps)
    for cap in caps:
        cap.close()
    gate = {check.name: check for check in run_checks(1, False)}["connection gate"]
    assert gate.status == "warn" and "not built" in gate.detail
    monkeypatch.undo()
    compiled_gate_or_skip()
    gate = {check.name: check for check in run_checks(1, False)}["connection gate"]
    assert gate.status == "ok" and "compiled" in gate.detail


@pytest.mark.slow
def test_the_watch_takes_the_events_of_a_cap_added_while_it_was_waiting(ctx) -> None:
    """Three threads keep the GIL busy, so the watch thread often wakes late: the compiled
    gate's wake-up byte for a new cap's first events could be drained by a pass that had begun
    before the cap was added, and those events then waited for the next one (never, once the
    connections were in: 24 in 300 such caps did not see their two connections within 2 s).
    Every pass now takes from every compiled gate."""
    compiled_gate_or_skip()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(3)]
    for thread in spinners:
        thread.start()
    missed = 0
    try:
        for _ in range(100):
            pub = ctx.socket(zmq.XPUB)
            cap = PeerCap("t", pub, 8)
            port = pub.bind_to_random_port("tcp://127.0.0.1")
            peers = _connect(port, 2)
            try:
                wait_until(lambda cap=cap: cap.live == 2 and bool(cap.listening), timeout=2.0,
                           what="both connections seen")
            except AssertionError:
                missed += 1
            for peer in peers:
                peer.close()
            cap.close()
            pub.close(linger=0)
    finally:
        stop.set()
        for thread in spinners:
            thread.join()
    assert missed == 0
