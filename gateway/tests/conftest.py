"""Gateway fixtures: a real transcript server on port 0 and in-process gateway clients."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from gateway_testing import SERVICE_TOKEN, gateway_settings, serving, unused_address
from pydantic import SecretStr

from continuum_gateway.app import create_app
from continuum_runtime.server import GrpcService
from continuum_transcript.server import start
from continuum_transcript.settings import TranscriptSettings


@pytest.fixture(scope="module")
async def transcript(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GrpcService]:
    """A real transcript service on embedded SQLite, shared by a module's tests (they use distinct ids)."""
    settings = TranscriptSettings(
        data_dir=tmp_path_factory.mktemp("transcript"),
        port=0,
        service_token=SecretStr(SERVICE_TOKEN),
        database_url="",
    )
    service = await start(settings)
    try:
        yield service
    finally:
        await service.stop(grace=0)


@pytest.fixture(scope="module")
async def gateway(
    transcript: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway client whose upstream is the real transcript service."""
    settings = gateway_settings(tmp_path_factory.mktemp("gateway"), f"127.0.0.1:{transcript.port}")
    async with serving(create_app(settings)) as client:
        yield client


@pytest.fixture
async def offline_gateway(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway client whose transcript address has nothing listening."""
    async with serving(create_app(gateway_settings(tmp_path, unused_address()))) as client:
        yield client
