"""``kvbm-plugin demo --engines 2``: two engines on one private mooncake_master."""

from __future__ import annotations

import os
import re

import pytest

from kvbm_plugin.tools import demo

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
    from kvbm_plugin.tools.cli import UsageError

    with pytest.raises(UsageError, match="--engines 2 runs turn waves"):
        demo.main_demo(["--engines", "2", "--requests", "5", "--no-progress"])
