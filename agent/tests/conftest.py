"""Agent tests run a real transcript, compaction and agent on each database backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_testing import AgentStack, running_agent


@pytest.fixture
async def agent(tmp_path: Path, database_url: str) -> AsyncIterator[AgentStack]:
    """The three services with the offline model, writing without pauses."""
    async with running_agent(tmp_path, database_url) as started:
        yield started
