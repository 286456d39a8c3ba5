"""Handoff-read's only way to merge's data: its gRPC contract (GetHandoffBinding), for the acting user."""

from __future__ import annotations

import grpc

from continuum.merge.v1 import error_reason_pb2 as merge_reasons
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum_handoff_read.errors import MergeUnavailable, PermissionDenied, Relayed
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.errors import error_details

_NOT_FOUND = merge_reasons.ErrorReason.Name(merge_reasons.MERGE_OPERATION_NOT_FOUND)
_PERMISSION_DENIED = merge_reasons.ErrorReason.Name(merge_reasons.MERGE_PERMISSION_DENIED)


class MergeClient:
    """One channel to merge, owned by the handoff-read process."""

    def __init__(self, address: str, token: str, timeout_seconds: float, max_message_bytes: int) -> None:
        self._channel = open_channel(address, max_message_bytes)
        self._stub = api_grpc.MergeServiceStub(self._channel)
        self._token = token
        self._timeout = timeout_seconds

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def binding(self, user: str, target_session_id: str) -> api.GetHandoffBindingResponse | None:
        """The operation publishing `target_session_id`, or None when no operation names it;
        HANDOFF_PERMISSION_DENIED when it is another user's."""
        request = api.GetHandoffBindingRequest(target_session_id=target_session_id)
        try:
            response: api.GetHandoffBindingResponse = await self._stub.GetHandoffBinding(
                request, metadata=call_metadata(self._token, user), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MergeUnavailable("merge is unavailable; nothing was read") from error
            details = error_details(error)
            if details.reason == _NOT_FOUND:
                return None
            if details.reason == _PERMISSION_DENIED:
                raise PermissionDenied("the merge operation belongs to another user") from error
            raise Relayed(details) from error
        return response
