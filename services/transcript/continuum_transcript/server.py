"""Wiring: database, migrations, servicer and the gRPC server of the transcript service."""

from __future__ import annotations

from pathlib import Path

from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime import migrations
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.database import Database
from continuum_runtime.guard import GuardedServer
from continuum_runtime.paging import token_secret
from continuum_runtime.server import GrpcService, start_server
from continuum_runtime.telemetry import tracer_provider
from continuum_transcript import SERVICE_NAME
from continuum_transcript.attachments import AttachmentStore
from continuum_transcript.events import EventBell
from continuum_transcript.registry import PublisherRegistry
from continuum_transcript.servicer import TranscriptServicer
from continuum_transcript.settings import TranscriptSettings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
FULL_SERVICE_NAME = "continuum.transcript.v1.TranscriptService"


def open_database(settings: TranscriptSettings) -> Database:
    """The process's one engine for this service."""
    # The embedded default keeps users' data here: readable by this user only.
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Database(settings.resolved_database_url(SERVICE_NAME), schema=SERVICE_NAME, pool_size=settings.db_pool_size)


async def migrate(settings: TranscriptSettings) -> None:
    """Bring transcript's schema to head (what `continuum migrate transcript` runs)."""
    database = open_database(settings)
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    finally:
        await database.dispose()


async def start(settings: TranscriptSettings, clock: Clock | None = None) -> GrpcService:
    """Start the transcript service; migrate first when `migrate_on_start` is set.

    `clock` replaces the system clock (tests move time by hand to expire leases).
    """
    clock = clock or SystemClock()
    database = open_database(settings)
    if settings.migrate_on_start:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    registry = PublisherRegistry(database, settings, clock)
    registry.start()
    servicer = TranscriptServicer(
        settings,
        database,
        AttachmentStore(settings.resolved_attachments_dir()),
        EventBell(),
        registry,
        token_secret(settings.page_token_secret.get_secret_value(), "transcript"),
        clock,
    )

    async def drain_publishers() -> None:
        await registry.shutdown(settings.shutdown_grace_seconds)

    def register(server: GuardedServer) -> list[str]:
        api_grpc.add_TranscriptServiceServicer_to_server(servicer, server)
        return [FULL_SERVICE_NAME]

    return await start_server(
        SERVICE_NAME,
        settings,
        register=register,
        tracer_provider=tracer_provider(SERVICE_NAME, settings.trace_exporter),
        cleanups=[database.dispose],
        drains=[drain_publishers],
        untraced_streams=["Follow", "WatchSessionEvents"],
        # Every unary call is a short database step on (possibly) SQLite's one connection.
        complete_cancelled_calls=True,
    )
