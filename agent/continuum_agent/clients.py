"""The agent's only way to transcript and compaction: their gRPC contracts, called for the acting user.

Every failure becomes an agent error here, so callers never see a raw `AioRpcError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import Message as ProtoMessage

from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.compaction.v1 import compaction_service_pb2_grpc as capi_grpc
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_agent.errors import AgentError, CompactionUnavailable, TranscriptUnavailable, UpstreamRefused
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details

R = TypeVar("R")


class Upstreams:
    """Stubs over one channel to transcript and one to compaction, owned by the agent process."""

    def __init__(
        self,
        transcript_address: str,
        compaction_address: str,
        token: str,
        transcript_timeout: float,
        compaction_timeout: float,
        max_message_bytes: int,
    ) -> None:
        self._transcript_channel = open_channel(transcript_address, max_message_bytes)
        self._compaction_channel = open_channel(compaction_address, max_message_bytes)
        self._transcript = api_grpc.TranscriptServiceStub(self._transcript_channel)
        self._compaction = capi_grpc.CompactionServiceStub(self._compaction_channel)
        self._token = token
        self._transcript_timeout = transcript_timeout
        self._compaction_timeout = compaction_timeout

    async def close(self) -> None:
        """Close both channels."""
        await self._transcript_channel.close()
        await self._compaction_channel.close()

    async def _call(
        self,
        rpc: Callable[..., Awaitable[R]],
        request: ProtoMessage,
        user: str,
        deadline: float,
        unavailable: type[AgentError],
    ) -> R:
        try:
            return await rpc(request, metadata=call_metadata(self._token, user), timeout=deadline)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise unavailable("an upstream service is unavailable; nothing was changed") from error
            raise UpstreamRefused(error_details(error)) from error

    async def _transcript_call(self, rpc: Callable[..., Awaitable[R]], request: ProtoMessage, user: str) -> R:
        return await self._call(rpc, request, user, self._transcript_timeout, TranscriptUnavailable)

    async def get_session(self, user: str, session_id: str) -> tpb.Session:
        """The session, if `user` owns it (transcript's NOT_FOUND / PERMISSION_DENIED otherwise)."""
        response: api.GetSessionResponse = await self._transcript_call(
            self._transcript.GetSession, api.GetSessionRequest(session_id=session_id), user
        )
        return response.session

    async def acquire_run_claim(self, user: str, session_id: str, holder: str, ttl_seconds: float) -> str:
        """Take the session's RUN claim; transcript's SESSION_ALREADY_RUNNING / SESSION_BUSY otherwise."""
        request = api.AcquireClaimsRequest(
            session_ids=[session_id], kind=tpb.CLAIM_KIND_RUN, holder=holder, ttl=_duration(ttl_seconds)
        )
        response: api.AcquireClaimsResponse = await self._transcript_call(self._transcript.AcquireClaims, request, user)
        return response.claim.claim_id

    async def renew_claim(self, user: str, claim_id: str, ttl_seconds: float) -> None:
        """Extend a held claim's lease."""
        request = api.RenewClaimsRequest(claim_id=claim_id, ttl=_duration(ttl_seconds))
        await self._transcript_call(self._transcript.RenewClaims, request, user)

    async def release_claim(self, user: str, claim_id: str) -> None:
        """Release a claim (releasing an expired one succeeds)."""
        await self._transcript_call(self._transcript.ReleaseClaims, api.ReleaseClaimsRequest(claim_id=claim_id), user)

    async def append(self, user: str, session_id: str, *messages: tpb.NewMessage) -> list[int]:
        """Append messages in one batch; their ids."""
        request = api.AppendMessagesRequest(session_id=session_id, messages=list(messages))
        response: api.AppendMessagesResponse = await self._transcript_call(
            self._transcript.AppendMessages, request, user
        )
        return list(response.message_ids)

    async def open_attempt(self, user: str, session_id: str, attempt: fpb.AttemptRef) -> None:
        """Open a sampling attempt (its chunks are shown live)."""
        request = api.OpenAttemptRequest(session_id=session_id, attempt=attempt)
        await self._transcript_call(self._transcript.OpenAttempt, request, user)

    async def append_chunks(
        self, user: str, session_id: str, attempt: fpb.AttemptRef, first_index: int, chunks: list[str]
    ) -> int:
        """Stream pieces of the attempt's text; the next chunk index."""
        request = api.AppendChunksRequest(
            session_id=session_id, attempt=attempt, first_chunk_index=first_index, chunks=chunks
        )
        response: api.AppendChunksResponse = await self._transcript_call(self._transcript.AppendChunks, request, user)
        return response.next_chunk_index

    async def commit_attempt(self, user: str, session_id: str, attempt: fpb.AttemptRef, message: tpb.NewMessage) -> int:
        """Store the attempt's complete ASSISTANT message; its id."""
        request = api.CommitAttemptRequest(session_id=session_id, attempt=attempt, message=message)
        response: api.CommitAttemptResponse = await self._transcript_call(self._transcript.CommitAttempt, request, user)
        return response.message_id

    async def cancel_attempt(self, user: str, session_id: str, attempt: fpb.AttemptRef) -> int:
        """Store what the attempt displayed as an interrupted message; its id."""
        request = api.CancelAttemptRequest(session_id=session_id, attempt=attempt)
        response: api.CancelAttemptResponse = await self._transcript_call(self._transcript.CancelAttempt, request, user)
        return response.message_id

    async def build_context(self, user: str, request: capi.BuildContextRequest) -> capi.BuildContextResponse:
        """Compaction's context for the next model request (compacting first when due)."""
        response: capi.BuildContextResponse = await self._call(
            self._compaction.BuildContext, request, user, self._compaction_timeout, CompactionUnavailable
        )
        return response


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(round(seconds * 1000))
    return duration
