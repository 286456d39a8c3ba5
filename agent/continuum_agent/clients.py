"""The agent's only way to transcript, compaction and handoff-read: their gRPC contracts, called for the
acting user.

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
from continuum.handoff_read.v1 import handoff_read_service_pb2 as hapi
from continuum.handoff_read.v1 import handoff_read_service_pb2_grpc as hapi_grpc
from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_agent.errors import (
    AgentError,
    CompactionUnavailable,
    HandoffReadUnavailable,
    TranscriptUnavailable,
    UpstreamRefused,
)
from continuum_agent.settings import AgentSettings
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details

R = TypeVar("R")
RUN_NOT_FOUND = transcript_reasons.ErrorReason.Name(transcript_reasons.RUN_NOT_FOUND)


class Upstreams:
    """Stubs over one channel each to transcript, compaction and handoff-read, owned by the agent process."""

    def __init__(self, settings: AgentSettings) -> None:
        limit = settings.grpc_max_message_bytes
        self._transcript_channel = open_channel(settings.transcript_address, limit)
        self._compaction_channel = open_channel(settings.compaction_address, limit)
        # Opened lazily by gRPC: an agent that never serves a merged session never connects.
        self._handoff_read_channel = open_channel(settings.handoff_read_address, limit)
        self._transcript = api_grpc.TranscriptServiceStub(self._transcript_channel)
        self._compaction = capi_grpc.CompactionServiceStub(self._compaction_channel)
        self._handoff_read = hapi_grpc.HandoffReadServiceStub(self._handoff_read_channel)
        self._token = settings.service_token.get_secret_value()
        self._transcript_timeout = settings.transcript_timeout_seconds
        self._compaction_timeout = settings.compaction_timeout_seconds
        self._handoff_read_timeout = settings.handoff_read_timeout_seconds

    async def close(self) -> None:
        """Close the channels."""
        await self._transcript_channel.close()
        await self._compaction_channel.close()
        await self._handoff_read_channel.close()

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

    async def run_is_live(self, user: str, run_id: str) -> bool:
        """Whether `run_id` holds an unexpired RUN claim of `user` (transcript's RUN_NOT_FOUND: it does not)."""
        try:
            await self._transcript_call(self._transcript.GetRun, api.GetRunRequest(run_id=run_id), user)
        except UpstreamRefused as refused:
            if refused.reason == RUN_NOT_FOUND:
                return False
            raise
        return True

    async def release_run(self, user: str, run_id: str) -> bool:
        """Release the RUN claim run `run_id` holds, whichever process holds it; False when it held none."""
        request = api.ReleaseHolderClaimsRequest(holder=run_id, kind=tpb.CLAIM_KIND_RUN)
        response: api.ReleaseHolderClaimsResponse = await self._transcript_call(
            self._transcript.ReleaseHolderClaims, request, user
        )
        return bool(response.claim_ids)

    async def append(self, user: str, session_id: str, *messages: tpb.NewMessage) -> list[int]:
        """Append messages in one batch; their ids."""
        request = api.AppendMessagesRequest(session_id=session_id, messages=list(messages))
        response: api.AppendMessagesResponse = await self._transcript_call(
            self._transcript.AppendMessages, request, user
        )
        return list(response.message_ids)

    async def publish(
        self, user: str, session_id: str, operations: list[api.BatchOperation], terminal: bool = False
    ) -> api.PublishBatchResponse:
        """Publish one business batch (messages, runtime state), answered once it is durable."""
        request = api.PublishBatchRequest(
            session_id=session_id, operations=operations, terminal=terminal, wait_durable=True
        )
        response: api.PublishBatchResponse = await self._transcript_call(self._transcript.PublishBatch, request, user)
        return response

    async def latest_messages(
        self, user: str, session_id: str, before_message_id: int, page_size: int
    ) -> api.ListMessagePageResponse:
        """A page of the session's live messages before `before_message_id` (0: the latest), ascending;
        bodies over transcript's inline limit come as stubs (`body_deferred`)."""
        request = api.ListMessagePageRequest(
            session_id=session_id,
            anchor_message_id=before_message_id,
            direction=api.PAGE_DIRECTION_OLDER,
            page_size=page_size,
        )
        response: api.ListMessagePageResponse = await self._transcript_call(
            self._transcript.ListMessagePage, request, user
        )
        return response

    async def get_message(self, user: str, session_id: str, message_id: int) -> tpb.Message:
        """One message, whole."""
        request = api.GetMessageRequest(session_id=session_id, message_id=message_id)
        response: api.GetMessageResponse = await self._transcript_call(self._transcript.GetMessage, request, user)
        return response.message

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

    async def execute_handoff_read(
        self, user: str, run_id: str, arguments_json: str
    ) -> hapi.ExecuteHandoffReadResponse:
        """One HandoffRead tool call of run `run_id` (handoff-read resolves the session from the run)."""
        request = hapi.ExecuteHandoffReadRequest(run_id=run_id, arguments_json=arguments_json)
        response: hapi.ExecuteHandoffReadResponse = await self._call(
            self._handoff_read.ExecuteHandoffRead, request, user, self._handoff_read_timeout, HandoffReadUnavailable
        )
        return response


def _duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromMilliseconds(round(seconds * 1000))
    return duration
