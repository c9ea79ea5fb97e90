"""The suite's guard: a test fails when a kvbm_plugin logger emitted an ERROR or an exception
escaped a thread, unless the test said it expects that."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def test_unexpected_errors_fail_the_test_and_expected_ones_do_not(pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    expect_errors: provoked on purpose\n")
    pytester.makepyfile(test_guarded="""
        import logging
        import threading

        import pytest

        def test_logs_an_error():
            logging.getLogger("kvbm_plugin.somewhere").error("disk on fire")

        def test_thread_dies():
            def boom():
                raise RuntimeError("thread bug")
            t = threading.Thread(target=boom)
            t.start()
            t.join()

        def test_other_loggers_and_warnings_are_fine():
            logging.getLogger("elsewhere").error("not ours")
            logging.getLogger("kvbm_plugin.x").warning("only a warning")

        def test_expected_and_asserted(expect_errors):
            logging.getLogger("kvbm_plugin.x").error("disk on fire")
            assert expect_errors.wait_for("disk on fire")

        @pytest.mark.expect_errors
        def test_expected_by_marker():
            logging.getLogger("kvbm_plugin.x").error("malformed on purpose")
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_logs_an_error*",
                                 "*kvbm_plugin.somewhere ERROR: disk on fire*"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_thread_dies*",
                                 "*RuntimeError: thread bug*"])
