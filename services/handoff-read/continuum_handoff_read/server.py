"""Wiring: the transcript and merge clients, the binder, the reference builder and the gRPC server.
Handoff-read owns no tables, so there is no database and nothing to migrate."""

from __future__ import annotations

import asyncio

from continuum.handoff_read.v1 import handoff_read_service_pb2_grpc as api_grpc
from continuum_handoff_read import SERVICE_NAME
from continuum_handoff_read.binding import Binder
from continuum_handoff_read.merge_client import MergeClient
from continuum_handoff_read.reference import ReferenceBuilder
from continuum_handoff_read.scanners import Scanners
from continuum_handoff_read.servicer import HandoffReadServicer
from continuum_handoff_read.settings import HandoffReadSettings
from continuum_handoff_read.transcript_client import TranscriptClient
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.guard import GuardedServer
from continuum_runtime.paging import token_secret
from continuum_runtime.server import GrpcService, start_server
from continuum_runtime.telemetry import tracer_provider

FULL_SERVICE_NAME = "continuum.handoff_read.v1.HandoffReadService"


def cursor_key(settings: HandoffReadSettings) -> bytes:
    """The key cursors are authenticated with: the configured file's contents, else the page-token
    secret, else a key of this process only (a warning says so)."""
    configured = settings.page_token_secret.get_secret_value()
    if settings.cursor_secret_file is not None:
        configured = settings.cursor_secret_file.read_text(encoding="utf-8").strip()
        if not configured:
            raise ValueError("HANDOFF_READ_CURSOR_SECRET_FILE is empty")
    return token_secret(configured, "handoff_read")


async def start(settings: HandoffReadSettings, clock: Clock | None = None) -> GrpcService:
    """Start the handoff-read service (on `clock` when given: tests move time instead of waiting)."""
    token = settings.service_token.get_secret_value()
    transcript = TranscriptClient(
        settings.transcript_address, token, settings.call_timeout_seconds, settings.grpc_max_message_bytes
    )
    merge = MergeClient(settings.merge_address, token, settings.call_timeout_seconds, settings.grpc_max_message_bytes)
    count = settings.resolved_search_scanners()
    scanners = Scanners(count) if count else None
    binder = Binder(transcript, merge, settings.resolved_package_root(), settings.ready_max_bytes)
    servicer = HandoffReadServicer(
        binder,
        ReferenceBuilder(settings.reference_file_max_bytes),
        cursor_key(settings),
        settings.call_deadline_seconds,
        clock or SystemClock(),
        scanners,
    )

    async def stop_scanners() -> None:
        if scanners is not None:
            await asyncio.to_thread(scanners.close)

    def register(server: GuardedServer) -> list[str]:
        api_grpc.add_HandoffReadServiceServicer_to_server(servicer, server)
        return [FULL_SERVICE_NAME]

    return await start_server(
        SERVICE_NAME,
        settings,
        register=register,
        tracer_provider=tracer_provider(SERVICE_NAME, settings.trace_exporter),
        cleanups=[transcript.close, merge.close, stop_scanners],
    )
