"""Wiring: database, migrations, transcript client, provider, worker, session-events consumer and the gRPC
server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from pathlib import Path

from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum_merge import SERVICE_NAME
from continuum_merge.cleanup import CancelledSweeper, SessionEventsConsumer
from continuum_merge.operations import Operations, WorkerSignals
from continuum_merge.pipeline import Pipeline
from continuum_merge.servicer import MergeServicer
from continuum_merge.settings import MergeSettings
from continuum_merge.stages import MergeStages
from continuum_merge.transcript_client import TranscriptClient
from continuum_merge.worker import Failpoint, Worker, crash_at
from continuum_runtime import migrations
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.database import Database
from continuum_runtime.guard import GuardedServer
from continuum_runtime.provider import ModelProvider, open_provider
from continuum_runtime.server import Cleanup, GrpcService, start_server
from continuum_runtime.telemetry import tracer_provider

logger = logging.getLogger("continuum.merge")
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


def service_failpoint(settings: MergeSettings) -> Failpoint:
    """The failpoint of a service process: a kill at `crash_at`, a wait that never ends at `hold_at` (so
    a recovery test can kill the process while it holds a lease there); nothing when both are empty."""
    kill = crash_at(settings.crash_at)

    async def failpoint(name: str) -> None:
        await kill(name)
        if settings.hold_at and name == settings.hold_at:
            logger.warning("holding at a failpoint", extra={"failpoint": name})
            await asyncio.Event().wait()

    return failpoint


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
    `clock` replaces the system clock; the worker runs the stages through `pipeline` (by default the real
    ones, `MergeStages`, with the provider; with `worker_enabled` off this replica only answers the API);
    `failpoint` replaces `service_failpoint` (tests hold a run at a named point).
    """
    clock = clock or SystemClock()
    database = open_database(settings)
    if settings.migrate_on_start:
        await migrations.upgrade(database, MIGRATIONS_DIR)
    transcript = open_transcript(settings)
    # The extraction's call policy makes the attempts (issue 10: 3 per unit and model, 2 s and 5 s apart):
    # the HTTP client itself tries once per call.
    provider = provider or open_provider(settings.provider.model_copy(update={"max_retries": 0}))
    signals: WorkerSignals = ApiOnly()
    drains: list[Cleanup] = []
    if settings.worker_enabled:
        stages = pipeline or MergeStages(
            transcript,
            provider,
            timeout_seconds=settings.transcript_timeout_seconds,
            disk_reserve_bytes=settings.disk_reserve_bytes,
            extraction=settings.extraction,
            clock=clock,
        )
        worker = Worker(
            settings,
            database,
            transcript,
            stages,
            clock,
            worker_name(settings),
            failpoint or service_failpoint(settings),
        )
        signals = worker
        drains.append(worker.stop)
    tasks: list[asyncio.Task[None]] = []
    if settings.consume_session_events:
        consumer = SessionEventsConsumer(
            database, transcript, settings.resolved_package_root(), settings.events_retry_seconds, clock
        )
        tasks.append(asyncio.create_task(consumer.run()))
    if settings.worker_enabled:
        sweeper = CancelledSweeper(
            database, transcript, settings.resolved_package_root(), settings.cancel_sweep_seconds, clock
        )
        tasks.append(asyncio.create_task(sweeper.run()))

    async def stop_tasks() -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    operations = Operations(settings, database, transcript, settings.default_model or provider.model, signals, clock)
    servicer = MergeServicer(operations)

    def register(server: GuardedServer) -> list[str]:
        api_grpc.add_MergeServiceServicer_to_server(servicer, server)
        return [FULL_SERVICE_NAME]

    service = await start_server(
        SERVICE_NAME,
        settings,
        register=register,
        tracer_provider=tracer_provider(SERVICE_NAME, settings.trace_exporter),
        cleanups=[database.dispose, provider.aclose, transcript.close, stop_tasks],
        drains=drains,
    )
    if isinstance(signals, Worker):
        signals.start()
    return service
