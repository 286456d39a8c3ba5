"""AgentService handlers: validate, delegate to the runner, convert.

Handlers raise AgentError; the runtime's interceptor maps it to a status. None sets codes.
"""

from __future__ import annotations

from typing import TypeAlias

import grpc

from continuum.agent.v1 import agent_service_pb2 as api
from continuum.agent.v1 import agent_service_pb2_grpc as api_grpc
from continuum_agent import validation
from continuum_agent.runner import TurnRunner
from continuum_runtime.auth import acting_user

Context: TypeAlias = grpc.aio.ServicerContext


class AgentServicer(api_grpc.AgentServiceServicer):
    """The gRPC face of the agent."""

    def __init__(self, runner: TurnRunner) -> None:
        self._runner = runner

    async def StartTurn(self, request: api.StartTurnRequest, context: Context) -> api.StartTurnResponse:
        user = acting_user(context)
        session_id = validation.session_id(request.session_id)
        text = validation.text(request.text)
        client_request_id = validation.client_request_id(request.client_request_id)
        started = await self._runner.start(user, session_id, text, client_request_id)
        return api.StartTurnResponse(run_id=started.run_id, user_message_id=started.user_message_id)

    async def StopTurn(self, request: api.StopTurnRequest, context: Context) -> api.StopTurnResponse:
        user = acting_user(context)
        session_id = validation.session_id(request.session_id)
        return api.StopTurnResponse(stopped=await self._runner.stop(user, session_id))
