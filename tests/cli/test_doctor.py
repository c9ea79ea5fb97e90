"""``kvbm-plugin doctor`` judges ports, tiers and directories the way the run will meet them."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import zmq

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli import doctor
from kvbm_plugin.cli.doctor import main_doctor

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _no_plugin_variables(monkeypatch) -> None:  # noqa: ANN001
    for name in list(os.environ):
        if name.startswith("DYN_KVBM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")
    # The leader's ports derive from this one (+1000 the output, +2000 announcements): free ones,
    # so that a run elsewhere on the machine holding the defaults fails no check here.
    monkeypatch.setenv(cc.LEADER_ZMQ_PUB_PORT, str(_free_base()))


def _free_base() -> int:
    """A port P with P, P + 1000 and P + 2000 free on loopback now."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 30000)
        try:
            for port in (base, base + 1000, base + 2000):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise AssertionError("no free port base on loopback")


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


# --------------------------------------------------------------------------- issue 27, item 7


@pytest.fixture
def silent_server():  # noqa: ANN201
    """A TCP address that accepts connections and never answers."""
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize("store", ["mooncake", "redis"])
def test_a_store_that_accepts_and_never_answers_fails_within_the_timeout(
        monkeypatch, capsys, silent_server: str, store: str) -> None:  # noqa: ANN001
    import time

    """Mooncake's client set-up waits as long as the peer holds the connection (a doctor
    still running at 180 s); Redis's own socket timeout is 5 s. Both end at --timeout."""
    pytest.importorskip("mooncake.store" if store == "mooncake" else "redis")
    for name, value in ((cc.SHARED_TIER, store), (cc.SHARED_MODEL_KEY, "m"),
                        (cc.SHARED_ADDRESS, silent_server), (cc.CPU_CACHE_NUM_BLOCKS, "8")):
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert main_doctor(["--json", "--timeout", "1"]) == 1
    assert time.monotonic() - started < 8
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)}[f"shared tier ({store})"]
    assert check["status"] == "fail", check
    assert f"{cc.SHARED_ADDRESS}={silent_server!r}: no answer within 1 s" in check["detail"]


def test_a_shared_tier_without_a_host_tier_is_a_problem(monkeypatch, capsys) -> None:  # noqa: ANN001
    for name, value in ((cc.SHARED_TIER, "redis"), (cc.SHARED_MODEL_KEY, "m"),
                        (cc.SHARED_ADDRESS, "127.0.0.1:1")):
        monkeypatch.setenv(name, value)
    code, checks = _checks(capsys)
    assert code == 1
    assert checks["shared tier needs the host tier"]["status"] == "fail"
    monkeypatch.setenv(cc.CPU_CACHE_NUM_BLOCKS, "8")
    _, checks = _checks(capsys)
    assert "shared tier needs the host tier" not in checks


