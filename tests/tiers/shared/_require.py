"""Skip a shared-tier test whose store cannot run here, or fail it under
``KVBM_REQUIRE_SHARED=1`` (CI's run sets it: CI never passes by skipping the shared tier)."""

from __future__ import annotations

import os

import pytest

VARIABLE = "KVBM_REQUIRE_SHARED"


def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail with it when the variable is 1 (read at each call)."""
    if os.environ.get(VARIABLE) == "1":
        pytest.fail(f"{VARIABLE}=1 and {reason}", pytrace=False)
    pytest.skip(reason)
