"""Fixtures for the interop tests: NVIDIA Dynamo's real KV indexer, always stopped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbm_plugin.routers.dynamo_indexer import Indexer, unavailable


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    idx = Indexer(tmp_path, threads=1)
    try:
        yield idx
    finally:
        idx.close()
