"""Merge's only way to transcript's data: its gRPC contract, called on behalf of the acting user.

Every failure becomes a merge error here, so callers never see a raw `AioRpcError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2, struct_pb2
from google.protobuf.message import Message as ProtoMessage

from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_merge.errors import SourceBusy, TranscriptRefused, TranscriptUnavailable
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details
from continuum_runtime.wire_names import MERGE_OPERATION_METADATA_KEY

R = TypeVar("R")
# ListSessions' largest page.
SESSIONS_PAGE = 200


def refused_for(refused: TranscriptRefused, *reasons: transcript_reasons.ErrorReason.ValueType) -> bool:
    """Whether transcript refused with one of `reasons` (values of its ErrorReason enum)."""
    return refused.reason in {transcript_reasons.ErrorReason.Name(reason) for reason in reasons}


@dataclass(frozen=True)
class HeldClaim:
    """A MERGE claim as transcript granted it: the roots it locks and its lease's end."""

    claim_id: str
    root_session_ids: tuple[str, ...]
    expire_ms: int


@dataclass(frozen=True)
class TargetSpec:
    """The session a publish creates: the reserved id and what the start captured."""

    session_id: str
    operation_id: str
    title: str
    model: str
    working_directory: str
    entry_text: str


class TranscriptClient:
    """Stubs over one channel, owned by the merge process."""

    def __init__(self, address: str, token: str, timeout_seconds: float, max_message_bytes: int) -> None:
        self._channel = open_channel(address, max_message_bytes)
        self._stub = api_grpc.TranscriptServiceStub(self._channel)
        self._token = token
        self._timeout = timeout_seconds

    @property
    def stub(self) -> api_grpc.TranscriptServiceStub:
        """The raw stub, for streams (session events, message pages)."""
        return self._stub

    def metadata(self, user: str | None) -> tuple[tuple[str, str], ...]:
        """Call metadata: the service credential and, for session calls, the acting user."""
        return call_metadata(self._token, user)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def _call(self, rpc: Callable[..., Awaitable[R]], request: ProtoMessage, user: str | None) -> R:
        try:
            return await rpc(request, metadata=self.metadata(user), timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise TranscriptUnavailable("transcript is unavailable; nothing was changed") from error
            raise TranscriptRefused(error_details(error)) from error

    async def get_session(self, user: str, session_id: str, *, include_deleted: bool = False) -> tpb.Session:
        """The session, if `user` owns it (transcript's NOT_FOUND / PERMISSION_DENIED otherwise)."""
        request = api.GetSessionRequest(session_id=session_id, include_deleted=include_deleted)
        response: api.GetSessionResponse = await self._call(self._stub.GetSession, request, user)
        return response.session

    async def find_session(self, user: str, session_id: str) -> tpb.Session | None:
        """The live session, or None when transcript has none by that id (or it was deleted)."""
        try:
            return await self.get_session(user, session_id)
        except TranscriptRefused as refused:
            if refused_for(refused, transcript_reasons.SESSION_NOT_FOUND):
                return None
            raise

    async def tree(self, user: str, root_session_id: str) -> AsyncIterator[tpb.Session]:
        """Every live session of a tree, the root first, then children breadth-first (paged)."""
        pending = [await self.get_session(user, root_session_id)]
        while pending:
            session = pending.pop(0)
            yield session
            token = ""
            while True:
                request = api.ListSessionsRequest(
                    page_size=SESSIONS_PAGE, page_token=token, parent_session_id=session.session_id
                )
                response: api.ListSessionsResponse = await self._call(self._stub.ListSessions, request, user)
                pending.extend(response.sessions)
                token = response.next_page_token
                if not token:
                    break

    async def last_message_id(self, user: str, session_id: str) -> int:
        """The id of the session's latest live message, 0 when it has none."""
        request = api.ListMessagePageRequest(session_id=session_id, page_size=1)
        response: api.ListMessagePageResponse = await self._call(self._stub.ListMessagePage, request, user)
        return response.messages[-1].message_id if response.messages else 0

    async def acquire_merge_claim(
        self, user: str, session_ids: Sequence[str], holder: str, ttl_seconds: float
    ) -> HeldClaim:
        """Lock every source tree at once, or none: `SourceBusy` names the busy root and its holder."""
        request = api.AcquireClaimsRequest(
            session_ids=list(session_ids), kind=tpb.CLAIM_KIND_MERGE, holder=holder, ttl=_duration(ttl_seconds)
        )
        try:
            response: api.AcquireClaimsResponse = await self._call(self._stub.AcquireClaims, request, user)
        except TranscriptRefused as refused:
            if refused_for(refused, transcript_reasons.SESSION_ALREADY_RUNNING, transcript_reasons.SESSION_BUSY):
                found = refused.metadata
                raise SourceBusy(
                    f"source {found.get('root_session_id', '')} is busy",
                    metadata={
                        "session_id": found.get("root_session_id", ""),
                        "holder_kind": found.get("holder_kind", ""),
                        "expire_time": found.get("expire_time", ""),
                    },
                ) from refused
            raise
        return _held(response.claim)

    async def renew_claim(self, user: str, claim_id: str, ttl_seconds: float) -> HeldClaim:
        """Extend a held claim's lease (transcript's CLAIM_NOT_HELD once it lapsed)."""
        request = api.RenewClaimsRequest(claim_id=claim_id, ttl=_duration(ttl_seconds))
        response: api.RenewClaimsResponse = await self._call(self._stub.RenewClaims, request, user)
        return _held(response.claim)

    async def release_claim(self, user: str, claim_id: str) -> None:
        """Release a claim (releasing an expired or released one succeeds)."""
        await self._call(self._stub.ReleaseClaims, api.ReleaseClaimsRequest(claim_id=claim_id), user)

    async def release_holder_claims(self, holder: str) -> list[str]:
        """Release every MERGE claim `holder` took (whichever run of the operation took it); their ids."""
        request = api.ReleaseHolderClaimsRequest(holder=holder, kind=tpb.CLAIM_KIND_MERGE)
        response: api.ReleaseHolderClaimsResponse = await self._call(self._stub.ReleaseHolderClaims, request, None)
        return list(response.claim_ids)

    async def create_target(self, user: str, target: TargetSpec) -> tpb.Session:
        """Create the merged session under its reserved id, idempotently (the same id and parameters
        answer the existing session), and give it its one handoff entry message unless it has one."""
        metadata = struct_pb2.Struct()
        metadata.update({MERGE_OPERATION_METADATA_KEY: target.operation_id})
        request = api.CreateSessionRequest(
            session_id=target.session_id,
            kind=tpb.SESSION_KIND_MERGED,
            title=target.title,
            model=target.model,
            working_directory=target.working_directory,
            metadata=metadata,
        )
        response: api.CreateSessionResponse = await self._call(self._stub.CreateSession, request, user)
        if await self.last_message_id(user, target.session_id) == 0:
            entry_metadata = struct_pb2.Struct()
            entry_metadata.update({MERGE_OPERATION_METADATA_KEY: target.operation_id, "historicalReference": True})
            entry = tpb.NewMessage(
                role=tpb.MESSAGE_ROLE_USER,
                content=[tpb.ContentPart(text=target.entry_text)],
                metadata=entry_metadata,
            )
            await self._call(
                self._stub.AppendMessages,
                api.AppendMessagesRequest(session_id=target.session_id, messages=[entry]),
                user,
            )
        return response.session

    async def delete_session(self, user: str, session_id: str) -> None:
        """Delete a session (deleting a deleted or unknown one succeeds)."""
        try:
            await self._call(self._stub.DeleteSession, api.DeleteSessionRequest(session_id=session_id), user)
        except TranscriptRefused as refused:
            if not refused_for(refused, transcript_reasons.SESSION_NOT_FOUND):
                raise


def _held(claim: tpb.Claim) -> HeldClaim:
    return HeldClaim(claim.claim_id, tuple(claim.root_session_ids), claim.expire_time.ToMilliseconds())


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(round(seconds * 1000))
    return duration
