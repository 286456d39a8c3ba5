"""MergeService handlers: the acting user, then the operations API.

Handlers raise MergeError; the runtime's interceptor maps it to a status. None sets codes.
"""

from __future__ import annotations

from typing import TypeAlias

import grpc

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum_merge.operations import Operations
from continuum_runtime.auth import acting_user

Context: TypeAlias = grpc.aio.ServicerContext


class MergeServicer(api_grpc.MergeServiceServicer):
    """The gRPC face of merge."""

    def __init__(self, operations: Operations) -> None:
        self._operations = operations

    async def StartMerge(self, request: api.StartMergeRequest, context: Context) -> api.StartMergeResponse:
        return await self._operations.start(acting_user(context), request)

    async def GetMerge(self, request: api.GetMergeRequest, context: Context) -> api.GetMergeResponse:
        return api.GetMergeResponse(operation=await self._operations.get(acting_user(context), request.operation_id))

    async def GetActiveMerge(self, request: api.GetActiveMergeRequest, context: Context) -> api.GetActiveMergeResponse:
        return await self._operations.get_active(acting_user(context))

    async def ResumeMerge(self, request: api.ResumeMergeRequest, context: Context) -> api.ResumeMergeResponse:
        return api.ResumeMergeResponse(operation=await self._operations.resume(acting_user(context), request))

    async def CancelMerge(self, request: api.CancelMergeRequest, context: Context) -> api.CancelMergeResponse:
        operation = await self._operations.cancel(acting_user(context), request.operation_id)
        return api.CancelMergeResponse(operation=operation)

    async def GetHandoffBinding(
        self, request: api.GetHandoffBindingRequest, context: Context
    ) -> api.GetHandoffBindingResponse:
        return await self._operations.handoff_binding(acting_user(context), request.target_session_id)
