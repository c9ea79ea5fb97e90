"""The cross-process completion channel that TP ranks in other processes use to report ops."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import zmq
from _kvwire import free_port, short_keepalive, silence, tcp_connections, wait_until

from kvbm_plugin.connector.meta import (
    ERR_NONE,
    REPORT_MAX_BYTES,
    CompletionHub,
    OpReport,
    ZmqReportReceiver,
    decode_report,
    encode_report,
)


def _drain_until(hub: CompletionHub, count: int, timeout: float = 20.0) -> list[OpReport]:
    got: list[OpReport] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {len(got)} of {count} reports arrived"
        got.extend(hub.drain())
        time.sleep(0.005)  # polling interval of a deadline-bounded wait, not a synchronisation
    return got


def _report_until_one_arrives(hub: CompletionHub, put: Callable[[OpReport], object], *,
                              first: int, timeout: float, what: str) -> list[OpReport]:
    """Report ops ``first``, ``first + 1`` ... (rank 1, ok), one every 0.05 s, as a rank
    reports on, until some reach ``hub``: those that did."""
    deadline = time.monotonic() + timeout
    op_id = first
    while True:
        assert time.monotonic() < deadline, f"no report arrived {what}"
        put(OpReport(op_id, 1, True))
        op_id += 1
        got = hub.drain()
        if got:
            return got
        time.sleep(0.05)  # the pace of the rank's reports, not synchronisation


def test_report_round_trip() -> None:
    report = OpReport(7, 1, True, ERR_NONE, (4096, 1_700_000_000_123_456_789))
    assert decode_report(encode_report(report)) == report
    assert decode_report(encode_report(OpReport(8, 0, False, 2))) == OpReport(8, 0, False, 2)


@pytest.mark.parametrize("data", [b"", b"\x93\x01\x02\x03", b"\x95\x01\x02\xc3\x00\x91\x01",
                                  b"\x95\xa1x\x02\xc3\x00\xc0"])
def test_malformed_reports_are_errors(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed completion report"):
        decode_report(data)


def test_reports_from_another_process_reach_the_hub_and_garbage_does_not_stop_it(
        expect_errors) -> None:
    port = free_port()
    hub = CompletionHub("report-channel-test")
    receiver = ZmqReportReceiver(hub, f"tcp://*:{port}")
    try:
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as rogue:
            rogue.setsockopt(zmq.LINGER, 1000)
            rogue.connect(f"tcp://127.0.0.1:{port}")
            rogue.send(b"\x80\x04not a report")  # e.g. a pickle: must be refused, not loaded
        code = textwrap.dedent(f"""
            from kvbm_plugin.connector.meta import OpReport, ZmqReportSender
            sender = ZmqReportSender("tcp://127.0.0.1:{port}")
            reports = [OpReport(op, 1, op % 7 != 0, 0 if op % 7 else 1,
                                (op, op * 10) if op % 2 else None) for op in range(50)]
            for report in reports[:20]:
                sender.put(report)
            sender.put_many(reports[20:])  # a copy batch's reports
            sender.close()
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        got = _drain_until(hub, 50)
        assert [r.op_id for r in got] == list(range(50))
        assert all(r.rank == 1 for r in got)
        assert [r.ok for r in got] == [op % 7 != 0 for op in range(50)]
        assert got[3].signature == (3, 30) and got[4].signature is None
        assert receiver.malformed == 1
    finally:
        receiver.close()
    assert expect_errors.wait_for("malformed completion report")


def test_hub_drains_single_and_batched_reports_in_order() -> None:
    hub = CompletionHub("report-batches")
    hub.put(OpReport(1, 0, True))
    hub.put_many([OpReport(2, 0, True), OpReport(3, 0, False, 1)])
    hub.put_many([])
    hub.put(OpReport(4, 1, True))
    assert [(r.op_id, r.ok) for r in hub.drain()] == [(1, True), (2, True), (3, False),
                                                      (4, True)]
    assert hub.drain() == []


