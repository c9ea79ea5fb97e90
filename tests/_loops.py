"""Run a test module against both implementations of a module's loops (compiled and Python)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvbm_plugin._util import compiled as _compiled
from kvbm_plugin.consolidator_config import NATIVE


def both_implementations(module: str) -> Callable[..., str]:
    """An autouse fixture for a test module: every test runs with ``module``'s compiled loops
    and with its Python ones (``DYN_KVBM_NATIVE``), skipping the compiled run where they were
    not built. Assign it at module level: ``loops = both_implementations("event_sink")``."""

    @pytest.fixture(autouse=True, params=["compiled", "python"])
    def implementation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
        if request.param == "compiled" and _compiled.loops(module, {}) is None:
            pytest.skip(f"the compiled loops of {module} were not built")
        monkeypatch.setenv(NATIVE, "1" if request.param == "compiled" else "0")
        return str(request.param)

    return implementation
