"""Merge tests run a real transcript and a real merge server on each database backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from merge_testing import MergeStack, running_merge


@pytest.fixture
async def stack(tmp_path: Path, database_url: str) -> AsyncIterator[MergeStack]:
    """Both services; the worker is off, so operations stay where the API put them. The session-events
    consumer runs: these servers live for a call or two, so it is often stopped at its first step."""
    overrides = {"worker_enabled": False}
    async with running_merge(tmp_path, database_url, overrides=overrides) as started:
        yield started
