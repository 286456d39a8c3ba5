"""Removing what compaction holds for deleted sessions (seed 001 §7.12), without touching transcript.

`SessionEventsConsumer` follows transcript's session-events outbox from a durable cursor: a DELETED
event removes the record, signals and events of every session in the deleted subtree, then the cursor
advances (at-least-once: a replayed event removes nothing twice). `reconcile` replays every DELETED
event still in the outbox, for anything a consumer outage missed; the cleanup CLI runs it.
"""

from __future__ import annotations

import logging

import grpc
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_compaction import store
from continuum_compaction.errors import CompactionError
from continuum_compaction.transcript_client import TranscriptClient
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database

logger = logging.getLogger("continuum.compaction")

CONSUMER = "compaction.session-events"


async def forget_deleted(connection: AsyncConnection, event: tpb.SessionEvent) -> int:
    """Apply one event; returns rows removed."""
    if event.type != tpb.SESSION_EVENT_TYPE_DELETED:
        return 0
    removed = 0
    for session_id in event.deleted_session_ids or [event.session_id]:
        removed += await store.forget_session(connection, session_id)
    return removed


class SessionEventsConsumer:
    """Watches the outbox until stopped, resuming from its cursor after any break."""

    def __init__(self, database: Database, transcript: TranscriptClient, retry_seconds: float, clock: Clock) -> None:
        self._database = database
        self._transcript = transcript
        self._retry_seconds = retry_seconds
        self._clock = clock

    async def run(self) -> None:
        """Consume forever (cancel to stop)."""
        while True:
            try:
                await self._consume()
            except grpc.aio.AioRpcError as error:
                logger.warning("session events stream broke; resuming", extra={"code": error.code().name})
            except Exception as error:
                # A database hiccup must not end cleanup for the life of the process: resume from the
                # durable cursor (the class name only: an error's text may quote a row).
                logger.warning("session events consumer failed; resuming", extra={"error": type(error).__name__})
            await self._clock.sleep(self._retry_seconds)

    async def _consume(self) -> None:
        async with self._database.connection() as connection:
            cursor = await store.load_cursor(connection, CONSUMER)
        stream = self._transcript.stub.WatchSessionEvents(
            api.WatchSessionEventsRequest(after_event_id=cursor), metadata=self._transcript.metadata(None)
        )
        async for response in stream:
            event = response.event
            # The cleanup and the cursor move together: an event is applied exactly once per cursor.
            async with self._database.transaction() as connection:
                removed = await forget_deleted(connection, event)
                await store.save_cursor(connection, CONSUMER, event.event_id, self._clock.now_ms())
            if removed:
                logger.info("forgot deleted sessions", extra={"event_id": event.event_id, "rows": removed})


async def reconcile(database: Database, transcript: TranscriptClient) -> tuple[int, int]:
    """Replay every event in the outbox; returns (DELETED events seen, rows removed)."""
    deleted = removed = 0
    token = ""
    while True:
        request = api.ListSessionEventsRequest(after_event_id=0, page_size=1000, page_token=token)
        try:
            response = await transcript.stub.ListSessionEvents(request, metadata=transcript.metadata(None))
        except grpc.aio.AioRpcError as error:
            raise CompactionError(f"transcript refused to list session events ({error.code().name})") from error
        for event in response.events:
            if event.type == tpb.SESSION_EVENT_TYPE_DELETED:
                deleted += 1
                async with database.transaction() as connection:
                    removed += await forget_deleted(connection, event)
        token = response.next_page_token
        if not token:
            return deleted, removed
