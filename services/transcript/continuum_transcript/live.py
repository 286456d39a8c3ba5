"""The live half of TranscriptService: Follow, publishing batches, sampling attempts, the outline."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.auth import acting_user
from continuum_runtime.cancellation import finish_before_stopping
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.wire_names import HISTORY_OUTLINE_V1
from continuum_transcript import bodies, follow, messages, persistence, sessions, turns, validation
from continuum_transcript.errors import BadRequest
from continuum_transcript.registry import PublisherRegistry
from continuum_transcript.settings import TranscriptSettings

Context: TypeAlias = grpc.aio.ServicerContext

MESSAGE_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_STRUCT_BYTES = 64 * 1024
RUN_STATES = frozenset(fpb.RunState.values()) - {fpb.RUN_STATE_UNSPECIFIED}
PROMPT_KINDS = frozenset(fpb.PromptKind.values()) - {fpb.PROMPT_KIND_UNSPECIFIED}


def attempt_ref(ref: fpb.AttemptRef, field: str = "attempt") -> fpb.AttemptRef:
    """A stable message key and a positive attempt number."""
    if not MESSAGE_KEY.match(ref.message_key):
        raise BadRequest(f"{field}.message_key", "must be 1-128 letters, digits or '_.:-'")
    if ref.attempt < 1:
        raise BadRequest(f"{field}.attempt", "must be at least 1")
    return ref


def _small_struct(size: int, field: str) -> None:
    if size > MAX_STRUCT_BYTES:
        raise BadRequest(field, f"must be at most {MAX_STRUCT_BYTES} bytes")


def runtime_state(state: fpb.RuntimeState, field: str) -> fpb.RuntimeState:
    """A known run state, a bounded run id and small details."""
    if state.state not in RUN_STATES:
        raise BadRequest(f"{field}.state", "must be IDLE, RUNNING or WAITING")
    validation.text(state.run_id, f"{field}.run_id", 256)
    # Persisted as JSON with every later batch: a small object whose numbers JSON can hold (a NaN
    # failed the conversion after the batch had taken its sequence).
    validation.metadata(state.details, f"{field}.details")
    return state


def prompt(value: fpb.PendingPrompt, field: str) -> fpb.PendingPrompt:
    """A pending approval or question with an id."""
    if not MESSAGE_KEY.match(value.prompt_id):
        raise BadRequest(f"{field}.prompt_id", "must be 1-128 letters, digits or '_.:-'")
    if value.kind not in PROMPT_KINDS:
        raise BadRequest(f"{field}.kind", "must be APPROVAL or QUESTION")
    # Persisted as JSON like the runtime state.
    validation.metadata(value.body, f"{field}.body")
    return value


async def attachment_media_types(
    database: Database, session_id: str, rows: list[validation.MessageRow]
) -> dict[str, str]:
    """Check the attachments new messages refer to (no query when there are none)."""
    # One pass over the parts of every message: a call per message cost the append path ~6 us a batch.
    referenced = sorted(set(validation.attachment_ids([part for row in rows for part in row["content"]])))
    if not referenced:
        return {}
    async with database.connection() as connection:
        return await messages.attachment_media_types(connection, session_id, referenced)


class LiveTranscript:
    """Mixed into TranscriptServicer, which provides the attributes below."""

    _settings: TranscriptSettings
    _db: Database
    _registry: PublisherRegistry
    _clock: Clock

    async def Follow(self, request: api.FollowRequest, context: Context) -> AsyncIterator[api.FollowResponse]:
        owner = acting_user(context)
        follow.require_protocol(list(request.capabilities))
        session_id = validation.session_id(request.session_id)
        # Here and in the snapshot's read, a follower leaving waits for the database step to end.
        publisher = await finish_before_stopping(self._registry.get(owner, session_id))
        async for frame in follow.stream(
            publisher, self._db, request, self._settings.follow_heartbeat_seconds, self._settings.limits()
        ):
            yield frame

    async def PublishBatch(self, request: api.PublishBatchRequest, context: Context) -> api.PublishBatchResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        if len(request.operations) > self._settings.max_batch_messages:
            raise BadRequest("operations", f"must be at most {self._settings.max_batch_messages}")
        if request.ByteSize() > self._settings.max_batch_bytes:
            raise BadRequest("operations", f"must total at most {self._settings.max_batch_bytes} bytes")
        rows: list[validation.MessageRow] = []
        extras = 0
        state: fpb.RuntimeState | None = None
        upserted: list[fpb.PendingPrompt] = []
        resolved: list[str] = []
        events: list[fpb.RuntimeEvent] = []
        for index, operation in enumerate(request.operations):
            field = f"operations[{index}]"
            kind = operation.WhichOneof("operation")
            if kind != "message":
                # State, prompts and events travel in every follower's frame: a batch keeps them small.
                extras += operation.ByteSize()
                if extras > self._settings.max_batch_extras_bytes:
                    raise BadRequest(
                        field,
                        f"operations other than messages must total at most {self._settings.max_batch_extras_bytes}"
                        " bytes per batch",
                    )
            if kind == "message":
                message = operation.message
                rows.append(validation.new_message(message, f"{field}.message", self._settings, message.ByteSize()))
            elif kind == "runtime_state":
                state = runtime_state(operation.runtime_state, f"{field}.runtime_state")
            elif kind == "prompt_upsert":
                upserted.append(prompt(operation.prompt_upsert, f"{field}.prompt_upsert"))
            elif kind == "prompt_resolved":
                if not MESSAGE_KEY.match(operation.prompt_resolved):
                    raise BadRequest(f"{field}.prompt_resolved", "must name a prompt id")
                resolved.append(operation.prompt_resolved)
            elif kind == "event":
                if operation.event.WhichOneof("event") is None:
                    raise BadRequest(f"{field}.event", "must set one runtime event")
                _small_struct(operation.event.ByteSize(), f"{field}.event")
                events.append(operation.event)
            else:
                raise BadRequest(field, "must set one operation")
        publisher = await self._registry.get(owner, session_id)
        known = await attachment_media_types(self._db, session_id, rows)
        seq, ids = await publisher.publish(
            rows,
            media_types=known,
            runtime_state=state,
            prompts_upserted=upserted,
            prompts_resolved=resolved,
            events=events,
            terminal=request.terminal,
        )
        if request.wait_durable or request.terminal:
            await publisher.wait_durable(seq)
        return api.PublishBatchResponse(stream_generation=publisher.stream_generation, seq=seq, message_ids=ids)

    async def OpenAttempt(self, request: api.OpenAttemptRequest, context: Context) -> api.OpenAttemptResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        ref = attempt_ref(request.attempt)
        publisher = await self._registry.get(owner, session_id)
        publisher.open_attempt(ref)
        return api.OpenAttemptResponse(stream_generation=publisher.stream_generation)

    async def AppendChunks(self, request: api.AppendChunksRequest, context: Context) -> api.AppendChunksResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        ref = attempt_ref(request.attempt)
        if not request.chunks:
            raise BadRequest("chunks", "must contain at least one chunk")
        if len(request.chunks) > self._settings.max_batch_messages:
            raise BadRequest("chunks", f"must be at most {self._settings.max_batch_messages} chunks")
        for index, chunk in enumerate(request.chunks):
            if bodies.utf8_size(chunk) > self._settings.max_chunk_bytes:
                raise BadRequest(f"chunks[{index}]", f"must be at most {self._settings.max_chunk_bytes} bytes")
        first = validation.non_negative(request.first_chunk_index, "first_chunk_index")
        publisher = await self._registry.get(owner, session_id)
        next_index = publisher.append_chunks(ref, first, list(request.chunks))
        return api.AppendChunksResponse(next_chunk_index=next_index)

    async def CommitAttempt(self, request: api.CommitAttemptRequest, context: Context) -> api.CommitAttemptResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        ref = attempt_ref(request.attempt)
        message = request.message
        if message.role != pb.MESSAGE_ROLE_ASSISTANT:
            raise BadRequest("message.role", "an attempt commits an ASSISTANT message")
        row = validation.new_message(message, "message", self._settings, message.ByteSize())
        publisher = await self._registry.get(owner, session_id)
        known = await attachment_media_types(self._db, session_id, [row])
        message_id, seq = await publisher.commit_attempt(ref, row, media_types=known)
        if request.wait_durable:
            await publisher.wait_durable(seq)
        return api.CommitAttemptResponse(message_id=message_id, seq=seq)

    async def CancelAttempt(self, request: api.CancelAttemptRequest, context: Context) -> api.CancelAttemptResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        ref = attempt_ref(request.attempt)
        publisher = await self._registry.get(owner, session_id)
        message_id, seq = await publisher.cancel_attempt(ref)
        if request.wait_durable:
            await publisher.wait_durable(seq)
        return api.CancelAttemptResponse(message_id=message_id, seq=seq)

    async def GetHistoryOutline(
        self, request: api.GetHistoryOutlineRequest, context: Context
    ) -> api.GetHistoryOutlineResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        start_turn = validation.non_negative(request.start_turn, "start_turn") or 1
        limit = validation.non_negative(request.limit, "limit") or 128
        if limit > 1000:
            raise BadRequest("limit", "must be at most 1000")
        stream_generation_pin = validation.non_negative(request.stream_generation, "stream_generation")
        seq_pin = validation.non_negative(request.snapshot_sequence, "snapshot_sequence")
        async with self._db.connection() as connection:
            await sessions.load(connection, owner, session_id)
        if HISTORY_OUTLINE_V1 not in request.capabilities:
            return api.GetHistoryOutlineResponse(status=api.PIN_STATUS_UNSUPPORTED)
        publisher = await self._registry.get(owner, session_id)
        await publisher.flush_until(publisher.commit_seq)
        async with self._db.transaction() as connection:
            return await turns.outline(
                connection,
                session_id,
                start_turn=start_turn,
                limit=limit,
                stream_generation_pin=stream_generation_pin or None,
                seq_pin=seq_pin or None,
                current_stream_generation=await persistence.current_stream_generation(connection, session_id),
                durable_seq=publisher.durable_seq,
                now_ms=self._clock.now_ms(),
            )
