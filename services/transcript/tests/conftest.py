"""A real transcript server on port 0 over each database backend, and a client for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from transcript_testing import TranscriptClient, transcript_settings

from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.channels import open_channel
from continuum_transcript.server import start


@pytest.fixture
async def transcript(tmp_path: Path, database_url: str) -> AsyncIterator[TranscriptClient]:
    """A started transcript service and a connected client; stopped after the test."""
    settings = transcript_settings(tmp_path, database_url)
    service = await start(settings)
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        yield TranscriptClient(api_grpc.TranscriptServiceStub(channel), channel, service, settings)
    finally:
        await channel.close()
        await service.stop(grace=0)
