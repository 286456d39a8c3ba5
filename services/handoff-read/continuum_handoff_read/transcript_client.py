"""Handoff-read's only way to transcript's data: its gRPC contract, called on behalf of the acting user.

Every failure becomes a handoff-read error here, so callers never see a raw `AioRpcError`.
"""

from __future__ import annotations

import grpc

from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_handoff_read.errors import PermissionDenied, Relayed, TranscriptUnavailable
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details

_SESSION_NOT_FOUND = transcript_reasons.ErrorReason.Name(transcript_reasons.SESSION_NOT_FOUND)
_SESSION_PERMISSION_DENIED = transcript_reasons.ErrorReason.Name(transcript_reasons.SESSION_PERMISSION_DENIED)


class TranscriptClient:
    """One channel to transcript, owned by the handoff-read process."""

    def __init__(self, address: str, token: str, timeout_seconds: float, max_message_bytes: int) -> None:
        self._channel = open_channel(address, max_message_bytes)
        self._stub = api_grpc.TranscriptServiceStub(self._channel)
        self._token = token
        self._timeout = timeout_seconds

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def run_root(self, user: str, run_id: str) -> str:
        """The root session of `user`'s live run `run_id` (transcript's RUN_NOT_FOUND / RUN_AMBIGUOUS,
        relayed, otherwise: a run that ended, never existed or is another user's)."""
        try:
            response: api.GetRunResponse = await self._stub.GetRun(
                api.GetRunRequest(run_id=run_id), metadata=call_metadata(self._token, user), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            raise _translated(error) from error
        return response.root_session_id

    async def live_session(self, user: str, session_id: str) -> tpb.Session | None:
        """The live session, or None when transcript has none by that id (never created, or deleted);
        HANDOFF_PERMISSION_DENIED when it is another user's."""
        request = api.GetSessionRequest(session_id=session_id)
        try:
            response: api.GetSessionResponse = await self._stub.GetSession(
                request, metadata=call_metadata(self._token, user), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            refused = _translated(error)
            if refused.reason == _SESSION_NOT_FOUND:
                return None
            if refused.reason == _SESSION_PERMISSION_DENIED:
                raise PermissionDenied("the session belongs to another user") from error
            raise refused from error
        return response.session


def _translated(error: grpc.aio.AioRpcError) -> TranscriptUnavailable | Relayed:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return TranscriptUnavailable("transcript is unavailable; nothing was read")
    return Relayed(error_details(error))