def test_a_process_that_exits_right_after_close_still_delivers_its_reports(tmp_path) -> None:
    """A rank process's last reports are delivered although it exits as soon as the sender is
    closed: close() waits for delivery (a process's exit does not). The leader binds only once
    the sender has sent and closed, so nothing can have been delivered by then."""
    endpoint = f"ipc://{tmp_path}/reports"
    code = textwrap.dedent(f"""
        import sys
        from kvbm_plugin.connector.meta import OpReport, ZmqReportSender
        sender = ZmqReportSender({endpoint!r})
        sender.put_many([OpReport(op, 1, True) for op in range(10)])
        print("sent", flush=True)
        sys.stdin.readline()  # the leader is binding now
        sender.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    hub = CompletionHub("report-channel-late-leader")
    receiver = None
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "sent\n"
        receiver = ZmqReportReceiver(hub, endpoint)
        assert proc.stdin is not None
        proc.stdin.write("bound\n")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
        got = _drain_until(hub, 10)
        assert [r.op_id for r in got] == list(range(10))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if receiver is not None:
            receiver.close()


def test_close_with_no_leader_gives_up_after_its_timeout_with_a_warning(tmp_path,
                                                                         caplog) -> None:
    from kvbm_plugin.connector.meta import ZmqReportSender

    sender = ZmqReportSender(f"ipc://{tmp_path}/nobody")
    sender.put(OpReport(1, 1, True))
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="kvbm_plugin.connector.meta"):
        sender.close(timeout=0.2)
    assert time.monotonic() - began < 30  # bounded, though nobody ever took the report
    assert "not delivered to ipc://" in caplog.text
    sender.close()  # idempotent: returns at once


def test_an_oversized_message_is_refused_unread_and_reports_still_arrive() -> None:
    """The report port is reachable by whoever reaches its address: a message over
    REPORT_MAX_BYTES drops its connection in libzmq before it is queued or decoded (nothing
    counted as malformed), and reports sent after it arrive."""
    port = free_port()
    hub = CompletionHub("report-channel-oversized")
    receiver = ZmqReportReceiver(hub, f"tcp://127.0.0.1:{port}")
    try:
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as rogue, ctx.socket(zmq.PUSH) as rank:
            for sock in (rogue, rank):
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(f"tcp://127.0.0.1:{port}")
            rogue.send(b"\x00" * (REPORT_MAX_BYTES + 1))
            rank.send(encode_report(OpReport(3, 1, True)))
            assert _drain_until(hub, 1) == [OpReport(3, 1, True)]
        assert receiver.malformed == 0
    finally:
        receiver.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux socket filter")
def test_a_connection_gone_silent_is_dropped_and_made_again(monkeypatch) -> None:  # noqa: ANN001
    """The leader's end of a rank's connection stops receiving (every packet dropped, no FIN,
    no reset: as when a host or a firewall between them goes away): the rank's reports go
    unacknowledged, it drops the connection (``TCP_USER_TIMEOUT``) and connects again, and
    its later reports arrive. Without that they went into the silent connection until TCP
    gave up."""
    from kvbm_plugin.connector.meta import ZmqReportSender

    short_keepalive(monkeypatch)
    port = free_port()
    hub = CompletionHub("report-channel-silent")
    receiver = ZmqReportReceiver(hub, f"tcp://127.0.0.1:{port}")
    sender = ZmqReportSender(f"tcp://127.0.0.1:{port}")
    try:
        sender.put(OpReport(1, 1, True))
        assert _drain_until(hub, 1) == [OpReport(1, 1, True)]
        ((fd, (_, silent)),) = tcp_connections(port, "local").items()
        silence(fd)  # the leader's end
        got = _report_until_one_arrives(hub, sender.put, first=2, timeout=20,
                                        what="after the connection went silent")
        assert got[0].op_id > 2  # those sent into the silent connection were lost
        # The leader's end heard nothing either: its own probes dropped the connection.
        wait_until(lambda: silent not in [peer for _, peer in tcp_connections(
            port, "local").values()], 10, "the silent one dropped")
    finally:
        sender.close(timeout=1.0)
        receiver.close()


@pytest.mark.parametrize("seconds", [3, pytest.param(60, marks=pytest.mark.slow)])
def test_a_churn_of_connections_queueing_reports_holds_a_bounded_amount(
        expect_errors, seconds) -> None:  # noqa: ANN001  (the junk is logged as malformed)
    """libzmq keeps a connection until what it queued is read: connections that queue all
    they can and leave, faster than the receiver reads, are held off while it is behind."""
    import _churn as churn
    from _heap import heap_in_use

    port = free_port()
    hub = CompletionHub("report-channel-churn")
    receiver = ZmqReportReceiver(hub, f"tcp://127.0.0.1:{port}")
    before = heap_in_use()
    flooder = churn.start("push", port, seconds)
    peak = 0
    try:
        while flooder.poll() is None:
            peak = max(peak, heap_in_use() - before)
            hub.drain()
            time.sleep(0.01)  # sampling interval, not synchronisation
    finally:
        flooder.kill()
        flooder.wait()
    try:
        assert peak < 64 << 20, f"the churn grew the heap by {peak >> 20} MiB"
        # A rank connecting now is served once the receiver caught up. Until then its
        # connection may be held off or cut at accept (the cap full of the churn's connections
        # not yet read to their end, or a hold), and what it sent on a cut one is lost: the
        # leader fails such ops after the deadline (test_lost_reports.py). So it reports on,
        # as a rank does, and its later reports arrive.
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as rank:
            rank.setsockopt(zmq.LINGER, 0)
            rank.connect(f"tcp://127.0.0.1:{port}")
            got = _report_until_one_arrives(hub, lambda r: rank.send(encode_report(r)),
                                            first=1, timeout=60, what="after the churn")
            assert all(r.rank == 1 and r.ok for r in got)
    finally:
        receiver.close()
