"""Wiring: database, migrations, transcript client, provider, consumer and the gRPC server."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum_compaction import SERVICE_NAME
from continuum_compaction.claim_holder import ClaimHolder
from continuum_compaction.cleanup import SessionEventsConsumer
from continuum_compaction.compactor import Compactor
from continuum_compaction.context import ContextBuilder
from continuum_compaction.handoff import HandoffContext
from continuum_compaction.manual import ManualCompaction
from continuum_compaction.servicer import CompactionServicer
from continuum_compaction.settings import CompactionSettings
from continuum_compaction.transcript_client import TranscriptClient
from continuum_runtime import migrations
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.database import Database
from continuum_runtime.guard import GuardedServer
from continuum_runtime.paging import token_secret
from continuum_runtime.provider import ModelProvider, open_provider
from continuum_runtime.server import GrpcService, start_server
from continuum_runtime.telemetry import tracer_provider

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
FULL_SERVICE_NAME = "continuum.compaction.v1.CompactionService"


def open_database(settings: CompactionSettings) -> Database:
    """The process's one engine for this service."""
    # The embedded default keeps users' data here: readable by this user only.
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Database(settings.resolved_database_url(SERVICE_NAME), schema=SERVICE_NAME, pool_size=settings.db_pool_size)


def open_transcript(settings: CompactionSettings) -> TranscriptClient:
    """The process's one channel to transcript."""
    return TranscriptClient(
        settings.transcript_address,
        settings.service_token.get_secret_value(),
        settings.transcript_timeout_seconds,
        settings.grpc_max_message_bytes,
    )


async def migrate(settings: CompactionSettings) -> None:
    """Bring compaction's schema to head (what `continuum migrate compaction` runs)."""
    database = open_database(settings)
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    finally:
        await database.dispose()


async def start(
    settings: CompactionSettings, provider: ModelProvider | None = None, clock: Clock | None = None
) -> GrpcService:
    """Start the compaction service; migrate first when `migrate_on_start` is set.

    `provider` replaces the configured one (tests pass an in-memory provider with the same contract);
    `clock` replaces the system clock (tests move time by hand).
    """
    clock = clock or SystemClock()
    database = open_database(settings)
    if settings.migrate_on_start:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    transcript = open_transcript(settings)
    provider = provider or open_provider(settings.provider)
    compactor = Compactor(settings, database, transcript, provider, clock)
    # Opened lazily by grpc: a process whose sessions are all ordinary never connects to handoff-read.
    handoff = HandoffContext(
        settings.handoff_read_address,
        settings.service_token.get_secret_value(),
        settings.handoff_read_timeout_seconds,
        settings.grpc_max_message_bytes,
    )
    holder = ClaimHolder(settings, transcript)
    servicer = CompactionServicer(
        database,
        transcript,
        ContextBuilder(settings, database, transcript, compactor, handoff, clock),
        ManualCompaction(settings, database, transcript, compactor, holder, clock),
        token_secret(settings.page_token_secret.get_secret_value(), "compaction"),
    )
    tasks: list[asyncio.Task[None]] = []
    if settings.consume_session_events:
        consumer = SessionEventsConsumer(database, transcript, settings.events_retry_seconds, clock)
        tasks.append(asyncio.create_task(consumer.run()))

    async def stop_tasks() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def register(server: GuardedServer) -> list[str]:
        api_grpc.add_CompactionServiceServicer_to_server(servicer, server)
        return [FULL_SERVICE_NAME]

    service = await start_server(
        SERVICE_NAME,
        settings,
        register=register,
        tracer_provider=tracer_provider(SERVICE_NAME, settings.trace_exporter),
        cleanups=[database.dispose, provider.aclose, handoff.close, transcript.close, stop_tasks],
    )
    # Only now that this process holds its port can no live replica share its claims' holder name.
    tasks.append(asyncio.create_task(holder.release_previous()))
    return service
