"""Every command turns a configuration or usage error into one line on stderr that names the
option or variable and its value, with exit status 2 (usage, configuration) or 1 (runtime), and
no traceback; Ctrl-C and SIGTERM end the demo through its clean-up."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from _kvwire import free_port

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.settings.variables import ENV_VARS_BY_NAME, LEADER_ZMQ_PUB_PORT


def _env(**variables: str) -> dict[str, str]:
    """This process's environment without any DYN_KVBM_* variable, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    env.update(variables)
    return env


def _run(args: list[str], env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvbm_plugin.cli.main", *args],
                          env=_env() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)


def _run_here(args: list[str], capsys: pytest.CaptureFixture[str],
              monkeypatch: pytest.MonkeyPatch, **variables: str
              ) -> subprocess.CompletedProcess[str]:
    """``kvbm-plugin ARGS`` in this process (``cli.main``), for the demo's runtime errors: a
    CLI process of the demo spends 2 s importing torch, which this process has imported.
    The environment as :func:`_env` makes it; stderr as ``sys.stderr`` (what the command and
    Python's warnings write; not file descriptor 2, where a thread left by an earlier test,
    such as a Mooncake client closing, may write)."""
    from kvbm_plugin.cli import main as cli

    for name in [k for k in os.environ if k.startswith("DYN_KVBM_")]:
        monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    status = cli.main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["kvbm-plugin", *args], status, out, err)


