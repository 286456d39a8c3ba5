"""TranscriptService handlers: validate, open one transaction at the edge, call the store, convert.

Handlers raise TranscriptError; the runtime's interceptor maps it to a status. None sets codes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
from pydantic import Field
from sqlalchemy import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import ACTING_USER_KEY, acting_user
from continuum_runtime.cancellation import finish_before_stopping
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.errors import ServiceError
from continuum_runtime.paging import Cursor, PageTokens, page_size
from continuum_transcript import (
    attachments,
    bodies,
    claims,
    convert,
    events,
    fence,
    messages,
    persistence,
    sessions,
    turns,
    validation,
)
from continuum_transcript.errors import AttachmentTooLarge, BadRequest, PageTokenInvalid
from continuum_transcript.live import LiveTranscript, attachment_media_types
from continuum_transcript.registry import PublisherRegistry
from continuum_transcript.settings import TranscriptSettings

Context: TypeAlias = grpc.aio.ServicerContext

# Sessions and events pages stop growing past this many serialized bytes.
LIST_PAGE_BYTES = 4 * 1024 * 1024
ID_LIMIT = 2**63
# A refused upload reads on, discarding, what its client still sends (up to these bounds) before it
# answers: grpc's client reports a write that crosses the answer as INTERNAL, and the refusal is lost.
REFUSED_UPLOAD_DRAIN_BYTES = 1024 * 1024
REFUSED_UPLOAD_DRAIN_SECONDS = 2.0


class SessionsCursor(Cursor):
    """Where the next page of a user's sessions (newest first) continues."""

    create_ms: int = Field(ge=0, lt=ID_LIMIT)
    session_id: str = Field(pattern=validation.ID_PATTERN.pattern)


class MessagesCursor(Cursor):
    """Where the next page of messages after a bound continues."""

    after_message_id: int = Field(ge=0, lt=ID_LIMIT)


class EventsCursor(Cursor):
    """Where the next page of the session events outbox continues."""

    after_event_id: int = Field(ge=0, lt=ID_LIMIT)


def _within_bytes(items: list[Any], budget: int) -> tuple[list[Any], bool]:
    """The longest prefix of `items` under `budget` serialized bytes (at least one item), and whether
    it left any out."""
    total = 0
    for kept, item in enumerate(items, start=1):
        total += item.ByteSize()
        if total >= budget and kept < len(items):
            return items[:kept], True
    return items, False


def _optional_user(context: Context) -> str | None:
    """Backends consuming the outbox act as no user and see every event."""
    for key, _ in context.invocation_metadata() or ():
        if key == ACTING_USER_KEY:
            return acting_user(context)
    return None


