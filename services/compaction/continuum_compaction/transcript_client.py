"""Compaction's only way to transcript's data: its gRPC contract, called on behalf of the acting user.

Every failure becomes a compaction error here, so callers never see a raw `AioRpcError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message as ProtoMessage

from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_compaction.errors import TranscriptRefused, TranscriptUnavailable
from continuum_compaction.history import clip
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details

R = TypeVar("R")
# ListMessagesAfter's largest page: fewer round trips for a long tail.
PAGE_SIZE = 1000


def _refused_for(refused: TranscriptRefused, *reasons: transcript_reasons.ErrorReason.ValueType) -> bool:
    """Whether transcript refused with one of `reasons` (values of its ErrorReason enum)."""
    return refused.reason in {transcript_reasons.ErrorReason.Name(reason) for reason in reasons}


class HistoryRewritten(Exception):
    """An edit rewrote the session's history after compaction loaded it; the result must be discarded."""


class FenceMoved(Exception):
    """Another compaction moved transcript's fence after this one read it; the result must be discarded."""


class SessionRunning(Exception):
    """The session's tree is claimed by a running turn (`run_id`) or another holder, until
    `expire_time` (RFC 3339) unless renewed."""

    def __init__(self, holder_kind: str, holder: str, expire_time: str) -> None:
        super().__init__(holder_kind)
        self.holder_kind = holder_kind
        self.holder = holder
        self.expire_time = expire_time


class TranscriptClient:
    """Stubs over one channel, owned by the compaction process."""

    def __init__(self, address: str, token: str, timeout_seconds: float, max_message_bytes: int) -> None:
        self._channel = open_channel(address, max_message_bytes)
        self._stub = api_grpc.TranscriptServiceStub(self._channel)
        self._token = token
        self._timeout = timeout_seconds

    @property
    def stub(self) -> api_grpc.TranscriptServiceStub:
        """The raw stub, for the session-events stream."""
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

    async def get_session(self, user: str, session_id: str) -> tpb.Session:
        """The session, if `user` owns it (transcript's NOT_FOUND / PERMISSION_DENIED otherwise)."""
        response: api.GetSessionResponse = await self._call(
            self._stub.GetSession, api.GetSessionRequest(session_id=session_id), user
        )
        return response.session

    async def get_message(self, user: str, session_id: str, message_id: int) -> tpb.Message | None:
        """One message by id (deleted ones too), or None when transcript has no such message."""
        try:
            response: api.GetMessageResponse = await self._call(
                self._stub.GetMessage, api.GetMessageRequest(session_id=session_id, message_id=message_id), user
            )
        except TranscriptRefused as refused:
            if _refused_for(refused, transcript_reasons.MESSAGE_NOT_FOUND):
                return None
            raise
        return response.message

    async def list_after(
        self, user: str, session_id: str, after_message_id: int, max_message_bytes: int
    ) -> tuple[list[tpb.Message], frozenset[int]]:
        """Every live message with id > `after_message_id`, ascending; no cap on their number (seed 001
        §7.3), each clipped to `max_message_bytes` of text as its page arrives (see `history.clip`).
        Returns them and the ids of those that were clipped."""
        messages: list[tpb.Message] = []
        clipped: set[int] = set()
        token = ""
        while True:
            request = api.ListMessagesAfterRequest(
                session_id=session_id, after_message_id=after_message_id, page_size=PAGE_SIZE, page_token=token
            )
            response = await self._call(self._stub.ListMessagesAfter, request, user)
            for message in response.messages:
                kept = clip(message, max_message_bytes)
                if kept is not message:
                    clipped.add(message.message_id)
                messages.append(kept)
            token = response.next_page_token
            if not token:
                return messages, frozenset(clipped)

    async def set_fence(
        self, user: str, session_id: str, message_id: int, generation: int, expected_fence: int
    ) -> None:
        """Move transcript's edit fence from `expected_fence` up to `message_id`, unless the history was
        rewritten since `generation` (`HistoryRewritten`) or another compaction moved it (`FenceMoved`)."""
        request = api.SetCompactionFenceRequest(
            session_id=session_id,
            message_id=message_id,
            expected_history_generation=generation,
            expected_fence_message_id=expected_fence,
        )
        try:
            await self._call(self._stub.SetCompactionFence, request, user)
        except TranscriptRefused as refused:
            if _refused_for(refused, transcript_reasons.HISTORY_REWRITTEN):
                raise HistoryRewritten(session_id) from refused
            if _refused_for(refused, transcript_reasons.COMPACTION_FENCE_MOVED):
                raise FenceMoved(session_id) from refused
            raise

    async def acquire_compaction_claim(self, user: str, session_id: str, holder: str, ttl_seconds: float) -> str:
        """Take the session's `compaction` claim; `SessionRunning` when a turn or another holder has it."""
        request = api.AcquireClaimsRequest(
            session_ids=[session_id], kind=tpb.CLAIM_KIND_COMPACTION, holder=holder, ttl=_duration(ttl_seconds)
        )
        try:
            response: api.AcquireClaimsResponse = await self._call(self._stub.AcquireClaims, request, user)
        except TranscriptRefused as refused:
            if _refused_for(refused, transcript_reasons.SESSION_ALREADY_RUNNING, transcript_reasons.SESSION_BUSY):
                found = refused.metadata
                raise SessionRunning(
                    found.get("holder_kind", ""), found.get("holder", ""), found.get("expire_time", "")
                ) from refused
            raise
        return response.claim.claim_id

    async def renew_claim(self, user: str, claim_id: str, ttl_seconds: float) -> None:
        """Extend a held claim's lease."""
        request = api.RenewClaimsRequest(claim_id=claim_id, ttl=_duration(ttl_seconds))
        await self._call(self._stub.RenewClaims, request, user)

    async def release_holder_claims(self, holder: str) -> list[str]:
        """Release every `compaction` claim `holder` took, whoever's sessions they hold; their ids."""
        request = api.ReleaseHolderClaimsRequest(holder=holder, kind=tpb.CLAIM_KIND_COMPACTION)
        response: api.ReleaseHolderClaimsResponse = await self._call(self._stub.ReleaseHolderClaims, request, None)
        return list(response.claim_ids)

    async def release_claim(self, user: str, claim_id: str) -> None:
        """Release a claim (releasing an expired one succeeds)."""
        await self._call(self._stub.ReleaseClaims, api.ReleaseClaimsRequest(claim_id=claim_id), user)

    async def publish_events(self, user: str, session_id: str, events: Sequence[fpb.RuntimeEvent]) -> None:
        """Publish runtime events (compaction start/end/marker, context window) into the Follow stream."""
        operations = [api.BatchOperation(event=event) for event in events]
        await self._call(
            self._stub.PublishBatch, api.PublishBatchRequest(session_id=session_id, operations=operations), user
        )


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(round(seconds * 1000))
    return duration