def test_a_host_name_that_does_not_resolve_is_not_free(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv(cc.LEADER_ZMQ_HOST, "kvbm-no-such-host.invalid")
    code, checks = _checks(capsys)
    port = int(os.environ[cc.LEADER_ZMQ_PUB_PORT]) + 1000
    output = checks[f"consolidated output tcp://kvbm-no-such-host.invalid:{port}"]
    assert code == 1 and output["status"] == "fail"
    assert "'kvbm-no-such-host.invalid' does not resolve" in output["detail"]
    monkeypatch.setenv(cc.LEADER_ZMQ_HOST, "localhost")  # a name that resolves binds
    _, checks = _checks(capsys)
    assert checks[f"consolidated output tcp://localhost:{port}"]["status"] == "ok"


def test_the_announce_socket_on_the_gpu_tier_publishers_port_is_found(monkeypatch,
                                                                      capsys) -> None:  # noqa: ANN001
    for name, value in ((cc.SHARED_TIER, "redis"), (cc.SHARED_MODEL_KEY, "m"),
                        (cc.SHARED_ADDRESS, "127.0.0.1:1"), (cc.CPU_CACHE_NUM_BLOCKS, "8"),
                        (cc.LEADER_ZMQ_PUB_PORT, "30001"), (cc.TRTLLM_ZMQ_PORT, "32001")):
        monkeypatch.setenv(name, value)
    code, checks = _checks(capsys)
    config = checks["consolidator config"]
    assert code == 1 and config["status"] == "fail"
    assert "shared-tier announce endpoint" in config["detail"] and "32001" in config["detail"]
    # Start-up reads the same config: it refuses the collision too.
    with pytest.raises(cc.ConfigError, match="announce endpoint"):
        cc.load_consolidator_config()


@pytest.mark.parametrize("gib", ["0.001", "0.0145"])
def test_a_mooncake_segment_between_0_and_16_mib_fails(monkeypatch, capsys, gib: str) -> None:  # noqa: ANN001
    for name, value in ((cc.SHARED_TIER, "mooncake"), (cc.SHARED_MODEL_KEY, "m"),
                        (cc.SHARED_ADDRESS, "127.0.0.1:1"), (cc.CPU_CACHE_NUM_BLOCKS, "8"),
                        (cc.SHARED_SEGMENT_GB, gib)):
        monkeypatch.setenv(name, value)
    code, checks = _checks(capsys)
    shared = checks["shared tier (mooncake)"]
    assert code == 1 and shared["status"] == "fail"
    assert f"{cc.SHARED_SEGMENT_GB}={gib!r}" in shared["detail"] and "16 MiB" in shared["detail"]


def test_a_tier_smaller_than_one_block_fails(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv(cc.DISK_CACHE_GB, "0.0000001")  # 107 bytes
    code, checks = _checks(capsys)
    assert code == 1 and checks["disk tier"]["status"] == "fail"
    assert f"{cc.DISK_CACHE_GB}=1e-07 is 107 bytes" in checks["disk tier"]["detail"]
    monkeypatch.setenv(cc.CPU_CACHE_GB, "0.01")  # 10 MiB: more than 1 MiB, less than 16 MiB
    assert main_doctor(["--json", "--block-bytes", str(16 << 20)]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert "--block-bytes 16777216" in checks["host tier"]["detail"]
    assert checks["host tier"]["status"] == "fail"


def test_an_unknown_tier_class_fails_naming_the_variable(monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv(cc.CPU_CACHE_NUM_BLOCKS, "8")
    code, checks = _checks(capsys)
    assert checks["tier classes"]["status"] == "ok"
    assert "DYN_KVBM_HOST_TIER='host': kvbm_plugin.tiers.host.HostTier" \
        in checks["tier classes"]["detail"]
    monkeypatch.setenv(cc.DISK_TIER, "nvme-direct")
    code, checks = _checks(capsys)
    assert code == 1 and checks["tier classes"]["status"] == "fail"
    assert "DYN_KVBM_DISK_TIER='nvme-direct': no entry point named 'nvme-direct'" \
        in checks["tier classes"]["detail"]


def test_the_yaml_command_output_is_read_without_pyyaml(monkeypatch, tmp_path: Path) -> None:  # noqa: ANN001
    import sys

    from kvbm_plugin.cli.main import ENGINE_YAML

    monkeypatch.setitem(sys.modules, "yaml", None)  # a fresh install: import yaml fails
    written = tmp_path / "kvbm.yaml"
    written.write_text(ENGINE_YAML)
    options = doctor.read_llm_api_options(str(written))
    assert options["kv_connector_config"]["connector_module"] == "kvbm_plugin"
    assert options["kv_cache_config"] == {"enable_block_reuse": True,
                                          "enable_partial_reuse": False,
                                          "event_buffer_max_size": 1024}
    assert options["cuda_graph_config"] is None and options["backend"] == "pytorch"
    flow = tmp_path / "flow.yaml"
    flow.write_text("kv_cache_config: {enable_block_reuse: true}\n")
    with pytest.raises(cc.ConfigError, match="pip install pyyaml"):
        doctor.read_llm_api_options(str(flow))