class TranscriptServicer(LiveTranscript, api_grpc.TranscriptServiceServicer):
    """The gRPC face of the transcript store."""

    def __init__(
        self,
        settings: TranscriptSettings,
        database: Database,
        store: attachments.AttachmentStore,
        bell: events.EventBell,
        registry: PublisherRegistry,
        page_token_secret: bytes,
        clock: Clock,
    ) -> None:
        self._sessions_pages = PageTokens(page_token_secret, SessionsCursor, PageTokenInvalid)
        self._messages_pages = PageTokens(page_token_secret, MessagesCursor, PageTokenInvalid)
        self._events_pages = PageTokens(page_token_secret, EventsCursor, PageTokenInvalid)
        self._settings = settings
        self._db = database
        self._store = store
        self._bell = bell
        self._registry = registry
        self._clock = clock

    # Sessions

    async def CreateSession(self, request: api.CreateSessionRequest, context: Context) -> api.CreateSessionResponse:
        owner = acting_user(context)
        new = sessions.NewSession(
            session_id=validation.optional_session_id(request.session_id, "session_id"),
            parent_session_id=validation.optional_session_id(request.parent_session_id, "parent_session_id"),
            kind=validation.session_kind(request.kind),
            title=validation.text(request.title, "title", validation.MAX_TITLE_CHARS),
            model=validation.text(request.model, "model", validation.MAX_MODEL_CHARS),
            working_directory=validation.text(
                request.working_directory, "working_directory", validation.MAX_PATH_CHARS
            ),
            memory_injection_disabled=request.memory_injection_disabled,
            metadata=validation.metadata(request.metadata),
        )
        async with self._db.transaction() as connection:
            row, created = await sessions.create(connection, owner, new, self._clock.now_ms())
        return api.CreateSessionResponse(session=convert.session(row), created=created)

    async def GetSession(self, request: api.GetSessionRequest, context: Context) -> api.GetSessionResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        async with self._db.connection() as connection:
            row = await sessions.load(connection, owner, session_id, include_deleted=request.include_deleted)
        return api.GetSessionResponse(session=convert.session(row))

    async def ListSessions(self, request: api.ListSessionsRequest, context: Context) -> api.ListSessionsResponse:
        owner = acting_user(context)
        size = page_size(validation.non_negative(request.page_size, "page_size"), default=50, maximum=200)
        parent = validation.optional_session_id(request.parent_session_id, "parent_session_id")
        parameters = {"rpc": "ListSessions", "owner": owner, "parent": parent}
        cursor = self._sessions_pages.open(request.page_token, parameters)
        after = None if cursor is None else (cursor.create_ms, cursor.session_id)
        async with self._db.connection() as connection:
            rows = await sessions.list_page(connection, owner, parent, size + 1, after)
        page, cut = _within_bytes([convert.session(r) for r in rows[:size]], LIST_PAGE_BYTES)
        token = ""
        if len(rows) > size or cut:
            last = rows[len(page) - 1]
            token = self._sessions_pages.issue(
                SessionsCursor(create_ms=last["create_ms"], session_id=last["session_id"]), parameters
            )
        return api.ListSessionsResponse(sessions=page, next_page_token=token)

    async def UpdateSession(self, request: api.UpdateSessionRequest, context: Context) -> api.UpdateSessionResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session.session_id, "session.session_id")
        if not request.update_mask.paths:
            raise BadRequest("update_mask", "must name at least one field")
        changes: dict[str, Any] = {}
        given = request.session
        for path in request.update_mask.paths:
            if path == "title":
                changes[path] = validation.text(given.title, "session.title", validation.MAX_TITLE_CHARS)
            elif path == "model":
                changes[path] = validation.text(given.model, "session.model", validation.MAX_MODEL_CHARS)
            elif path == "working_directory":
                changes[path] = validation.text(
                    given.working_directory, "session.working_directory", validation.MAX_PATH_CHARS
                )
            elif path == "memory_injection_disabled":
                changes[path] = given.memory_injection_disabled
            elif path == "metadata":
                changes[path] = validation.metadata(given.metadata, "session.metadata")
            else:
                raise BadRequest("update_mask", f"{path!r} is not one of {', '.join(sessions.UPDATABLE_FIELDS)}")
        async with self._db.transaction() as connection:
            row = await sessions.update_fields(connection, owner, session_id, changes, self._clock.now_ms())
        return api.UpdateSessionResponse(session=convert.session(row))

    async def DeleteSession(self, request: api.DeleteSessionRequest, context: Context) -> api.DeleteSessionResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        async with self._db.transaction() as connection:
            deleted, event_id = await sessions.delete_tree(connection, owner, session_id, self._clock.now_ms())
        self._bell.ring()
        self._registry.end_sessions(deleted)
        return api.DeleteSessionResponse(deleted_session_ids=deleted, event_id=event_id)

    # Messages

    async def AppendMessages(self, request: api.AppendMessagesRequest, context: Context) -> api.AppendMessagesResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        batch = validation.append_batch(request.messages, self._settings)
        publisher = await self._registry.get(owner, session_id)
        known = await attachment_media_types(self._db, session_id, batch)
        # The response's create_time is every stored message's create_time.
        created = self._clock.now_ms()
        seq, ids = await publisher.publish(batch, media_types=known, create_ms=created)
        await publisher.wait_durable(seq)
        return api.AppendMessagesResponse(message_ids=ids, create_time=convert.timestamp(created))

    async def GetMessage(self, request: api.GetMessageRequest, context: Context) -> api.GetMessageResponse:
        return api.GetMessageResponse(message=await self._whole_message(request, context))

    async def StreamMessage(
        self, request: api.StreamMessageRequest, context: Context
    ) -> AsyncIterator[api.StreamMessageResponse]:
        for frame in bodies.stream_frames(await finish_before_stopping(self._whole_message(request, context))):
            yield frame

    async def _whole_message(
        self, request: api.GetMessageRequest | api.StreamMessageRequest, context: Context
    ) -> pb.Message:
        """One message of the caller's session with its whole body (GetMessage and StreamMessage)."""
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        message_id = validation.non_negative(request.message_id, "message_id")
        async with self._db.connection() as connection:
            row = await messages.get(connection, owner, session_id, message_id)
            (stored,) = await messages.with_media_types(connection, [row])
        return stored

    async def ListMessagesAfter(
        self, request: api.ListMessagesAfterRequest, context: Context
    ) -> api.ListMessagesAfterResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        after = validation.non_negative(request.after_message_id, "after_message_id")
        size = page_size(validation.non_negative(request.page_size, "page_size"), default=500, maximum=1000)
        parameters = {"rpc": "ListMessagesAfter", "owner": owner, "session": session_id, "after": after}
        cursor = self._messages_pages.open(request.page_token, parameters)
        start = after if cursor is None else cursor.after_message_id
        async with self._db.connection() as connection:
            rows, more = await messages.list_after(
                connection, owner, session_id, start, size, self._settings.list_page_bytes
            )
            known = await messages.media_types_of(connection, rows)
        response = api.ListMessagesAfterResponse()
        # Built in place: a page holds megabytes of bodies, which a list of messages handed to the
        # response would be copied once more for.
        for row in rows:
            convert.message(row, known, into=response.messages.add())
        if more and rows:
            cursor = MessagesCursor(after_message_id=rows[-1]["message_id"])
            response.next_page_token = self._messages_pages.issue(cursor, parameters)
        return response

    async def ListMessagePage(
        self, request: api.ListMessagePageRequest, context: Context
    ) -> api.ListMessagePageResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        anchor = validation.non_negative(request.anchor_message_id, "anchor_message_id")
        if request.direction not in api.PageDirection.values():
            raise BadRequest("direction", "is not a known page direction")
        newer = request.direction == api.PAGE_DIRECTION_NEWER
        size = page_size(validation.non_negative(request.page_size, "page_size"), default=32, maximum=200)
        stream_generation_pin = validation.non_negative(request.stream_generation, "stream_generation")
        seq_pin = validation.non_negative(request.snapshot_sequence, "snapshot_sequence")
        async with self._db.connection() as connection:
            stream_generation = await persistence.current_stream_generation(connection, session_id)
            if stream_generation_pin and stream_generation_pin != stream_generation:
                await sessions.load(connection, owner, session_id)
                # Never another stream generation's page: the client must re-follow.
                return api.ListMessagePageResponse(status=api.PIN_STATUS_STALE, stream_generation=stream_generation)
            rows, has_older, has_newer = await messages.page(
                connection, owner, session_id, anchor, newer, size, seq_pin if stream_generation_pin else None
            )
            # The messages nearest the anchor travel whole first.
            page = await messages.bounded(connection, rows, self._settings.limits(), newest_first=not newer)
        return api.ListMessagePageResponse(
            messages=page,
            has_older=has_older,
            has_newer=has_newer,
            status=api.PIN_STATUS_OK,
            stream_generation=stream_generation,
        )

    async def EditUserMessage(
        self, request: api.EditUserMessageRequest, context: Context
    ) -> api.EditUserMessageResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        message_id = validation.non_negative(request.message_id, "message_id")
        content = validation.content_parts(request.content, "content")
        if not content:
            raise BadRequest("content", "must not be empty")
        body_bytes = pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=request.content).ByteSize()
        if body_bytes > self._settings.max_message_bytes:
            raise BadRequest("content", f"is {body_bytes} bytes; the limit is {self._settings.max_message_bytes}")
        expected = validation.non_negative(request.expected_history_generation, "expected_history_generation")
        publisher = await self._registry.get(owner, session_id)

        async def change(connection: AsyncConnection) -> tuple[Any, int, int, int, dict[str, str]]:
            edited = await messages.edit_user_message(
                connection, owner, session_id, message_id, content, body_bytes, expected or None, self._clock.now_ms()
            )
            # The new content may refer only to this session's attachments, as an append's may.
            known = await messages.attachment_media_types(connection, session_id, validation.attachment_ids(content))
            await turns.invalidate(connection, session_id)
            return (*edited, known)

        (row, stream_generation, removed, event_id, known), _ = await publisher.rewrite(change)
        self._bell.ring()
        return api.EditUserMessageResponse(
            message=convert.message(row, known),
            history_generation=stream_generation,
            deleted_message_count=removed,
            event_id=event_id,
        )

    async def SetCompactionFence(
        self, request: api.SetCompactionFenceRequest, context: Context
    ) -> api.SetCompactionFenceResponse:
        owner = acting_user(context)
        session_id = validation.session_id(request.session_id)
        expected_fence = validation.non_negative(request.expected_fence_message_id, "expected_fence_message_id")
        message_id = validation.non_negative(request.message_id, "message_id")
        if message_id <= expected_fence:
            raise BadRequest("message_id", "must be above expected_fence_message_id: the fence only moves up")
        expected = validation.positive(request.expected_history_generation, "expected_history_generation")
        # No publisher: the fence changes no history and no Follow stream generation, only the session row.
        async with self._db.transaction() as connection:
            row = await fence.set_fence(
                connection, owner, session_id, message_id, expected, expected_fence, self._clock.now_ms()
            )
        return api.SetCompactionFenceResponse(
            session_id=session_id,
            message_id=row["compaction_fence_message_id"],
            history_generation=row["history_generation"],
        )

    # Attachments

    async def UploadAttachment(
        self, request_iterator: AsyncIterator[api.UploadAttachmentRequest], context: Context
    ) -> api.UploadAttachmentResponse:
        try:
            return await self._upload(acting_user(context), request_iterator)
        except ServiceError:
            await _drain_refused_upload(request_iterator)
            raise

    async def _upload(
        self, owner: str, request_iterator: AsyncIterator[api.UploadAttachmentRequest]
    ) -> api.UploadAttachmentResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("frame") != "header":
            raise BadRequest("header", "the first frame must be the upload header")
        header = first.header
        session_id = validation.session_id(header.session_id, "header.session_id")
        attachments.check_header(header.media_type, header.file_name)
        declared = validation.non_negative(header.size_bytes, "header.size_bytes")
        limit = self._settings.max_attachment_bytes
        if declared > limit:
            raise AttachmentTooLarge(f"attachments are limited to {limit} bytes", metadata={"max_bytes": limit})
        # A request stream is cancelled with its client (GuardedServer completes single requests only).
        await finish_before_stopping(self._session(owner, session_id))

        async def chunks() -> AsyncIterator[bytes]:
            async for frame in request_iterator:
                if frame.WhichOneof("frame") != "chunk":
                    raise BadRequest("chunk", "only the first frame may be a header")
                yield frame.chunk

        stored = await self._store.receive(chunks(), limit, expected_size=declared or None)

        async def record() -> RowMapping:
            async with self._db.transaction() as connection:
                return await attachments.record(
                    connection, owner, session_id, header.media_type, header.file_name, stored, self._clock.now_ms()
                )

        row = await finish_before_stopping(record())
        return api.UploadAttachmentResponse(attachment=convert.attachment(row))

    async def GetAttachment(self, request: api.GetAttachmentRequest, context: Context) -> api.GetAttachmentResponse:
        owner = acting_user(context)
        attachment_id = validation.session_id(request.attachment_id, "attachment_id")
        return api.GetAttachmentResponse(attachment=convert.attachment(await self._attachment(owner, attachment_id)))

    async def _session(self, owner: str, session_id: str) -> RowMapping:
        async with self._db.connection() as connection:
            return await sessions.load(connection, owner, session_id)

    async def _attachment(self, owner: str, attachment_id: str) -> RowMapping:
        async with self._db.connection() as connection:
            return await attachments.load(connection, owner, attachment_id)

    async def DownloadAttachment(
        self, request: api.DownloadAttachmentRequest, context: Context
    ) -> AsyncIterator[api.DownloadAttachmentResponse]:
        owner = acting_user(context)
        attachment_id = validation.session_id(request.attachment_id, "attachment_id")
        row = await finish_before_stopping(self._attachment(owner, attachment_id))
        first = True
        async for chunk in self._store.read(row["sha256"]):
            header = convert.attachment(row) if first else None
            yield api.DownloadAttachmentResponse(attachment=header, chunk=chunk)
            first = False
        if first:
            yield api.DownloadAttachmentResponse(attachment=convert.attachment(row))

    # Execution gate

    async def AcquireClaims(self, request: api.AcquireClaimsRequest, context: Context) -> api.AcquireClaimsResponse:
        owner = acting_user(context)
        if not request.session_ids:
            raise BadRequest("session_ids", "must name at least one session")
        if len(request.session_ids) > self._settings.max_sessions_per_claim:
            raise BadRequest("session_ids", f"must name at most {self._settings.max_sessions_per_claim} sessions")
        session_ids = [validation.session_id(s, f"session_ids[{i}]") for i, s in enumerate(request.session_ids)]
        kind = validation.claim_kind(request.kind)
        holder = validation.holder(request.holder)
        ttl = validation.ttl_ms(request.ttl)
        async with self._db.transaction() as connection:
            held = await claims.acquire(connection, owner, session_ids, kind, holder, ttl, self._clock.now_ms())
        return api.AcquireClaimsResponse(claim=convert.claim(held))

    async def RenewClaims(self, request: api.RenewClaimsRequest, context: Context) -> api.RenewClaimsResponse:
        owner = acting_user(context)
        claim_id = validation.session_id(request.claim_id, "claim_id")
        ttl = validation.ttl_ms(request.ttl)
        async with self._db.transaction() as connection:
            held = await claims.renew(connection, owner, claim_id, ttl, self._clock.now_ms())
        return api.RenewClaimsResponse(claim=convert.claim(held))

    async def ReleaseClaims(self, request: api.ReleaseClaimsRequest, context: Context) -> api.ReleaseClaimsResponse:
        owner = acting_user(context)
        claim_id = validation.session_id(request.claim_id, "claim_id")
        async with self._db.transaction() as connection:
            released = await claims.release(connection, owner, claim_id)
        return api.ReleaseClaimsResponse(released=released)

    async def ReleaseHolderClaims(
        self, request: api.ReleaseHolderClaimsRequest, context: Context
    ) -> api.ReleaseHolderClaimsResponse:
        owner = _optional_user(context)
        holder = validation.holder(request.holder)
        kind = validation.claim_kind(request.kind)
        async with self._db.transaction() as connection:
            released = await claims.release_holder(connection, owner, holder, kind)
        return api.ReleaseHolderClaimsResponse(claim_ids=released)

    async def GetRun(self, request: api.GetRunRequest, context: Context) -> api.GetRunResponse:
        owner = acting_user(context)
        run_id = validation.holder(request.run_id, "run_id")
        async with self._db.connection() as connection:
            held = await claims.run(connection, owner, run_id, self._clock.now_ms())
        return api.GetRunResponse(claim=convert.claim(held), root_session_id=held.root_session_ids[0])

    # Events

    async def ListSessionEvents(
        self, request: api.ListSessionEventsRequest, context: Context
    ) -> api.ListSessionEventsResponse:
        owner = _optional_user(context)
        after = validation.non_negative(request.after_event_id, "after_event_id")
        size = page_size(validation.non_negative(request.page_size, "page_size"), default=100, maximum=1000)
        parameters = {"rpc": "ListSessionEvents", "owner": owner, "after": after}
        cursor = self._events_pages.open(request.page_token, parameters)
        async with self._db.connection() as connection:
            start = after if cursor is None else cursor.after_event_id
            rows = await events.list_after(connection, start, size + 1, owner)
        page, cut = _within_bytes([convert.event(r) for r in rows[:size]], LIST_PAGE_BYTES)
        token = ""
        if len(rows) > size or cut:
            token = self._events_pages.issue(EventsCursor(after_event_id=page[-1].event_id), parameters)
        return api.ListSessionEventsResponse(events=page, next_page_token=token)

    async def _events_after(self, cursor: int, owner: str | None) -> list[RowMapping]:
        async with self._db.connection() as connection:
            return await events.list_after(connection, cursor, 500, owner)

    async def WatchSessionEvents(
        self, request: api.WatchSessionEventsRequest, context: Context
    ) -> AsyncIterator[api.WatchSessionEventsResponse]:
        owner = _optional_user(context)
        cursor = validation.non_negative(request.after_event_id, "after_event_id")
        while True:
            # A watcher leaving (or the server stopping) waits for this read: cut, it costs its connection.
            rows = await finish_before_stopping(self._events_after(cursor, owner))
            for row in rows:
                cursor = row["event_id"]
                yield api.WatchSessionEventsResponse(event=convert.event(row))
            if not rows:
                await self._bell.wait(self._settings.events_poll_seconds)


async def _drain_refused_upload(frames: AsyncIterator[api.UploadAttachmentRequest]) -> None:
    """Discard the rest of a refused upload until its client half-closes, or for at most
    REFUSED_UPLOAD_DRAIN_BYTES / REFUSED_UPLOAD_DRAIN_SECONDS: a client that writes on gets its answer anyway."""
    discarded = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(REFUSED_UPLOAD_DRAIN_SECONDS):
            async for frame in frames:
                discarded += frame.ByteSize()
                if discarded > REFUSED_UPLOAD_DRAIN_BYTES:
                    return
