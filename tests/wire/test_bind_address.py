"""Sockets listen where their endpoint says: ``tcp://127.0.0.1:P`` on loopback only, ``*`` on
every interface. Read from the kernel's table of listening sockets (/proc/net/tcp), so what is
checked is the real listening address, not a string we built."""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _kvwire import free_port, wait_until

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.connector.meta import CompletionHub, ZmqReportReceiver
from kvbm_plugin.consolidator.service import KvEventConsolidator
from kvbm_plugin.consolidator_config import PublisherSettings, parse_endpoint
from kvbm_plugin.wire.publisher import ZmqEventPublisher

PROC_TCP = Path("/proc/net/tcp")
pytestmark = pytest.mark.skipif(not PROC_TCP.exists(), reason="needs Linux's /proc/net/tcp")


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvb", dir="/tmp")  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def listening(port: int) -> set[str]:
    """The IPv4 addresses a socket of this machine listens on at ``port``."""
    found = set()
    for line in PROC_TCP.read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        addr_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:  # 0A: TCP_LISTEN
            found.add(socket.inet_ntoa(struct.pack("<I", int(addr_hex, 16))))
    return found


@pytest.mark.parametrize(("host", "expected"), [("127.0.0.1", {"127.0.0.1"}),
                                                ("*", {"0.0.0.0"})])
def test_publisher_and_replay_listen_on_the_named_host(host: str, expected: set[str]) -> None:
    port, replay = free_port(), free_port()
    pub = ZmqEventPublisher(PublisherSettings(),
                            parse_endpoint("X", f"tcp://{host}:{port}", default_host="127.0.0.1"),
                            parse_endpoint("Y", f"tcp://{host}:{replay}",
                                           default_host="127.0.0.1"))
    try:
        wait_until(lambda: listening(port) and listening(replay), what="listening")
        assert listening(port) == expected
        assert listening(replay) == expected
    finally:
        pub.shutdown()


@pytest.mark.parametrize("replay", [False, True])
def test_a_host_that_does_not_resolve_is_named_with_its_variable(replay: bool) -> None:
    """ZMQ's own word for it is "No such device": the error names the endpoint's variable and
    what is wrong with its host."""
    bad = parse_endpoint("BAD_VAR", "tcp://kvbm-no-such-host.invalid:5", default_host="x")
    good = parse_endpoint("GOOD_VAR", f"tcp://127.0.0.1:{free_port()}", default_host="x")
    with pytest.raises(cc.ConfigError) as caught:
        ZmqEventPublisher(PublisherSettings(), *((good, bad) if replay else (bad, None)))
    message = str(caught.value)
    assert "tcp://kvbm-no-such-host.invalid:5 (BAD_VAR)" in message, message
    assert "does not resolve or is not an address of this machine" in message


def test_bare_port_listens_on_loopback_by_default() -> None:
    """``DYN_KVBM_TRTLLM_ZMQ_PORT`` alone: the consolidator connects over 127.0.0.1, so the
    GPU-tier publisher listens there and nowhere else."""
    port = free_port()
    config = cc.load_consolidator_config({cc.TRTLLM_ZMQ_PORT: str(port)})
    pub = ZmqEventPublisher(PublisherSettings(), config.publish_endpoint(0))
    try:
        wait_until(lambda: listening(port), what="listening")
        assert listening(port) == {"127.0.0.1"}
    finally:
        pub.shutdown()


def test_consolidated_output_listens_on_the_named_host(ipc_dir: str) -> None:
    out = free_port()
    config = cc.load_consolidator_config({
        cc.ENABLE_CONSOLIDATOR: "true", cc.EVENTS_ENDPOINT: f"ipc://{ipc_dir}/ev",
        cc.OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{out}"})
    consolidator = KvEventConsolidator(config)
    consolidator.start()
    try:
        wait_until(lambda: listening(out), what="listening")
        assert listening(out) == {"127.0.0.1"}
    finally:
        consolidator.shutdown()


def test_report_receiver_listens_on_the_named_host() -> None:
    port = free_port()
    receiver = ZmqReportReceiver(CompletionHub("bind-test"), f"tcp://127.0.0.1:{port}")
    try:
        wait_until(lambda: listening(port), what="listening")
        assert listening(port) == {"127.0.0.1"}
    finally:
        receiver.close()
