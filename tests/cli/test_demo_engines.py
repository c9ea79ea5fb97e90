"""``kvbm-plugin demo --engines 2``: two engines on one private mooncake_master."""

from __future__ import annotations

import os
import re

import pytest

from kvbm_plugin.cli import demo

REQUIRE = os.environ.get("KVBM_REQUIRE_SHARED") == "1"


@pytest.fixture(autouse=True)
def _mooncake() -> None:
    from kvbm_plugin.consolidator_config import ConfigError
    from kvbm_plugin.tiers.shared.mooncake import import_client

    try:
        import_client()
    except ConfigError as exc:
        if REQUIRE:
            pytest.fail(f"KVBM_REQUIRE_SHARED=1 and Mooncake is not installed: {exc}")
        pytest.skip(f"Mooncake is not installed: {exc}")


# Four engine processes (two engines, TP 2) for 10-15 s: in the slow set. The default run
# carries a prefix across two engine processes in tests/connector/test_shared_two_engines.py.
@pytest.mark.slow
def test_two_engines_reuse_each_others_blocks_byte_exact(capsys) -> None:
    assert demo.main_demo(["--engines", "2", "--sessions", "4", "--turns", "3",
                           "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "all checks passed" in out
    for name, other in (("A", "B"), ("B", "A")):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"engine {name} "))
        computed = int(re.search(rf"of which (\d+) computed by engine {other}", line).group(1))
        assert computed > 0, line
    accuracy = re.search(r"router accuracy: ([\d.]+)% of prompt tokens agree .*, (\d+) rule "
                         r"warnings", out)
    assert accuracy is not None and float(accuracy.group(1)) >= 99.0
    assert accuracy.group(2) == "0"


def test_the_engines_run_refuses_a_steady_workload() -> None:
    from kvbm_plugin.cli.main import UsageError

    with pytest.raises(UsageError, match="--engines 2 runs turn waves"):
        demo.main_demo(["--engines", "2", "--requests", "5", "--no-progress"])


def _cli(tmp_path, *args: str, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
    """``kvbm-plugin demo --engines 2`` in a session of its own (a terminal's process group),
    temporary files under ``tmp_path``, SIGINT at its default action."""
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_KVBM_")}
    env["TMPDIR"] = str(tmp_path)
    return subprocess.Popen([sys.executable, "-m", "kvbm_plugin.cli.main", "demo", "--engines",
                             "2", "--no-progress", *args], env=env, text=True,
                            start_new_session=True, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            **kw)


# A whole engines run (about 15 s): in the slow set. The default run's signal test below
# holds the engines' stderr to the same nothing while they start and serve.
@pytest.mark.slow
def test_a_passing_engines_run_writes_nothing_on_stderr(tmp_path) -> None:  # noqa: ANN001
    """No glog line of Mooncake's, no warning of torch's from the engine processes: their
    stderr goes to a log file in the run's temp dir, shown only when the run fails."""
    import subprocess

    proc = _cli(tmp_path, "--sessions", "2", "--turns", "2", stdout=subprocess.PIPE)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, (out[-2000:], err)
    assert err == ""
    assert not list(tmp_path.glob("kvbm-*"))


# SIGTERM takes the same path as SIGINT once the handler runs (demo_signals.py): SIGINT in the
# slow set.
@pytest.mark.parametrize("signum", [pytest.param("SIGINT", marks=pytest.mark.slow), "SIGTERM"])
def test_the_engines_run_ends_promptly_on_a_signal(tmp_path, signum: str) -> None:  # noqa: ANN001
    import signal
    import subprocess
    import time

    sig = getattr(signal, signum)
    proc = _cli(tmp_path, "--sessions", "16", "--turns", "8", stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        # Both engines serve once each one's consolidated output exists.
        while len(list(tmp_path.glob("kvbm-demo-engines-*/?-out"))) < 2 \
                and proc.poll() is None:
            assert time.monotonic() < deadline, "the engines did not come up"
            time.sleep(0.02)  # poll interval; the condition decides
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Nothing at all: no traceback, and no glog line of Mooncake's or warning of torch's
    # from the engine processes while they started and served (their stderr goes to a log
    # file in the run's temp dir); SIGINT adds the one line that says so.
    assert err == ("kvbm-plugin demo: interrupted\n" if sig == signal.SIGINT else ""), err
    assert proc.returncode == 128 + sig, err
    assert took < 5, f"{took:.1f} s from the signal to the exit (before: 11-12 s)"
    assert not list(tmp_path.glob("kvbm-*"))
