"""How the snapshot reads its sources: transcript's gRPC contract, page by page, acting for the user
who owns the operation. `SourceReader` is the seam; `TranscriptSourceReader` is the one implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_merge.snapshot.errors import SourceChanged, SourceMissing, SourceUnavailable
from continuum_merge.snapshot.layout import SourceCut

R = TypeVar("R")
# A page of messages aims at this many body bytes (transcript ends a page at 16 MiB in any case): the
# next page's size follows the sizes seen so far, between 1 and MAX_MESSAGE_PAGE_SIZE messages.
PAGE_BODY_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_PAGE_SIZE = 1000
FIRST_MESSAGE_PAGE_SIZE = 8
SESSION_PAGE_SIZE = 200
# The most sessions one source tree may have, so a runaway tree cannot grow the cut without bound.
MAX_TREE_SESSIONS = 10_000
# Codes meaning "try again later" rather than "this is what transcript holds".
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class AttachmentUnreadable(Exception):
    """Transcript has the attachment's row but could not hand out its bytes (e.g. the file is gone)."""


class SourceReader(Protocol):
    """Reads source sessions as they are now (the caller holds their claims)."""

    async def session(self, session_id: str) -> tpb.Session | None:
        """The live session, or None when it is gone (deleted or unknown) or not the acting user's."""
        ...

    def children(self, session_id: str) -> AsyncIterator[tpb.Session]:
        """The live direct children of a session."""
        ...

    async def last_message_id(self, session_id: str) -> int:
        """The id of the session's last live message; 0 when it has none."""
        ...

    def message_pages(self, session_id: str, up_to: int) -> AsyncIterator[list[tpb.Message]]:
        """The live messages with id <= `up_to`, ascending, a bounded page at a time."""
        ...

    async def attachment(self, attachment_id: str) -> tpb.Attachment | None:
        """The attachment's metadata (size and sha256 of its bytes), or None when there is no such row."""
        ...

    def attachment_bytes(self, attachment_id: str) -> AsyncIterator[bytes]:
        """The attachment's bytes in chunks; AttachmentUnreadable when transcript cannot serve them."""
        ...


class TranscriptSourceReader:
    """SourceReader over transcript's gRPC stub, acting for one user (call metadata given whole)."""

    def __init__(
        self,
        stub: api_grpc.TranscriptServiceStub,
        metadata: tuple[tuple[str, str], ...],
        timeout_seconds: float,
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._timeout = timeout_seconds

    async def _call(self, rpc: Callable[..., Awaitable[R]], request: ProtoMessage) -> R:
        try:
            return await rpc(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in TRANSIENT:
                raise SourceUnavailable(f"transcript: {error.code().name}") from error
            raise

    async def session(self, session_id: str) -> tpb.Session | None:
        try:
            response: api.GetSessionResponse = await self._call(
                self._stub.GetSession, api.GetSessionRequest(session_id=session_id)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                return None
            raise
        return response.session

    async def children(self, session_id: str) -> AsyncIterator[tpb.Session]:
        token = ""
        while True:
            request = api.ListSessionsRequest(
                parent_session_id=session_id, page_size=SESSION_PAGE_SIZE, page_token=token
            )
            response: api.ListSessionsResponse = await self._call(self._stub.ListSessions, request)
            for child in response.sessions:
                yield child
            token = response.next_page_token
            if not token:
                return

    async def last_message_id(self, session_id: str) -> int:
        request = api.ListMessagePageRequest(session_id=session_id, page_size=1)
        response: api.ListMessagePageResponse = await self._call(self._stub.ListMessagePage, request)
        return response.messages[-1].message_id if response.messages else 0

    async def message_pages(self, session_id: str, up_to: int) -> AsyncIterator[list[tpb.Message]]:
        after = 0
        page_size = FIRST_MESSAGE_PAGE_SIZE
        while after < up_to:
            request = api.ListMessagesAfterRequest(session_id=session_id, after_message_id=after, page_size=page_size)
            response: api.ListMessagesAfterResponse = await self._call(self._stub.ListMessagesAfter, request)
            page = [message for message in response.messages if message.message_id <= up_to]
            if page:
                yield page
            if len(page) < len(response.messages) or not response.next_page_token or not response.messages:
                return
            after = response.messages[-1].message_id
            average = max(1, sum(message.body_bytes for message in page) // len(page))
            page_size = max(1, min(MAX_MESSAGE_PAGE_SIZE, PAGE_BODY_BYTES // average))

    async def attachment(self, attachment_id: str) -> tpb.Attachment | None:
        try:
            response: api.GetAttachmentResponse = await self._call(
                self._stub.GetAttachment, api.GetAttachmentRequest(attachment_id=attachment_id)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return response.attachment

    async def attachment_bytes(self, attachment_id: str) -> AsyncIterator[bytes]:
        call = self._stub.DownloadAttachment(
            api.DownloadAttachmentRequest(attachment_id=attachment_id), metadata=self._metadata, timeout=self._timeout
        )
        try:
            async for frame in call:
                if frame.chunk:
                    yield frame.chunk
        except grpc.aio.AioRpcError as error:
            if error.code() in TRANSIENT:
                raise SourceUnavailable(f"transcript: {error.code().name}") from error
            raise AttachmentUnreadable(attachment_id) from error
        finally:
            call.cancel()


async def capture_cut(reader: SourceReader, root_session_id: str) -> SourceCut:
    """The cut of one source tree, taken while its claim is held: the root and its descendants
    (breadth first, in transcript's order) with each one's last live message id and history generation.
    SourceMissing when the root is gone."""
    root = await reader.session(root_session_id)
    if root is None:
        raise SourceMissing(root_session_id)
    sessions = [root]
    index = 0
    while index < len(sessions):
        async for child in reader.children(sessions[index].session_id):
            sessions.append(child)
            if len(sessions) > MAX_TREE_SESSIONS:
                raise SourceChanged(root_session_id, f"the tree has more than {MAX_TREE_SESSIONS} sessions")
        index += 1
    last = {session.session_id: await reader.last_message_id(session.session_id) for session in sessions}
    generations = {session.session_id: session.history_generation for session in sessions}
    return SourceCut(root_session_id, tuple(session.session_id for session in sessions), last, generations)
