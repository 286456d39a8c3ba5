"""Turn routes (``agent-v1``) of the reference agent runtime, each a thin translation onto one RPC.

    POST /v1/sessions/{session_id}/turns         StartTurn
         body {"text": "...", "clientRequestId": "..." (optional: a retry with it gets the first answer)}
         202 {"runId": "...", "userMessageId": "..."}: the turn runs in the background; follow the
             session's live transcript to see it. 409 SESSION_ALREADY_RUNNING while a turn (or a
             merge or compaction) holds the session.
    POST /v1/sessions/{session_id}/turns:stop    StopTurn
         200 {"stopped": true} once the running turn settled (what was displayed is stored as
             interrupted); {"stopped": false} when none was running. No body.

Served only when the gateway is given the agent's address (GATEWAY_AGENT_ADDRESS); the `agent-v1`
capability says so. Every call acts for the authenticated user; transcript decides ownership (403 for
another user's session, 404 for an unknown one).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from continuum.agent.v1 import agent_service_pb2 as api
from continuum_gateway.protojson import json_response
from continuum_gateway.routing import Operation, bind, resource
from continuum_gateway.settings import GatewaySettings
from continuum_gateway.upstream import call_agent


async def start_turn(request: Request) -> Response:
    """Store the user's message and start the agent's turn in the background."""
    message = await bind(request, api.StartTurnRequest())
    response: api.StartTurnResponse = await call_agent(request, lambda a: a.StartTurn, message)
    return json_response(response, status_code=202)


async def stop_turn(request: Request) -> Response:
    """Stop the session's running turn."""
    message = await bind(request, api.StopTurnRequest())
    return json_response(await call_agent(request, lambda a: a.StopTurn, message))


_SESSION_ID = {"session_id": "sessionId"}


def routes(settings: GatewaySettings) -> list[BaseRoute]:
    """The turn routes, when the gateway has an agent to send turns to."""
    if not settings.agent_address:
        return []
    return [
        resource(
            "/v1/sessions/{session_id}/turns",
            "turns",
            {
                "POST": Operation(
                    start_turn,
                    request=api.StartTurnRequest,
                    body="*",
                    path=_SESSION_ID,
                    response=api.StartTurnResponse,
                    statuses={202: "Accepted: the turn runs in the background"},
                    errors={
                        400: "Malformed request (INVALID_ARGUMENT, naming the field).",
                        401: "No valid bearer token.",
                        403: "The session belongs to another user.",
                        404: "No such session.",
                        409: "The session is running a turn, a merge or a compaction (SESSION_ALREADY_RUNNING).",
                        503: "The agent or transcript is unavailable; retry later.",
                    },
                )
            },
        ),
        resource(
            "/v1/sessions/{session_id}/turns:stop",
            "turns_stop",
            {
                "POST": Operation(
                    stop_turn, request=api.StopTurnRequest, path=_SESSION_ID, response=api.StopTurnResponse
                )
            },
        ),
    ]
