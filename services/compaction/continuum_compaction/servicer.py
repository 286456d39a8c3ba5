"""CompactionService handlers: validate, check ownership through transcript, delegate, convert.

Handlers raise CompactionError; the runtime's interceptor maps it to a status. None sets codes.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import grpc
from google.protobuf import timestamp_pb2

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum.compaction.v1 import resources_pb2 as pb
from continuum_compaction import store, validation
from continuum_compaction.context import ContextBuilder
from continuum_compaction.errors import BadRequest
from continuum_compaction.manual import ManualCompaction
from continuum_compaction.transcript_client import TranscriptClient
from continuum_runtime.auth import acting_user
from continuum_runtime.database import Database
from continuum_runtime.paging import PageTokenError, decode_page_token, encode_page_token

Context: TypeAlias = grpc.aio.ServicerContext


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def _summary(record: store.CompactionRecord) -> pb.CompactionSummary:
    return pb.CompactionSummary(
        session_id=record.session_id,
        summary_text=record.summary_text,
        last_compacted_message_id=record.last_compacted_msg_id,
        compact_count=record.compact_count,
        model=record.compact_model,
        input_tokens=record.input_tokens,
        output_tokens=record.output_tokens,
        create_time=_timestamp(record.create_ms),
        update_time=_timestamp(record.update_ms),
    )


def _event(row: dict[str, Any], include_summary: bool) -> pb.CompactionEvent:
    return pb.CompactionEvent(
        event_id=row["event_id"],
        session_id=row["session_id"],
        trigger_mode=pb.TriggerMode.Value(f"TRIGGER_MODE_{row['trigger_mode'].upper()}"),
        outcome=pb.CompactionOutcome.Value(f"COMPACTION_OUTCOME_{row['outcome'].upper()}"),
        boundary_before=row["boundary_before"],
        boundary_after=row["boundary_after"],
        estimated_tokens_before=row["tokens_before"],
        estimated_tokens_after=row["tokens_after"],
        model=row["model"],
        duration_ms=row["duration_ms"],
        batches_succeeded=row["batches_succeeded"],
        batches_failed=row["batches_failed"],
        facts_found=row["facts_found"],
        facts_kept=row["facts_kept"],
        summary_text=(row["summary_text"] or "") if include_summary else "",
        run_id=row["run_id"],
        create_time=_timestamp(row["create_ms"]),
    )


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
        return api.GetCompactionSummaryResponse(summary=_summary(record))

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
                before = int(decode_page_token(request.page_token, parameters))
            except (PageTokenError, TypeError, ValueError) as error:
                raise BadRequest("page_token", "is not a token issued for this session's events") from error
        await self._transcript.get_session(user, session_id)
        async with self._db.connection() as connection:
            rows = await store.list_events(connection, session_id, before, size + 1)
        token = ""
        if len(rows) > size:
            rows = rows[:size]
            token = encode_page_token(rows[-1]["event_id"], parameters)
        return api.ListCompactionEventsResponse(
            events=[_event(row, request.include_summary_text) for row in rows], next_page_token=token
        )
