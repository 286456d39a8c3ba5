"""CompactionService handlers: validate, check ownership through transcript, delegate, convert.

Handlers raise CompactionError; the runtime's interceptor maps it to a status. None sets codes.
"""

from __future__ import annotations

from typing import TypeAlias

import grpc
from pydantic import Field

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum_compaction import store, validation
from continuum_compaction.context import ContextBuilder
from continuum_compaction.convert import event_message, summary_message
from continuum_compaction.errors import PageTokenInvalid
from continuum_compaction.manual import ManualCompaction
from continuum_compaction.transcript_client import TranscriptClient
from continuum_runtime.auth import acting_user
from continuum_runtime.database import Database
from continuum_runtime.paging import Cursor, PageTokens

Context: TypeAlias = grpc.aio.ServicerContext
# A page of events stops growing past this many serialized bytes (summary texts can be long).
EVENTS_PAGE_BYTES = 4 * 1024 * 1024


class EventsCursor(Cursor):
    """Where the next page of a session's compaction events (newest first) continues."""

    before_event_id: int = Field(gt=0, lt=2**63)


class CompactionServicer(api_grpc.CompactionServiceServicer):
    """The gRPC face of compaction."""

    def __init__(
        self,
        database: Database,
        transcript: TranscriptClient,
        builder: ContextBuilder,
        manual: ManualCompaction,
        page_token_secret: bytes,
    ) -> None:
        self._events_pages = PageTokens(page_token_secret, EventsCursor, PageTokenInvalid)
        self._db = database
        self._transcript = transcript
        self._builder = builder
        self._manual = manual

    async def BuildContext(self, request: api.BuildContextRequest, context: Context) -> api.BuildContextResponse:
        return await self._builder.build(acting_user(context), request)

    async def CompactNow(self, request: api.CompactNowRequest, context: Context) -> api.CompactNowResponse:
        return await self._manual.compact_now(acting_user(context), request)

    async def GetCompactionSummary(
        self, request: api.GetCompactionSummaryRequest, context: Context
    ) -> api.GetCompactionSummaryResponse:
        user = acting_user(context)
        session_id = validation.session_id(request.session_id)
        await self._transcript.get_session(user, session_id)
        async with self._db.connection() as connection:
            record = await store.load_record(connection, session_id)
        if record is None:
            return api.GetCompactionSummaryResponse()
        return api.GetCompactionSummaryResponse(summary=summary_message(record))

    async def ListCompactionEvents(
        self, request: api.ListCompactionEventsRequest, context: Context
    ) -> api.ListCompactionEventsResponse:
        user = acting_user(context)
        session_id = validation.session_id(request.session_id)
        size = validation.events_page_size(request.page_size)
        parameters = {
            "rpc": "ListCompactionEvents",
            "user": user,
            "session_id": session_id,
            "include_summary_text": request.include_summary_text,
        }
        cursor = self._events_pages.open(request.page_token, parameters)
        await self._transcript.get_session(user, session_id)
        async with self._db.connection() as connection:
            before = cursor.before_event_id if cursor is not None else None
            rows = await store.list_events(connection, session_id, before, size + 1)
        events = [event_message(row, include_summary=request.include_summary_text) for row in rows[:size]]
        more = len(rows) > size
        # Stop early past the byte budget, but always return at least one event.
        total = 0
        for kept, event in enumerate(events, start=1):
            total += event.ByteSize()
            if total >= EVENTS_PAGE_BYTES and kept < len(events):
                events, more = events[:kept], True
                break
        token = ""
        if more and events:
            token = self._events_pages.issue(EventsCursor(before_event_id=events[-1].event_id), parameters)
        return api.ListCompactionEventsResponse(events=events, next_page_token=token)
