"""The CLI: help for every command, yaml, env, doctor; README agrees with the code."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _kvwire import free_port

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli import main as cli
from kvbm_plugin.cli.doctor import main_doctor

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("demo", "yaml", "doctor", "env", "subscribe", "consolidate", "sidecar")


def test_help_lists_every_command(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s", out, re.M), command


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kvbm_plugin.cli.main", command, "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_yaml_is_the_connector_config(capsys) -> None:
    assert cli.main(["yaml"]) == 0
    out = capsys.readouterr().out
    assert "connector_module: kvbm_plugin\n" in out
    assert "connector_scheduler_class: KvbmConnectorLeader" in out
    assert "connector_worker_class: KvbmConnectorWorker" in out
    assert "enable_block_reuse: true" in out and "enable_partial_reuse: false" in out
    assert "cuda_graph_config: null" in out
    assert re.search(r"event_buffer_max_size: [1-9]", out)


def test_env_lists_every_variable(capsys) -> None:
    assert cli.main(["env", "--json"]) == 0
    names = [row["name"] for row in json.loads(capsys.readouterr().out)]
    assert names == [v.name for v in cc.ENV_VARS]


def test_operations_env_table_matches_the_source_of_truth() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert cc.env_table_markdown() in operations


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line and "pip" in line)
    assert command in readme
    assert readme.index(command) < readme.index("##")  # one of the two commands at the top
    assert "kvbm-plugin demo" in readme[: readme.index("##")]


def _free_leader_port() -> int:
    """A free port p whose consolidated-output port p + 1000 is free too."""
    for _ in range(100):
        port = free_port()
        if port + 1000 <= 65535 and not _busy(port + 1000):
            return port
    raise AssertionError("no free port pair found")


def _busy(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def test_doctor_ok_with_free_ports(monkeypatch, capsys) -> None:
    monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, str(free_port()))
    monkeypatch.setenv(cc.LEADER_ZMQ_PUB_PORT, str(_free_leader_port()))
    code = main_doctor(["--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["consolidator config"]["status"] == "ok"
    assert checks["TensorRT-LLM"]["status"] in ("warn", "ok")
    assert checks["torch"]["status"] == "ok"
    from kvbm_plugin._util import compiled as _compiled

    in_use = _compiled.describe()[0]  # built at install and not switched off (DYN_KVBM_NATIVE)
    assert checks["compiled loops"]["status"] == ("ok" if in_use else "warn")
    assert "zmq (kvbm-plugin" in checks["entry points kvbm_plugin.publishers"]["detail"]
    assert code == 0, [c for c in checks.values() if c["status"] == "fail"]


def test_doctor_says_which_sockets_are_open_to_every_interface(monkeypatch, capsys) -> None:
    port = free_port()
    monkeypatch.setenv(cc.EVENTS_ENDPOINT, f"tcp://127.0.0.1:{port}")
    monkeypatch.setenv(cc.OUTPUT_ENDPOINT, f"tcp://*:{free_port()}")
    main_doctor(["--json"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    ours = checks[f"rank 0 GPU-tier publisher tcp://127.0.0.1:{port}"]
    assert ours["status"] == "ok" and "every interface" not in ours["detail"]
    output = next(c for name, c in checks.items() if name.startswith("consolidated output tcp"))
    assert output["status"] == "warn" and "every interface" in output["detail"]


def test_doctor_fails_on_bad_env(monkeypatch, capsys) -> None:
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "perhaps")
    assert main_doctor([]) == 1
    assert "'perhaps'" in capsys.readouterr().out


def test_doctor_names_a_bad_native_switch(monkeypatch, capsys) -> None:
    monkeypatch.setenv(cc.NATIVE, "sometimes")
    assert main_doctor(["--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["compiled loops"]["status"] == "fail"
    assert f"{cc.NATIVE}='sometimes'" in checks["compiled loops"]["detail"]


def test_doctor_fails_on_busy_port(monkeypatch, capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, str(busy.getsockname()[1]))
        assert main_doctor(["--json"]) == 1
    checks = json.loads(capsys.readouterr().out)
    busy_checks = [c for c in checks if "GPU-tier publisher" in c["name"]]
    assert busy_checks and busy_checks[0]["status"] == "fail"


def test_doctor_require_trtllm(monkeypatch, capsys) -> None:
    from kvbm_plugin.connector import trtllm_compat as _trtllm_compat

    if _trtllm_compat.COMPAT.installed:
        pytest.skip("TensorRT-LLM is installed here")
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")
    assert main_doctor(["--require-trtllm", "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["TensorRT-LLM"]["status"] == "fail"


def _doctor_checks(capsys) -> tuple[int, dict[str, dict]]:
    code = main_doctor(["--json"])
    return code, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def test_doctor_refuses_an_unknown_publisher_as_start_up_does(monkeypatch, capsys) -> None:
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")
    monkeypatch.setenv(cc.PUBLISHER, "kafka")
    with pytest.raises(cc.ConfigError) as start_up:  # what the leader's constructor calls
        cc.load_consolidator_config()
    code, checks = _doctor_checks(capsys)
    assert code == 1
    assert checks["publisher settings"]["status"] == "fail"
    assert checks["publisher settings"]["detail"] == str(start_up.value)
    assert f"{cc.PUBLISHER}='kafka'" in str(start_up.value)


def _unwritable(path: Path):  # noqa: ANN202
    real_access = os.access

    def access(target, mode, *args, **kwargs):  # noqa: ANN001, ANN202
        if os.path.abspath(target) == str(path):
            return False
        return real_access(target, mode, *args, **kwargs)

    return access


@pytest.mark.parametrize("case", ["a file", "under a file", "not writable",
                                  "parent not writable"])
def test_doctor_refuses_a_disk_directory_start_up_cannot_use(monkeypatch, capsys, tmp_path,
                                                             case) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    directory = {"a file": a_file, "under a file": a_file / "kvbm",
                 "not writable": tmp_path, "parent not writable": tmp_path / "new" / "kvbm"}[case]
    if case == "not writable":
        monkeypatch.setattr(os, "access", _unwritable(tmp_path))
    if case == "parent not writable":
        monkeypatch.setattr(os, "access", _unwritable(tmp_path))
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")
    monkeypatch.setenv(cc.DISK_CACHE_NUM_BLOCKS, "16")
    monkeypatch.setenv(cc.DISK_CACHE_DIR, str(directory))
    with pytest.raises(cc.ConfigError) as start_up:  # what the leader and workers call
        cc.load_tier_settings()
    code, checks = _doctor_checks(capsys)
    assert code == 1
    assert checks["tier settings"] == {"name": "tier settings", "status": "fail",
                                       "detail": str(start_up.value)}
    assert f"{cc.DISK_CACHE_DIR}={str(directory)!r}" in str(start_up.value)


def test_a_usable_or_creatable_disk_directory_passes(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "0")
    monkeypatch.setenv(cc.DISK_CACHE_NUM_BLOCKS, "16")
    for directory in (tmp_path, tmp_path / "not" / "yet"):
        monkeypatch.setenv(cc.DISK_CACHE_DIR, str(directory))
        _, checks = _doctor_checks(capsys)
        assert checks["tier settings"]["status"] == "ok"
    assert not (tmp_path / "not").exists()  # checking creates nothing


def test_readme_yaml_sample_is_the_yaml_command_output(capsys) -> None:
    readme = (ROOT / "README.md").read_text()
    after = readme[readme.index("`kvbm-plugin yaml` prints:"):]
    sample = after[after.index("```yaml\n") + len("```yaml\n"):]
    sample = sample[:sample.index("```")]
    assert cli.main(["yaml"]) == 0
    assert sample == capsys.readouterr().out


def test_every_option_of_every_command_has_help(monkeypatch) -> None:
    parsers: list[argparse.ArgumentParser] = []

    def capture(self, args=None, namespace=None):  # noqa: ANN001, ANN202
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(cli.ArgumentParser, "parse_args", capture)
    for command in cli.FORWARDED:
        with pytest.raises(SystemExit):
            cli.main([command])
    assert len(parsers) == len(cli.FORWARDED)
    top = cli.build_parser()
    subcommands = top._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    parsers.extend([top, subcommands["yaml"], subcommands["env"]])
    missing = [(parser.prog, action.option_strings or action.dest) for parser in parsers
               for action in parser._actions if not action.help]
    assert missing == []
