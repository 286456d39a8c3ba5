"""Gateway fixtures: real transcript, compaction and merge servers on port 0 and in-process gateway clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from gateway_testing import SERVICE_TOKEN, gateway_settings, serving, unused_address
from gateway_ws_testing import Transcript
from pydantic import SecretStr

from continuum_compaction.server import start as start_compaction
from continuum_compaction.settings import CompactionSettings
from continuum_gateway.app import create_app
from continuum_merge.server import start as start_merge
from continuum_merge.settings import MergeSettings
from continuum_runtime.server import GrpcService
from continuum_transcript.server import start
from continuum_transcript.settings import TranscriptSettings


@asynccontextmanager
async def _running(starting: Awaitable[GrpcService]) -> AsyncIterator[GrpcService]:
    """The service `starting` starts, stopped at once when the block ends."""
    service = await starting
    try:
        yield service
    finally:
        await service.stop(grace=0)


@pytest.fixture(scope="module")
async def transcript(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GrpcService]:
    """A real transcript service on embedded SQLite, shared by a module's tests (they use distinct ids)."""
    settings = TranscriptSettings(
        data_dir=tmp_path_factory.mktemp("transcript"),
        port=0,
        service_token=SecretStr(SERVICE_TOKEN),
        database_url="",
    )
    async with _running(start(settings)) as service:
        yield service


@pytest.fixture(scope="module")
async def transcript_client(transcript: GrpcService) -> AsyncIterator[Transcript]:
    """Direct calls to `transcript` (sessions, publishing, a reference Follow stream)."""
    client = Transcript(transcript.port)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture(scope="module")
async def compaction(transcript: GrpcService, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GrpcService]:
    """A real compaction service on its own embedded SQLite file, in front of `transcript`.

    Default thresholds and the built-in offline provider (no `provider` given); it does not watch
    transcript's session events, which the gateway tests do not need.
    """
    settings = CompactionSettings(
        data_dir=tmp_path_factory.mktemp("compaction"),
        database_url="",
        port=0,
        service_token=SecretStr(SERVICE_TOKEN),
        transcript_address=f"127.0.0.1:{transcript.port}",
        consume_session_events=False,
    )
    async with _running(start_compaction(settings)) as service:
        yield service


@pytest.fixture(scope="module")
async def merge(transcript: GrpcService, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GrpcService]:
    """A real merge service on its own embedded SQLite file, in front of `transcript`.

    It answers the API only (no worker runs a started merge's stages), so an operation stays where
    the API put it: what the route tests need, and deterministic. It does not watch transcript's
    session events.
    """
    settings = MergeSettings(
        data_dir=tmp_path_factory.mktemp("merge"),
        database_url="",
        port=0,
        service_token=SecretStr(SERVICE_TOKEN),
        transcript_address=f"127.0.0.1:{transcript.port}",
        consume_session_events=False,
        worker_enabled=False,
    )
    async with _running(start_merge(settings)) as service:
        yield service


@pytest.fixture(scope="module")
async def merge_gateway(
    transcript: GrpcService, compaction: GrpcService, merge: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway client whose upstreams are the real transcript, compaction and merge services."""
    settings = gateway_settings(
        tmp_path_factory.mktemp("merge-gateway"),
        f"127.0.0.1:{transcript.port}",
        compaction_address=f"127.0.0.1:{compaction.port}",
        merge_address=f"127.0.0.1:{merge.port}",
    )
    async with serving(create_app(settings)) as client:
        yield client


@pytest.fixture(scope="module")
async def gateway(
    transcript: GrpcService, compaction: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway client whose upstreams are the real transcript and compaction services."""
    settings = gateway_settings(
        tmp_path_factory.mktemp("gateway"),
        f"127.0.0.1:{transcript.port}",
        compaction_address=f"127.0.0.1:{compaction.port}",
    )
    async with serving(create_app(settings)) as client:
        yield client


@pytest.fixture
async def offline_gateway(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway client whose transcript address has nothing listening."""
    async with serving(create_app(gateway_settings(tmp_path, unused_address()))) as client:
        yield client