def _assert_one_line(result: subprocess.CompletedProcess[str], status: int,
                     *names: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert result.returncode == status, (result.returncode, result.stderr)
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


PORT = str(free_port())  # nothing binds it: each case below fails before any socket exists

CASES = {
    "demo pool too small for a request": (
        ["demo", "--gpu-blocks", "8", "--no-progress"], {}, 2, ["--gpu-blocks 8", "23 blocks"]),
    "demo bad int": (["demo", "--tp", "two"], {}, 2, ["--tp", "'two'"]),
    "demo bad tier": (["demo", "--tiers", "tape"], {}, 2, ["--tiers", "tape"]),
    "demo bad native switch": (
        ["demo", "--no-progress"], {cc.NATIVE: "perhaps"}, 2, [cc.NATIVE, "'perhaps'"]),
    "consolidate bad log level": (
        ["consolidate", "--log-level", "LOUD"], {cc.TRTLLM_ZMQ_PORT: PORT}, 2,
        ["--log-level", "'LOUD'"]),
    "consolidate bad native switch": (
        ["consolidate"], {cc.NATIVE: "perhaps", cc.TRTLLM_ZMQ_PORT: PORT}, 2,
        [cc.NATIVE, "'perhaps'"]),
    "consolidate unknown publisher": (
        ["consolidate"], {cc.PUBLISHER: "kafka", cc.TRTLLM_ZMQ_PORT: PORT}, 2,
        [cc.PUBLISHER, "'kafka'", "zmq"]),
    "consolidate bad consolidator switch": (
        ["consolidate"], {cc.ENABLE_CONSOLIDATOR: "maybe", cc.TRTLLM_ZMQ_PORT: PORT}, 2,
        [cc.ENABLE_CONSOLIDATOR, "'maybe'"]),
    "consolidate bad ranks": (
        ["consolidate", "--num-ranks", "0"], {cc.TRTLLM_ZMQ_PORT: PORT}, 2, ["--num-ranks", "0"]),
    "subscribe negative count": (["subscribe", "ipc:///tmp/x", "--count", "-1"], {}, 2,
                                 ["--count", "-1"]),
    "subscribe negative from-seq": (
        ["subscribe", "ipc:///tmp/x", "--replay", "ipc:///tmp/y", "--from-seq", "-1"], {}, 2,
        ["--from-seq", "-1"]),
    "subscribe json with tree": (["subscribe", "ipc:///tmp/x", "--json", "--tree"], {}, 2,
                                 ["--json", "--tree"]),
    "subscribe port out of range": (["subscribe", "tcp://127.0.0.1:70000"], {}, 2,
                                    ["'tcp://127.0.0.1:70000'", "port 70000"]),
    "consolidate bad endpoint option": (
        ["consolidate", "--events-endpoint", "tcp://:x"], {cc.TRTLLM_ZMQ_PORT: PORT}, 2,
        ["--events-endpoint='tcp://:x'"]),
    "sidecar not a url": (["sidecar", "--url", "not-a-url", "--block-size", "16"],
                          {cc.TRTLLM_ZMQ_PORT: PORT}, 2, ["--url", "'not-a-url'"]),
    "sidecar zero interval": (
        ["sidecar", "--url", "http://127.0.0.1:9", "--block-size", "16", "--interval", "0"],
        {cc.TRTLLM_ZMQ_PORT: PORT}, 2, ["--interval", "0"]),
    "sidecar bad native switch": (
        ["sidecar", "--url", "http://127.0.0.1:9", "--block-size", "16"],
        {cc.NATIVE: "perhaps", cc.TRTLLM_ZMQ_PORT: PORT}, 2, [cc.NATIVE, "'perhaps'"]),
    "sidecar unknown publisher": (
        ["sidecar", "--url", "http://127.0.0.1:9", "--block-size", "16"],
        {cc.PUBLISHER: "kafka", cc.TRTLLM_ZMQ_PORT: PORT}, 2, [cc.PUBLISHER, "'kafka'"]),
    "doctor bad ranks": (["doctor", "--num-ranks", "x"], {}, 2, ["--num-ranks", "'x'"]),
    "subscribe bad endpoint": (["subscribe", "bogus://x"], {}, 2, ["endpoint", "bogus://x"]),
    "top level unknown command": (["fly"], {}, 2, ["'fly'"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_option_or_variable_is_one_line_naming_it(case: str) -> None:
    args, variables, status, names = CASES[case]
    _assert_one_line(_run(args, _env(**variables)), status, *names)


def test_sidecar_on_a_busy_port_is_one_line_naming_the_port_and_variable() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _run(["sidecar", "--url", "http://127.0.0.1:9", "--block-size", "16"],
                      _env(**{cc.TRTLLM_ZMQ_PORT: str(port)}))
    _assert_one_line(result, 1, str(port), cc.TRTLLM_ZMQ_PORT)


def test_sidecar_without_a_port_asks_for_the_port_not_the_consolidator_switch() -> None:
    line = _assert_one_line(_run(["sidecar", "--url", "http://127.0.0.1:9", "--block-size",
                                  "16"]), 2, cc.TRTLLM_ZMQ_PORT, cc.EVENTS_ENDPOINT)
    assert cc.ENABLE_CONSOLIDATOR not in line


def test_consolidate_without_a_port_asks_for_the_port_not_the_consolidator_switch() -> None:
    line = _assert_one_line(_run(["consolidate"]), 2, cc.TRTLLM_ZMQ_PORT, cc.EVENTS_ENDPOINT)
    assert cc.ENABLE_CONSOLIDATOR not in line


def test_sidecar_the_readme_way_gets_past_its_options(tmp_path: Path) -> None:
    """README's sidecar line, with the endpoint it needs: nothing to complain about until it
    polls (stopped right after start-up by SIGTERM)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "`kvbm-plugin sidecar --url" in x)
    command = line.split("`")[1].split()
    assert "--block-size" in command and "--url" in command
    args = [a.replace("http://host:port", "http://127.0.0.1:9") for a in command[1:]]
    args = [a if a != "N" else "16" for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "kvbm_plugin.cli.main", *args],
                            env=_env(**{cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu"}),
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (tmp_path / "gpu_dp0").exists() or proc.poll() is not None)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert "Traceback" not in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def _children_take_ctrl_c() -> Iterator[None]:
    """Processes started inside begin with SIGINT's default action, as a foreground command
    does, whatever this process inherited.

    A shell without job control starts a background command (``pytest ... &``, a CI step run
    that way) with SIGINT ignored, and an ignored signal stays ignored across fork and exec:
    Python then installs no Ctrl-C handler, and a demo under test would never see the SIGINT
    these tests send. A signal this process handles is reset to its default action by exec.
    """
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_children_take_ctrl_c_even_when_this_process_ignores_it() -> None:
    check = ("import signal; "
             "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as under ``pytest ... &``
    try:
        inherited = subprocess.run([sys.executable, "-c", check], capture_output=True,
                                   text=True, timeout=60, check=True).stdout.split()
        with _children_take_ctrl_c():
            started = subprocess.run([sys.executable, "-c", check], capture_output=True,
                                     text=True, timeout=60, check=True).stdout.split()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # put back afterwards
    finally:
        signal.signal(signal.SIGINT, previous)
    assert inherited == ["False"]  # the case the helper is for
    assert started == ["True"]


def _wait_for(condition, timeout: float = 60.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class _SignalInFinalizer:
    """An object whose finalizer delivers ``signum``: the handler's exception is raised inside
    ``__del__``, where Python reports it as "Exception ignored" and swallows it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        signal.raise_signal(self.signum)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(("signum", "raised"), [(signal.SIGINT, KeyboardInterrupt),
                                                (signal.SIGTERM, SystemExit)])
def test_a_signal_whose_exception_a_finalizer_swallowed_still_ends_the_demo(
        monkeypatch, signum: int, raised: type) -> None:  # noqa: ANN001
    """A signal handled while a finalizer runs (a ZMQ socket collected mid-run) must still end
    the demo, with its status, not let it run on and exit 0."""
    from kvbm_plugin.cli import demo, demo_report

    update = demo_report.Progress.update
    sent: list[int] = []

    def update_and_signal(self, *args, **kw) -> None:  # noqa: ANN001, ANN002, ANN003
        if not sent:
            sent.append(signum)
            _SignalInFinalizer(signum)  # collected at once: __del__ delivers the signal
        update(self, *args, **kw)

    monkeypatch.setattr(demo_report.Progress, "update", update_and_signal)
    # As in a terminal (a background job, as CI runs the suite, starts with SIGINT ignored).
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        previous = signal.getsignal(signal.SIGTERM)
        with pytest.raises(raised) as caught:
            demo.main_demo(["--no-progress", "--sessions", "8", "--turns", "4"])
        assert sent == [signum]
        if raised is SystemExit:
            assert caught.value.code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is previous  # the demo's handlers put back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)


# SIGTERM to the plain demo in the slow set: by default it ends the attention-DP demo and the
# engines run (test_cli_operator.py, test_demo_engines.py) through the same handler.
@pytest.mark.parametrize(("signum", "status", "line"),
                         [(signal.SIGINT, 130, "kvbm-plugin demo: interrupted"),
                          pytest.param(signal.SIGTERM, 128 + signal.SIGTERM, None,
                                       marks=pytest.mark.slow)])
def test_a_signal_during_the_demo_ends_it_cleanly(tmp_path: Path, signum: int, status: int,
                                                  line: str | None) -> None:
    """Ctrl-C is one line and status 130; SIGTERM exits 143; both leave no traceback and no
    ``kvbm-demo-*`` directory behind."""
    with _children_take_ctrl_c():
        proc = subprocess.Popen([sys.executable, "-m", "kvbm_plugin.cli.main", "demo",
                                 "--no-progress", "--sessions", "32", "--turns", "8"],
                                env=_env(TMPDIR=str(tmp_path)), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        # The engine is up once the consolidated output's ipc socket exists.
        _wait_for(lambda: any(tmp_path.glob("kvbm-demo-*/consolidated"))
                  or proc.poll() is not None)
        assert proc.poll() is None, "the demo ended before the signal"
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == status
        stderr = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in stderr, stderr
    if line is not None:
        assert [x for x in stderr.splitlines() if x.strip()] == [line]
    assert not list(tmp_path.glob("kvbm-demo-*"))


# A value each variable's parser refuses.
BAD_VALUES = {
    cc.ENABLE_CONSOLIDATOR: "maybe", cc.CONSOLIDATOR_MODE: "fast", cc.TRTLLM_ZMQ_PORT: "70000",
    cc.LEADER_ZMQ_PUB_PORT: "abc", cc.LEADER_ZMQ_HOST: "a host", cc.EVENTS_ENDPOINT: "udp://x",
    cc.REPLAY_ENDPOINT: "udp://x", cc.OUTPUT_ENDPOINT: "udp://x",
    cc.OUTPUT_REPLAY_ENDPOINT: "udp://x", cc.PUBLISHER: "kafka", cc.BUFFER_STEPS: "0",
    cc.BUFFER_BYTES: "1k",
    cc.HWM: "-1", cc.MAX_QUEUE_SIZE: "many", cc.WINDOW_SIZE: "0", cc.NATIVE: "perhaps",
    cc.TOPIC: "kv@pod-only", cc.ZMQ_ALLOW: "router.local", cc.ZMQ_MAX_PEERS: "0",
    cc.SALT_FORM: "hex", cc.LORA_NAMES: "a=b", cc.OUTPUT_REPLAY_ROLLED: "newest",
}
STANDALONE = {
    "consolidate": [],
    "sidecar": ["--url", "http://127.0.0.1:9", "--block-size", "16"],
}


def test_every_variable_the_standalone_commands_read_is_listed() -> None:
    # The event source is the leader's alone (where it takes GPU-tier events from).
    assert set(BAD_VALUES) | {cc.EVENTS_SOURCE} == {
        v.name for v in cc.ENV_VARS if v.group in ("consolidator", "publisher")} | {cc.NATIVE}


# Every other variable start-up reads, with a value it refuses (DYN_KVBM_DISK_CACHE_DIR: see
# test_cli.py's disk directory cases).
BAD_VALUES_ELSEWHERE = {
    cc.EVENTS_SOURCE: "bogus", cc.CPU_CACHE_GB: "-1", cc.CPU_CACHE_NUM_BLOCKS: "some",
    cc.DISK_CACHE_GB: "lots", cc.DISK_CACHE_NUM_BLOCKS: "-3", cc.METRICS: "maybe",
    cc.METRICS_PORT: "0", cc.TRTLLM_MOVED_ENDPOINT: "udp://host:1",
    cc.HOST_TIER: "no-such-tier", cc.DISK_TIER: "no-such-tier",
}


# The shared tier's variables, each with the ones that switch the tier on (doctor reads them
# only then). The RDMA device names, the metadata server and the local hostname take any string.
SHARED_ON = {cc.SHARED_TIER: "mooncake", cc.SHARED_MODEL_KEY: "m",
             cc.SHARED_ADDRESS: "127.0.0.1:1"}
BAD_SHARED_VALUES = {
    cc.SHARED_TIER: "s3", cc.SHARED_MODEL_KEY: "a/b", cc.SHARED_NAMESPACE: "x y",
    cc.SHARED_ADDRESS: "nohost", cc.SHARED_PROTOCOL: "carrier-pigeon",
    cc.SHARED_METRICS_ADDRESS: "nohost", cc.SHARED_SEGMENT_GB: "lots",
    cc.SHARED_BUFFER_GB: "-1", cc.SHARED_PEERS: "udp://x", cc.SHARED_ANNOUNCE_ENDPOINT: "udp://x",
    cc.SHARED_TRACKED_BLOCKS: "0", cc.SHARED_QUEUE_BLOCKS: "many", cc.SHARED_LEASE_S: "soon",
    cc.SHARED_LOAD_MARGIN_S: "abc", cc.MOONCAKE_CONFIG_PATH: "/nonexistent/mooncake.json",
    cc.SHARED_ANNOUNCE_SECRET_FILE: "/nonexistent/announce.secret",
    cc.SHARED_ANNOUNCE_RATE: "fast",
}
FREE_FORM_SHARED = {cc.SHARED_DEVICE, cc.SHARED_METADATA_SERVER, cc.SHARED_LOCAL_HOSTNAME}


def test_doctor_covers_every_variable() -> None:
    assert set(BAD_VALUES) | set(BAD_VALUES_ELSEWHERE) | set(BAD_SHARED_VALUES) \
        | FREE_FORM_SHARED | {cc.DISK_CACHE_DIR} == {v.name for v in cc.ENV_VARS}


@pytest.mark.parametrize("variable", list(BAD_SHARED_VALUES))
def test_doctor_refuses_a_bad_value_of_every_shared_variable(monkeypatch, capsys,
                                                             variable: str) -> None:
    from kvbm_plugin.cli.doctor import main_doctor

    for var in cc.ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, PORT)
    for name, value in {**SHARED_ON, variable: BAD_SHARED_VALUES[variable]}.items():
        monkeypatch.setenv(name, value)
    assert main_doctor(["--json"]) == 1
    failed = [c for c in json.loads(capsys.readouterr().out) if c["status"] == "fail"]
    value = BAD_SHARED_VALUES[variable]
    assert any(f"{variable}={value!r}" in c["detail"] for c in failed), failed


@pytest.mark.parametrize("variable", list(BAD_VALUES) + list(BAD_VALUES_ELSEWHERE))
def test_doctor_refuses_a_bad_value_of_every_variable(monkeypatch, capsys,
                                                      variable: str) -> None:
    from kvbm_plugin.cli.doctor import main_doctor

    for var in cc.ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, PORT)
    value = {**BAD_VALUES, **BAD_VALUES_ELSEWHERE}[variable]
    monkeypatch.setenv(variable, value)
    assert main_doctor(["--json"]) == 1
    failed = [c for c in json.loads(capsys.readouterr().out) if c["status"] == "fail"]
    assert any(f"{variable}={value!r}" in c["detail"] for c in failed), failed


@pytest.mark.parametrize("command", list(STANDALONE))
@pytest.mark.parametrize("variable", list(BAD_VALUES))
def test_standalone_commands_validate_every_variable_they_read(monkeypatch, capsys, command: str,
                                                               variable: str) -> None:
    from kvbm_plugin.cli import main as cli

    for var in cc.ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, PORT)
    monkeypatch.setenv(variable, BAD_VALUES[variable])
    assert cli.main([command, *STANDALONE[command]]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()]
    assert f"{variable}={BAD_VALUES[variable]!r}" in err, err


def test_ctrl_c_while_torch_loads_waits_for_the_import_then_interrupts() -> None:
    """A KeyboardInterrupt raised inside torch's initialisation (Python called from C++) aborts
    the process; the demo holds Ctrl-C back until torch is loaded, then acts on it."""
    code = textwrap.dedent("""
        import importlib.abc, signal, sys

        class CtrlCWhenTorchLoads(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "torch":
                    sys.meta_path.remove(self)
                    signal.raise_signal(signal.SIGINT)
                return None

        from kvbm_plugin.cli import main as cli
        sys.meta_path.insert(0, CtrlCWhenTorchLoads())
        status = cli.main(["demo", "--no-progress"])
        print("torch" in sys.modules, status)
    """)
    with _children_take_ctrl_c():
        result = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                                text=True, timeout=120)
    assert result.stdout.split() == ["True", "130"], result.stderr
    assert [x for x in result.stderr.splitlines() if "kvbm-plugin" in x] == [
        "kvbm-plugin demo: interrupted"]
    assert "Traceback" not in result.stderr


def test_consolidate_names_its_option_not_the_variable_it_overrides() -> None:
    line = _assert_one_line(_run(["consolidate", "--events-endpoint", "tcp://:x"],
                                 _env(**{cc.TRTLLM_ZMQ_PORT: PORT})), 2)
    assert cc.EVENTS_ENDPOINT not in line


def test_demo_without_cuda_names_the_command(capsys, monkeypatch) -> None:  # noqa: ANN001
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = _run_here(["demo", "--device", "cuda", "--no-progress"], capsys, monkeypatch)
    line = _assert_one_line(result, 2)
    assert line.startswith("kvbm-plugin demo: --device cuda")


def test_an_expired_demo_timeout_is_one_line_and_status_1(capsys, monkeypatch) -> None:  # noqa: ANN001
    result = _run_here(["demo", "--no-progress", "--timeout", "0.05"], capsys, monkeypatch)
    line = _assert_one_line(result, 1, "--timeout 0.05")
    assert line.startswith("kvbm-plugin demo: the run did not finish")


def _busy_socket() -> socket.socket:
    """A listening socket on an ephemeral port other than the leader's default port (56001,
    inside Linux's ephemeral range): on that one the demo's output would collide with the
    leader's port, a configuration error (status 2), before any bind."""
    while True:
        busy = socket.socket()
        busy.bind(("0.0.0.0", 0))
        if busy.getsockname()[1] != int(ENV_VARS_BY_NAME[LEADER_ZMQ_PUB_PORT].default or 0):
            busy.listen()
            return busy
        busy.close()


@pytest.mark.parametrize("command", ["demo", "consolidate", "sidecar"])
def test_a_busy_port_is_status_1_in_every_command(command: str, capsys, monkeypatch) -> None:  # noqa: ANN001
    with _busy_socket() as busy:
        port = str(busy.getsockname()[1])
        args = {"demo": ["demo", "--no-progress"], "consolidate": ["consolidate"],
                "sidecar": ["sidecar", "--url", "http://127.0.0.1:9", "--block-size", "16"]}
        variables = {"demo": {cc.OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{port}"},
                     "consolidate": {cc.TRTLLM_ZMQ_PORT: PORT,
                                     cc.OUTPUT_ENDPOINT: f"tcp://127.0.0.1:{port}"},
                     "sidecar": {cc.TRTLLM_ZMQ_PORT: port}}
        result = _run_here(args[command], capsys, monkeypatch, **variables[command]) \
            if command == "demo" else _run(args[command], _env(**variables[command]))
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert port in result.stderr


def _started(command: str, tmp_path: Path, stack: ExitStack
             ) -> tuple[list[str], dict[str, str], object]:
    """A long-running command, its environment, and when it has installed its signal
    handlers (what it wrote, bound or connected to by then)."""
    if command == "subscribe":
        # A listener that accepts and never answers ZMQ's greeting (nothing to subscribe to):
        # the subscriber connects to it right after installing its handlers.
        listener = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        listener.bind(str(tmp_path / "nobody"))
        listener.listen()
        return (["subscribe", f"ipc://{tmp_path}/nobody"], _env(),
                lambda proc, err: bool(select.select([listener], [], [], 0)[0]))
    if command == "consolidate":
        return (["consolidate", "--log-level", "INFO"],
                _env(**{cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu",
                        cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/out"}),
                lambda proc, err: "consolidator started" in err)
    return (["sidecar", "--url", "http://127.0.0.1:9", "--block-size", "16"],
            _env(**{cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/gpu"}),
            lambda proc, err: (tmp_path / "gpu_dp0").exists())


@pytest.mark.parametrize("command", ["subscribe", "consolidate", "sidecar"])
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_every_long_running_command_with_its_status(
        tmp_path: Path, command: str, signum: int, status: int) -> None:
    import selectors

    with ExitStack() as stack:  # the subscriber's listener lives until the command ended
        args, env, ready = _started(command, tmp_path, stack)
        with _children_take_ctrl_c():
            proc = subprocess.Popen([sys.executable, "-m", "kvbm_plugin.cli.main", *args],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
        err = ""
        try:
            assert proc.stderr is not None
            os.set_blocking(proc.stderr.fileno(), False)
            selector = selectors.DefaultSelector()
            selector.register(proc.stderr, selectors.EVENT_READ)
            deadline = time.monotonic() + 60
            while not ready(proc, err):
                assert proc.poll() is None, err
                assert time.monotonic() < deadline, err
                if selector.select(0.05):
                    err += proc.stderr.read() or ""
            proc.send_signal(signum)
            assert proc.wait(timeout=60) == status
            os.set_blocking(proc.stderr.fileno(), True)
            err += proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in err, err


@pytest.mark.parametrize("command", [["env"], ["env", "--json"], ["yaml"], ["doctor"]])
def test_a_reader_that_closed_stdout_ends_the_command_quietly(command: list[str]) -> None:
    """``kvbm-plugin env | head``: the pipe's reader is gone before the command writes (its read
    end closed first, so the write fails every time); no traceback, status 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvbm_plugin.cli.main", *command],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_the_long_running_commands_signal_handler_takes_no_lock() -> None:
    """Python runs a signal handler on the main thread between two bytecodes, which may be
    inside a lock the main thread holds (an ``Event.wait``'s own lock): a handler that takes
    a lock can deadlock the command. It did: ``consolidate`` never ended after a SIGTERM in
    about 1 of 25 tries beside a busy process, its handler's ``Event.set()`` waiting for the
    lock its own ``Event.wait`` held. The handler records the signal and takes no lock."""
    from kvbm_plugin.cli.main import SignalStop

    stop = SignalStop()
    taken: list[str] = []

    def profile(frame: object, event: str, arg: object) -> None:
        name = getattr(arg, "__name__", "")
        if event == "c_call" and name in ("acquire", "__enter__", "acquire_lock"):
            taken.append(repr(arg))

    sys.setprofile(profile)
    try:
        stop._on_signal(signal.SIGTERM, None)
    finally:
        sys.setprofile(None)
    assert taken == [] and stop.is_set() and stop.status == 143


def test_a_signal_ends_the_commands_wait_at_once() -> None:
    """The C-level handler's byte on the wake-up fd ends ``SignalStop.wait`` at once (no
    polling); without a signal it sleeps out its timeout; ``restore`` puts everything back."""
    from kvbm_plugin.cli.main import SignalStop

    before = signal.getsignal(signal.SIGINT)
    stop = SignalStop().install()
    try:
        assert stop.wait(0.01) is False and stop.status == 0
        signal.raise_signal(signal.SIGINT)
        started = time.monotonic()
        assert stop.wait(30) is True
        assert time.monotonic() - started < 5 and stop.status == 130
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1  # none left installed
