"""Wiring: database, migrations, transcript client, provider, worker and the gRPC server."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import grpc

from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum_merge import SERVICE_NAME
from continuum_merge.operations import Operations, WorkerSignals
from continuum_merge.pipeline import Pipeline
from continuum_merge.servicer import MergeServicer
from continuum_merge.settings import MergeSettings
from continuum_merge.transcript_client import TranscriptClient
from continuum_merge.worker import Failpoint, Worker, crash_at
from continuum_runtime import migrations
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.database import Database
from continuum_runtime.provider import ModelProvider, open_provider
from continuum_runtime.server import Cleanup, GrpcService, start_server
from continuum_runtime.telemetry import tracer_provider

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"
FULL_SERVICE_NAME = "continuum.merge.v1.MergeService"


class ApiOnly:
    """The worker signals of a replica that runs no worker: another replica's poll finds the work."""

    def wake(self) -> None:
        """Nothing runs here to wake."""

    def superseded(self, operation_id: str) -> None:
        """Nothing runs here to stop."""


def open_database(settings: MergeSettings) -> Database:
    """The process's one engine for this service."""
    # The embedded default keeps users' data here: readable by this user only.
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Database(settings.resolved_database_url(SERVICE_NAME), schema=SERVICE_NAME, pool_size=settings.db_pool_size)


def open_transcript(settings: MergeSettings) -> TranscriptClient:
    """The process's one channel to transcript."""
    return TranscriptClient(
        settings.transcript_address,
        settings.service_token.get_secret_value(),
        settings.transcript_timeout_seconds,
        settings.grpc_max_message_bytes,
    )


async def migrate(settings: MergeSettings) -> None:
    """Bring merge's schema to head (what `continuum migrate merge` runs)."""
    database = open_database(settings)
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    finally:
        await database.dispose()


def worker_name(settings: MergeSettings) -> str:
    """The name this replica's leases carry: the configured instance id (stable across restarts, so a
    restart takes its own operations back at once), else one unique to this start (a crashed start's
    leases then lapse within `lease_ttl_seconds`)."""
    return settings.instance_id or f"{socket.gethostname()}@{uuid.uuid4().hex}"


async def start(
    settings: MergeSettings,
    provider: ModelProvider | None = None,
    clock: Clock | None = None,
    pipeline: Pipeline | None = None,
    failpoint: Failpoint | None = None,
) -> GrpcService:
    """Start the merge service; migrate first when `migrate_on_start` is set.

    `provider` replaces the configured one (tests pass an in-memory provider with the same contract);
    `clock` replaces the system clock; the worker runs the stages through `pipeline` (without one, or
    with `worker_enabled` off, this replica only answers the API); `failpoint` replaces the kill at
    `crash_at` (tests hold a run at a named point).
    """
    clock = clock or SystemClock()
    database = open_database(settings)
    if settings.migrate_on_start:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    transcript = open_transcript(settings)
    provider = provider or open_provider(settings.provider)
    signals: WorkerSignals = ApiOnly()
    drains: list[Cleanup] = []
    if settings.worker_enabled and pipeline is not None:
        worker = Worker(
            settings,
            database,
            transcript,
            pipeline,
            clock,
            worker_name(settings),
            failpoint or crash_at(settings.crash_at),
        )
        signals = worker
        drains.append(worker.stop)
    operations = Operations(settings, database, transcript, settings.default_model or provider.model, signals, clock)
    servicer = MergeServicer(operations)

    def register(server: grpc.aio.Server) -> list[str]:
        api_grpc.add_MergeServiceServicer_to_server(servicer, server)
        return [FULL_SERVICE_NAME]

    service = await start_server(
        SERVICE_NAME,
        settings,
        register=register,
        tracer_provider=tracer_provider(SERVICE_NAME, settings.trace_exporter),
        cleanups=[transcript.close, provider.aclose, database.dispose],
        drains=drains,
    )
    if isinstance(signals, Worker):
        signals.start()
    return service
