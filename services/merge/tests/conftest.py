"""Merge tests run a real transcript and a real merge server on each database backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from merge_testing import MergeStack, running_merge


@pytest.fixture
async def stack(tmp_path: Path, database_url: str) -> AsyncIterator[MergeStack]:
    """Both services; the worker is off, so operations stay where the API put them."""
    async with running_merge(tmp_path, database_url, overrides={"worker_enabled": False}) as started:
        yield started
