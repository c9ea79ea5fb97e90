"""``kvbm-plugin doctor`` judges ports, tiers and directories the way the run will meet them."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.tools import doctor
from kvbm_plugin.tools.doctor import main_doctor

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _no_plugin_variables(monkeypatch) -> None:  # noqa: ANN001
    import os

    for name in list(os.environ):
        if name.startswith("DYN_KVBM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")


def _checks(capsys) -> tuple[int, dict[str, dict]]:  # noqa: ANN001
    code = main_doctor(["--json"])
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def _port_after_a_run_with_a_subscriber() -> int:
    """A port a PUB socket had bound and served a subscriber on, then closed first: its end of
    the connection stays in TIME_WAIT (about a minute on Linux), as after any run whose
    publisher had a subscriber."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    sub = context.socket(zmq.SUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        while not sub.poll(20):  # the subscription took effect once a message gets through
            pub.send(b"x")
        pub.close(0)  # the publisher's side closes first: its end goes to TIME_WAIT
        sub.close(0)
    finally:
        pub.close(0)
        sub.close(0)
        context.term()
    return port


def test_a_port_in_time_wait_is_free_as_zmq_binds_it() -> None:
    port = _port_after_a_run_with_a_subscriber()
    # A probe without SO_REUSEADDR is refused meanwhile.
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("0.0.0.0", port))
    assert doctor._port_free(port) is None
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    try:
        pub.bind(f"tcp://*:{port}")  # as the real bind does: the port is free
    finally:
        pub.close(0)
        context.term()
    with socket.socket() as busy:  # a listener is still found
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        assert doctor._port_free(busy.getsockname()[1]) is not None


def test_no_tier_says_offload_is_off(capsys) -> None:  # noqa: ANN001
    _, checks = _checks(capsys)
    assert checks["offload tiers"]["status"] == "warn"
    assert "offload is off" in checks["offload tiers"]["detail"]


@pytest.mark.parametrize(("gib", "status"), [(32, "fail"), (22, "warn"), (8, "ok")])
def test_host_cache_is_compared_with_the_machine_memory(monkeypatch, capsys, gib: int,
                                                        status: str) -> None:
    monkeypatch.setattr(doctor, "_memory_bytes", lambda: (23 * GIB, 20 * GIB))
    monkeypatch.setenv(cc.CPU_CACHE_GB, str(gib))
    code, checks = _checks(capsys)
    assert checks["host tier"]["status"] == status, checks["host tier"]
    assert f"{cc.CPU_CACHE_GB}={gib}" in checks["host tier"]["detail"]
    assert "23.0 GiB" in checks["host tier"]["detail"]
    assert (code == 1) == (status == "fail")


def test_disk_cache_is_compared_with_the_free_space(monkeypatch, capsys, tmp_path) -> None:  # noqa: ANN001
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(doctor.shutil, "disk_usage",
                        lambda path: usage._replace(free=73 * GIB))
    monkeypatch.setenv(cc.DISK_CACHE_DIR, str(tmp_path))
    monkeypatch.setenv(cc.DISK_CACHE_GB, "256")
    code, checks = _checks(capsys)
    assert code == 1
    assert checks["disk tier"]["status"] == "fail"
    assert "73.0 GiB free" in checks["disk tier"]["detail"]
    monkeypatch.setenv(cc.DISK_CACHE_GB, "64")
    _, checks = _checks(capsys)
    assert checks["disk tier"]["status"] == "ok"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_a_disk_directory_no_file_can_be_written_in_fails(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv(cc.DISK_CACHE_DIR, "/proc/kvbm-disk-tier")
    monkeypatch.setenv(cc.DISK_CACHE_NUM_BLOCKS, "16")
    code, checks = _checks(capsys)
    assert code == 1
    assert checks["disk tier"]["status"] == "fail"
    assert "cannot write a file in /proc" in checks["disk tier"]["detail"]


def test_a_missing_ipc_directory_is_called_missing(monkeypatch, capsys, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "1")
    monkeypatch.setenv(cc.EVENTS_ENDPOINT, f"ipc://{tmp_path}/missing/gpu")
    monkeypatch.setenv(cc.OUTPUT_ENDPOINT, f"ipc://{tmp_path}/out")
    code, checks = _checks(capsys)
    publisher = next(c for name, c in checks.items() if "GPU-tier publisher" in name)
    assert code == 1 and publisher["status"] == "fail"
    assert publisher["detail"] == f"{tmp_path}/missing does not exist"


def test_the_event_source_is_reported_once(capsys) -> None:  # noqa: ANN001
    _, checks = _checks(capsys)
    assert [name for name in checks if "source" in name] == ["KV event source"]
