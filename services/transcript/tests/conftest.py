"""A real transcript server on port 0 over each database backend, and a client for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from pydantic import SecretStr

from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.server import GrpcService
from continuum_transcript.server import start
from continuum_transcript.settings import TranscriptSettings

SERVICE_TOKEN = "test-service-token"


@dataclass
class TranscriptClient:
    """A stub plus the metadata each acting user presents."""

    stub: api_grpc.TranscriptServiceStub
    channel: grpc.aio.Channel
    service: GrpcService
    settings: TranscriptSettings

    def as_user(self, user: str) -> tuple[tuple[str, str], ...]:
        """Call metadata acting for `user`."""
        return call_metadata(SERVICE_TOKEN, user)

    @property
    def system(self) -> tuple[tuple[str, str], ...]:
        """Call metadata of a backend acting for no user."""
        return call_metadata(SERVICE_TOKEN)


def transcript_settings(tmp_path: Path, database_url: str, **overrides: object) -> TranscriptSettings:
    """Settings of a test server: port 0, a temporary data dir, the given database."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "database_url": database_url,
        "port": 0,
        "service_token": SecretStr(SERVICE_TOKEN),
        "events_poll_seconds": 0.2,
    }
    values.update(overrides)
    return TranscriptSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
async def transcript(tmp_path: Path, database_url: str) -> AsyncIterator[TranscriptClient]:
    """A started transcript service and a connected client; stopped after the test."""
    settings = transcript_settings(tmp_path, database_url)
    service = await start(settings)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.port}")
    try:
        yield TranscriptClient(api_grpc.TranscriptServiceStub(channel), channel, service, settings)
    finally:
        await channel.close()
        await service.stop(grace=0)
