"""The demo runs end to end and its checks can fail."""

from __future__ import annotations

import io
import re
import sys
import threading

import pytest

from kvbm_plugin.cli import demo, demo_checks, demo_options, demo_report
from kvbm_plugin.cli.main import UsageError

SMALL = ["--sessions", "6", "--turns", "3", "--system-tokens", "64", "--gpu-blocks", "24",
         "--host-blocks", "16", "--disk-blocks", "64", "--no-progress"]


def test_demo_passes_and_reports_every_tier(capsys) -> None:
    assert demo.main_demo(SMALL) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out
    assert "[FAIL]" not in out
    for line in ("hit rate GPU", "hit rate host", "hit rate disk", "bytes offloaded",
                 "suppressed by dedup", "gaps / losses", "subscriber view"):
        assert line in out
    assert "0 gaps, 0 batches lost" in out
    assert "overlap scheduler" in out  # the default loop


def test_demo_passthrough_mode(capsys) -> None:
    assert demo.main_demo([*SMALL, "--mode", "passthrough"]) == 0
    assert "suppressed by dedup         0 of" in capsys.readouterr().out


def test_demo_runs_the_plain_loop_on_request(capsys) -> None:
    # (The overlap scheduler by default: test_demo_passes_and_reports_every_tier.)
    assert demo.main_demo([*SMALL, "--no-overlap"]) == 0
    out = capsys.readouterr().out
    assert "plain scheduler" in out and "all checks passed" in out


def test_demo_with_ranks_in_processes_needs_tp() -> None:
    # (A run with rank processes: test_rank_processes_pass_and_print_no_numpy_warning.)
    with pytest.raises(UsageError, match="--processes needs --tp > 1"):
        demo.main_demo([*SMALL, "--tp", "1", "--processes"])


# Each run starts two rank processes (seconds): the default options in the slow set. By
# default the plain loop in passthrough mode runs here, and the overlap scheduler with dedup
# under attention DP in tests/testing/test_attention_dp.py (and the signal tests' demo runs).
@pytest.mark.parametrize("extra", [
    pytest.param([], marks=pytest.mark.slow), ["--no-overlap", "--mode", "passthrough"]])
def test_demo_under_attention_dp(capsys, extra: list[str]) -> None:
    """Every rank its own process; the router view over every rank's output agrees."""
    assert demo.main_demo([*SMALL, "--attention-dp", "2", *extra]) == 0
    out = capsys.readouterr().out
    assert "attention DP 2 ranks (rank processes)" in out and "all checks passed" in out
    assert "consolidated events, dp rank 1" in out
    assert "reads per rank 1..: [0]" in out and "router rule warnings 0: 0" in out
    with pytest.raises(UsageError, match="--attention-dp 2 runs one rank per process"):
        demo.main_demo([*SMALL, "--attention-dp", "2", "--tp", "2"])


