"""CompactionService handlers: validate, check ownership through transcript, delegate, convert.

Handlers raise CompactionError; the runtime's interceptor maps it to a status. None sets codes.
"""

from __future__ import annotations

from typing import TypeAlias

import grpc

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum_compaction import store, validation
from continuum_compaction.context import ContextBuilder
from continuum_compaction.convert import event_message, summary_message
from continuum_compaction.errors import BadRequest
from continuum_compaction.manual import ManualCompaction
from continuum_compaction.transcript_client import TranscriptClient
from continuum_runtime.auth import acting_user
from continuum_runtime.database import Database
from continuum_runtime.paging import PageTokenError, decode_page_token, encode_page_token

Context: TypeAlias = grpc.aio.ServicerContext


class CompactionServicer(api_grpc.CompactionServiceServicer):
    """The gRPC face of compaction."""

    def __init__(
        self, database: Database, transcript: TranscriptClient, builder: ContextBuilder, manual: ManualCompaction
    ) -> None:
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
        parameters = {"rpc": "ListCompactionEvents", "session_id": session_id}
        before: int | None = None
        if request.page_token:
            try:
                cursor = decode_page_token(request.page_token, parameters)
            except PageTokenError as error:
                raise BadRequest("page_token", "is not a token issued for this session's events") from error
            # Tokens are opaque, not signed: a forged cursor must still be a plausible event id.
            if not isinstance(cursor, int) or isinstance(cursor, bool) or not 0 < cursor < 2**63:
                raise BadRequest("page_token", "is not a token issued for this session's events")
            before = cursor
        await self._transcript.get_session(user, session_id)
        async with self._db.connection() as connection:
            rows = await store.list_events(connection, session_id, before, size + 1)
        token = ""
        if len(rows) > size:
            rows = rows[:size]
            token = encode_page_token(rows[-1]["event_id"], parameters)
        return api.ListCompactionEventsResponse(
            events=[event_message(row, include_summary=request.include_summary_text) for row in rows],
            next_page_token=token,
        )
