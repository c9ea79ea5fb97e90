"""``kvbm-plugin demo``'s signal handling (cli/demo_signals.py) where a signal lands inside a
finalizer: Python swallows the handler's exception there and prints it with its traceback
("Exception ignored in ..."). Run in a child interpreter: pytest replaces the hook that prints
such reports."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import gc, signal, sys, weakref
    from kvbm_plugin.cli import demo_signals

    class Held:
        pass

    def fail():
        raise ValueError("a finalizer's own bug")

    try:
        with demo_signals.signals_end_the_demo():
            held = Held()
            weakref.finalize(held, {callback})
            del held
            gc.collect()
            print("signum", demo_signals.SIGNALS.signum, flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""")


def _run(callback: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(callback=callback)],
                          capture_output=True, text=True, timeout=60)


def test_a_signal_inside_a_finalizer_prints_no_traceback_and_still_ends_the_run() -> None:
    # the handler runs inside the finalizer, as a signal delivered during a collection
    run = _run("demo_signals.SIGNALS.handler, signal.SIGINT, None")
    assert run.stdout.split() == ["signum", str(int(signal.SIGINT)), "interrupted"], run
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr


def test_other_unraisable_exceptions_are_still_reported() -> None:
    run = _run("fail")
    assert run.stdout.split() == ["signum", "None"], run
    assert "a finalizer's own bug" in run.stderr, run.stderr


FAILS_AFTER = textwrap.dedent("""
    import gc, signal, weakref
    from kvbm_plugin.cli import demo_signals

    class Held:
        pass

    try:
        with demo_signals.signals_end_the_demo():
            held = Held()
            weakref.finalize(held, demo_signals.SIGNALS.handler, signal.SIGTERM, None)
            del held
            gc.collect()
            # what a rank process killed by the same group signal makes the demo raise
            raise RuntimeError("dp rank 1 process exited without answering")
    except SystemExit as exc:
        print("exit", exc.code, flush=True)
""")


def test_a_failure_after_a_swallowed_signal_ends_with_the_signal_not_a_traceback() -> None:
    # CI once saw SIGTERM to the attention-DP demo's group kill rank 1 while the demo waited
    # for its bring-up: the demo's own handler ran inside a finalizer (its SystemExit
    # swallowed) and the rank's silence came out as a RuntimeError traceback.
    run = subprocess.run([sys.executable, "-c", FAILS_AFTER], capture_output=True, text=True,
                         timeout=60)
    assert run.stdout.split() == ["exit", str(128 + int(signal.SIGTERM))], run
    assert "Traceback" not in run.stderr, run.stderr
