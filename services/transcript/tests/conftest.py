"""A real transcript server on port 0 over each database backend, and a client for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from transcript_testing import TranscriptClient, running_transcript


@pytest.fixture
async def transcript(tmp_path: Path, database_url: str) -> AsyncIterator[TranscriptClient]:
    """A started transcript service and a connected client; stopped after the test."""
    async with running_transcript(tmp_path, database_url) as client:
        yield client
