"""Compaction tests run a real transcript and a real compaction server on each database backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from compaction_testing import Stack, running_stack


@pytest.fixture
async def stack(tmp_path: Path, database_url: str) -> AsyncIterator[Stack]:
    """Both services with default test thresholds and a scripted provider."""
    async with running_stack(tmp_path, database_url) as started:
        yield started
