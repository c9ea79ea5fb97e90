"""Two depths of one property test: a quick one in the default run, the thorough one in the slow
set (``-m slow``; CI runs both: docs/development.md, "Tests").

A differential or model test proves the same thing at either depth; the thorough depth only
draws more examples. README's test command must finish within minutes on two cores, so it
runs the quick depth, and ``.ci/run`` runs the thorough one in its own step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings


def depths(quick: int, thorough: int) -> pytest.MarkDecorator:
    """Parametrizes a test's ``examples`` argument: ``quick`` examples (id ``quick``, the
    default run) and ``thorough`` examples (id ``thorough``, marked ``slow``)."""
    return pytest.mark.parametrize("examples", [
        pytest.param(quick, id="quick"),
        pytest.param(thorough, id="thorough", marks=pytest.mark.slow)])


def run_examples(examples: int, check: Callable[..., None], *strategies: Any,
                 **strategy_kw: Any) -> None:
    """Runs ``check`` under Hypothesis on ``examples`` examples drawn from ``strategies`` (no
    deadline: the machine may be loaded; a slow example is no failure)."""
    settings(max_examples=examples, deadline=None,
             suppress_health_check=[HealthCheck.too_slow])(
        given(*strategies, **strategy_kw)(check))()
