"""Session routes, each a thin translation onto one TranscriptService RPC.

POST   /v1/sessions                  CreateSession   (body: CreateSessionRequest; 201, or 200 if it existed)
GET    /v1/sessions                  ListSessions    (?pageSize=&pageToken=&parentSessionId=)
GET    /v1/sessions/{session_id}     GetSession      (?includeDeleted=true|false)
PATCH  /v1/sessions/{session_id}     UpdateSession   (body: Session fields; ?updateMask=title,model)
DELETE /v1/sessions/{session_id}     DeleteSession

`updateMask` names fields, comma-separated, by JSON or proto name (``workingDirectory`` or
``working_directory``; the gateway passes proto names on); transcript decides which may change
(title, model, workingDirectory, memoryInjectionDisabled, metadata) and refuses the rest with 400. For example
``PATCH ...?updateMask=memoryInjectionDisabled`` with ``{"memoryInjectionDisabled": true}`` turns off
long-term memory injection into the session's model requests; the gateway keeps no list of its own.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_gateway.protojson import json_response
from continuum_gateway.routing import Operation, bind, resource
from continuum_gateway.upstream import call_transcript


async def create_session(request: Request) -> Response:
    """Create a session; a caller-chosen id makes the call idempotent."""
    message = await bind(request, api.CreateSessionRequest())
    response: api.CreateSessionResponse = await call_transcript(request, lambda t: t.CreateSession, message)
    location = request.url_for("session", session_id=response.session.session_id).path
    return json_response(response, status_code=201 if response.created else 200, headers={"Location": location})


async def list_sessions(request: Request) -> Response:
    """A page of the user's sessions, newest first."""
    message = await bind(request, api.ListSessionsRequest())
    return json_response(await call_transcript(request, lambda t: t.ListSessions, message))


async def get_session(request: Request) -> Response:
    """One session of the user."""
    message = await bind(request, api.GetSessionRequest())
    return json_response(await call_transcript(request, lambda t: t.GetSession, message))


async def update_session(request: Request) -> Response:
    """Change the session fields named by `updateMask`; the path, not the body, names the session."""
    message = await bind(request, api.UpdateSessionRequest())
    return json_response(await call_transcript(request, lambda t: t.UpdateSession, message))


async def delete_session(request: Request) -> Response:
    """Logically delete a session and its subtree."""
    message = await bind(request, api.DeleteSessionRequest())
    return json_response(await call_transcript(request, lambda t: t.DeleteSession, message))


_SESSION_ID = {"session_id": "sessionId"}

ROUTES = [
    resource(
        "/v1/sessions",
        "sessions",
        {
            "POST": Operation(
                create_session,
                request=api.CreateSessionRequest,
                body="*",
                response=api.CreateSessionResponse,
                statuses={
                    201: "The session was created.",
                    200: "A session with this id and the same parameters existed; it is answered unchanged.",
                },
                response_headers={"Location": "The session's path, `/v1/sessions/{session_id}`."},
            ),
            "GET": Operation(
                list_sessions,
                request=api.ListSessionsRequest,
                query={"pageSize": "pageSize", "pageToken": "pageToken", "parentSessionId": "parentSessionId"},
                response=api.ListSessionsResponse,
            ),
        },
    ),
    resource(
        "/v1/sessions/{session_id}",
        "session",
        {
            "GET": Operation(
                get_session,
                request=api.GetSessionRequest,
                path=_SESSION_ID,
                query={"includeDeleted": "includeDeleted"},
                response=api.GetSessionResponse,
            ),
            "PATCH": Operation(
                update_session,
                request=api.UpdateSessionRequest,
                body="session",
                path={"session_id": "session.sessionId"},
                query={"updateMask": "updateMask"},
                response=api.UpdateSessionResponse,
            ),
            "DELETE": Operation(
                delete_session, request=api.DeleteSessionRequest, path=_SESSION_ID, response=api.DeleteSessionResponse
            ),
        },
    ),
]