def test_demo_fails_when_the_subscriber_view_is_wrong(monkeypatch, capsys) -> None:
    from kvbm_plugin.testing.engine import SimulatedEngine

    true_contents = SimulatedEngine.resident_blocks

    def with_a_block_nobody_announced(self: SimulatedEngine) -> dict:
        truth = true_contents(self)
        truth["CPU"][0] = set(truth["CPU"][0]) | {12345}
        return truth

    monkeypatch.setattr(SimulatedEngine, "resident_blocks", with_a_block_nobody_announced)
    assert demo.main_demo([*SMALL, "--settle-timeout", "1"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] subscriber view == tiers' true contents: missing 1, extra 0" in out


def test_demo_rejects_bad_options() -> None:
    with pytest.raises(UsageError, match="--sessions must be >= 1"):
        demo.main_demo(["--sessions", "0"])
    with pytest.raises(UsageError, match="unknown tier"):
        demo.main_demo(["--tiers", "tape", "--no-progress"])
    with pytest.raises(UsageError, match="--gpu-blocks 8 is too small.* needs 23 blocks"):
        demo.main_demo(["--gpu-blocks", "8", "--no-progress"])


def test_demo_pool_size_check_is_exact() -> None:
    """The smallest pool the check accepts runs the whole workload (the check is neither too
    strict nor too lax: one block less is refused up front)."""
    args = [*SMALL, "--gpu-blocks", "12"]
    with pytest.raises(UsageError, match=r"needs (\d+) blocks") as info:
        demo.main_demo(args)
    needed = int(re.search(r"needs (\d+) blocks", str(info.value)).group(1))
    with pytest.raises(UsageError):
        demo.main_demo([*SMALL, "--gpu-blocks", str(needed - 1)])
    assert demo.main_demo([*SMALL, "--gpu-blocks", str(needed), "--tiers", "none"]) == 0


def test_demo_with_the_disk_tier_alone_has_no_failed_transfer_job(capsys) -> None:
    """A save job whose blocks all go to disk has no host copies: it used to fail in the
    worker (range() step 0) and log a traceback on every such job."""
    assert demo.main_demo([*SMALL, "--tiers", "disk"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] clean run (no broken transfer, no error logged, no thread died): " \
        "transfer jobs broken 0," in out
    assert "ERROR" not in out and "failed" not in out


def test_demo_fails_its_check_when_a_transfer_job_fails(monkeypatch, capsys,
                                                         expect_errors) -> None:
    import kvbm_plugin.worker.transfer_thread as transfers

    def chunked_with_zero_step(items, batch):  # a batching step of 0 for an empty job
        step = batch or len(items)
        for start in range(0, len(items), step):
            yield items[start:start + step]

    monkeypatch.setattr(transfers, "chunked", chunked_with_zero_step)
    assert demo.main_demo([*SMALL, "--tiers", "disk"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "clean run" in x)
    assert line.startswith("  [FAIL]")
    assert re.search(r"transfer jobs broken [1-9]\d*", line)
    assert re.search(r"error-level log lines [1-9]\d*", line)
    assert "transfer job failed" in line
    assert expect_errors.wait_for("transfer job failed")


def test_demo_fails_its_check_when_a_thread_dies(monkeypatch, capsys, expect_errors) -> None:
    from kvbm_plugin.testing.engine import SimulatedEngine

    original = SimulatedEngine.step

    def step_and_crash_a_thread(self):
        if not getattr(self, "_crashed", False):
            self._crashed = True
            thread = threading.Thread(target=lambda: 1 / 0, name="doomed")
            thread.start()
            thread.join()
        return original(self)

    monkeypatch.setattr(SimulatedEngine, "step", step_and_crash_a_thread)
    assert demo.main_demo(SMALL) == 1
    out = capsys.readouterr().out
    assert "thread exceptions 1; first: thread doomed: ZeroDivisionError" in out
    assert [a.exc_type for a in expect_errors.thread_exceptions] == [ZeroDivisionError]


def test_progress_is_drawn_only_on_a_terminal(monkeypatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        progress = demo_report.Progress(10, enabled=True)
        progress.update(3, "turn 1/2", force=True)
        progress.close()
        assert ("\r[" in stream.getvalue()) is drawn


def test_demo_writes_no_progress_frames_into_a_log(capsys) -> None:
    assert demo.main_demo(SMALL[:-1]) == 0  # progress on, stderr captured (not a terminal)
    assert "\r" not in capsys.readouterr().err


def test_every_demo_option_has_help() -> None:
    missing = [a.option_strings for a in demo_options.build_parser()._actions if not a.help]
    assert missing == []


def test_demo_fails_when_tiers_serve_nothing(monkeypatch, capsys) -> None:
    from kvbm_plugin.connector_leader import KvbmConnectorLeader

    monkeypatch.setattr(KvbmConnectorLeader, "get_num_new_matched_tokens",
                        lambda self, request, num_computed_tokens: (0, False))
    assert demo.main_demo(SMALL) == 1
    assert "[FAIL] prefixes reused from tiers: host 0 + disk 0 tokens" in capsys.readouterr().out


def test_tier_reuse_check_is_not_applied_when_nothing_was_evicted(capsys) -> None:
    assert demo.main_demo(["--sessions", "2", "--turns", "1", "--no-progress"]) == 0
    assert "not exercised" in capsys.readouterr().out


def _subscriber_joins_late(monkeypatch, after_polls: int) -> None:
    """The demo's subscriber connects only at its ``after_polls``-th poll: what a PUB socket
    sends before a subscription reaches it is dropped, as under load when the I/O threads are
    slow to pass the subscription on."""
    from kvbm_plugin.wire.subscriber import StreamSubscriber

    init, poll = StreamSubscriber.__post_init__, StreamSubscriber.poll

    def connect_later(self) -> None:
        self._real_endpoint, self.endpoint = self.endpoint, "inproc://not-yet"
        self._polls = 0
        init(self)

    def poll_and_join(self, timeout_ms: int = 100):  # noqa: ANN202
        self._polls += 1
        if self._polls == after_polls:
            self._sub.connect(self._real_endpoint)
        return poll(self, timeout_ms)

    monkeypatch.setattr(StreamSubscriber, "__post_init__", connect_later)
    monkeypatch.setattr(StreamSubscriber, "poll", poll_and_join)


@pytest.mark.parametrize("mode", ["dedup", "passthrough"])
def test_demo_subscriber_that_joins_late_replays_what_it_missed(monkeypatch, capsys,
                                                                 mode) -> None:
    """Joining a live stream late is the subscriber's gap, filled by replay, not a failure:
    under CPU load the subscription can reach the publisher after its first batches."""
    _subscriber_joins_late(monkeypatch, after_polls=30)
    assert demo.main_demo([*SMALL, "--mode", mode]) == 0
    out = capsys.readouterr().out
    assert re.search(r"0 gaps, 0 batches lost \(joined late: [1-9]\d* batches replayed\)", out)


def test_demo_fails_on_a_gap_in_the_stream_even_when_replay_fills_it(monkeypatch,
                                                                     capsys) -> None:
    from kvbm_plugin.wire.subscriber import StreamSubscriber

    accept = StreamSubscriber._accept
    dropped: list[int] = []

    def drop_seq_5_once(self, batch, *rest):  # noqa: ANN001, ANN002, ANN202
        if batch.seq == 5 and not dropped:
            dropped.append(batch.seq)
            return []
        return accept(self, batch, *rest)

    monkeypatch.setattr(StreamSubscriber, "_accept", drop_seq_5_once)
    assert demo.main_demo(SMALL) == 1
    assert "[FAIL] no gaps, no losses: 1 gaps, 0 lost" in capsys.readouterr().out


def test_every_tp_gets_kv_heads_it_can_split_and_tp_3_runs(capsys) -> None:
    assert [demo.kv_heads(tp) for tp in (1, 2, 3, 4, 5, 8)] == [4, 4, 6, 4, 5, 8]
    assert demo.main_demo([*SMALL, "--tp", "3"]) == 0
    assert "TP=3" in capsys.readouterr().out


def test_a_run_of_first_turns_only_is_not_a_tier_reuse_failure(monkeypatch, capsys) -> None:
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "abc")
    monkeypatch.setenv("DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR", "false")
    assert demo.main_demo(["--requests", "10", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] prefixes reused from tiers: not exercised" in out
    assert ("ignores DYN_KVBM_CPU_CACHE_GB, DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR "
            "(use --tiers") in out


def test_the_demo_names_every_plugin_variable_it_ignores(tmp_path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    environ = {"DYN_KVBM_CPU_CACHE_GB": "abc", "DYN_KVBM_DISK_CACHE_DIR": str(a_file),
               "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR": "false", "DYN_KVBM_NATIVE": "1",
               "DYN_KVBM_KV_EVENTS_OUTPUT_ENDPOINT": "tcp://*:57001", "HOME": "/root"}
    assert demo.overridden_variables(environ) == [
        "DYN_KVBM_CPU_CACHE_GB", "DYN_KVBM_DISK_CACHE_DIR",
        "DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR"]


def test_rank_processes_pass_and_print_no_numpy_warning() -> None:
    """The CLI's demo with rank processes (each importing torch, which warns without NumPy
    unless the CLI's filter reaches the children)."""
    import subprocess

    result = subprocess.run([sys.executable, "-m", "kvbm_plugin.cli.main", "demo", *SMALL,
                             "--tp", "2", "--processes"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr, result.stderr
    assert "TP=2 (rank processes)" in result.stdout, result.stdout
    assert "all checks passed" in result.stdout, result.stdout


def test_demo_help_shows_every_default() -> None:
    parser = demo_options.build_parser()
    for action in parser._actions:
        if action.default not in (None, False) and action.dest != "help":
            assert "default" in (action.help or ""), action.option_strings



class _DemotionInFlight:
    """A stand-in engine (:attr:`engine`) and subscriber (:attr:`subscriber`) for the demo's
    settle: when ``drive`` returns, one host-to-disk demotion is still in flight on the
    leader. Its report lands at the subscriber's next poll (the moment the leader's idle
    keeper, at a 10 ms period, has applied and published it): the disk tier gains the block
    and the view its STORE together."""

    HELD = {1, 2, 3}
    DEMOTED = 4

    def __init__(self) -> None:
        from collections import defaultdict
        from types import SimpleNamespace

        from kvbm_plugin.testing.engine import EngineStats
        from kvbm_plugin.wire.subscriber import SubscriberStats

        self.in_flight = True
        self.published = 0
        counters: defaultdict[str, int] = defaultdict(int)
        leader = SimpleNamespace(
            flush_events=lambda: None,
            event_sink=SimpleNamespace(stats=lambda: counters),
            consolidator=SimpleNamespace(wait_idle=lambda timeout: True,
                                         stats=lambda: defaultdict(
                                             int, counters, batches_out=self.published)))
        self.engine = SimpleNamespace(idle=lambda: not self.in_flight, leader=leader,
                                      resident_blocks=self._resident, stats=EngineStats,
                                      unflushed_gpu_blocks=lambda: (set(), set()))
        self.subscriber = SimpleNamespace(poll=self._poll, next_seq=0, stats=SubscriberStats(),
                                          held={(0, h) for h in self.HELD})

    def _resident(self) -> dict[str, dict[int, set[int]]]:
        disk = set() if self.in_flight else {self.DEMOTED}
        return {"GPU": {0: set(self.HELD)}, "CPU": {0: set()}, "DISK": {0: disk}}

    def _poll(self, timeout_ms: int = 100) -> list:
        if self.in_flight:  # the demotion's report is applied and its STORE received
            self.in_flight = False
            self.published += 1
            self.subscriber.next_seq += 1
            self.subscriber.held.add((0, self.DEMOTED))
        return []


def test_the_settle_reads_the_tiers_once_the_engine_is_idle() -> None:
    # At a 10 ms keeper period the real-router run failed "subscriber view == tiers' true
    # contents" in about one run in two with 1-6 extra blocks: the truth was read while a
    # demotion was in flight, and its STORE reached the view during the settle.
    from argparse import Namespace

    run = _DemotionInFlight()
    args = Namespace(mode="dedup", settle_timeout=0.3, tp=1, processes=False, adapters=0,
                     no_overlap=False, tiers="host,disk")
    checks, summary = demo_checks.settle_and_check(run.engine, run.subscriber, args,
                                             Namespace(after_eviction=0))
    check = next(c for c in checks if c.name == "subscriber view == tiers' true contents")
    assert check.ok, check.detail
    assert dict(summary)["subscriber view"].startswith("4 blocks held; truth 4")


class _StuckDemotion(_DemotionInFlight):
    """The same run, but the demotion never reports."""

    def _poll(self, timeout_ms: int = 100) -> list:
        return []


def test_the_settle_fails_the_check_when_a_transfer_never_ends() -> None:
    # The tiers of a busy engine are no truth to compare with, even when the view matches them.
    from argparse import Namespace

    run = _StuckDemotion()
    args = Namespace(mode="dedup", settle_timeout=0.05, tp=1, processes=False, adapters=0,
                     no_overlap=False, tiers="host,disk")
    checks, _ = demo_checks.settle_and_check(run.engine, run.subscriber, args,
                                       Namespace(after_eviction=0))
    check = next(c for c in checks if c.name == "subscriber view == tiers' true contents")
    assert not check.ok
    assert check.detail == ("missing 0, extra 0 (transfers still in flight after "
                            "--settle-timeout 0.05 s)")
