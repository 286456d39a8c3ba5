"""Session routes, each a thin translation onto one TranscriptService RPC.

POST   /v1/sessions                  CreateSession   (body: CreateSessionRequest; 201, or 200 if it existed)
GET    /v1/sessions                  ListSessions    (?pageSize=&pageToken=&parentSessionId=)
GET    /v1/sessions/{session_id}     GetSession      (?includeDeleted=true|false)
PATCH  /v1/sessions/{session_id}     UpdateSession   (body: Session fields; ?updateMask=title,model)
DELETE /v1/sessions/{session_id}     DeleteSession

`updateMask` names proto JSON fields, comma-separated; transcript decides which may change (title,
model, workingDirectory, memoryInjectionDisabled, metadata) and refuses the rest with 400. For example
``PATCH ...?updateMask=memoryInjectionDisabled`` with ``{"memoryInjectionDisabled": true}`` turns off
long-term memory injection into the session's model requests; the gateway keeps no list of its own.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from continuum.transcript.v1 import resources_pb2, transcript_service_pb2
from continuum_gateway.protojson import bind_query, json_response, parse_body
from continuum_gateway.routing import resource
from continuum_gateway.upstream import call_transcript


async def create_session(request: Request) -> Response:
    """Create a session; a caller-chosen id makes the call idempotent."""
    message = await parse_body(request, transcript_service_pb2.CreateSessionRequest())
    response: transcript_service_pb2.CreateSessionResponse = await call_transcript(
        request, lambda t: t.CreateSession, message
    )
    location = request.url_for("session", session_id=response.session.session_id).path
    return json_response(response, status_code=201 if response.created else 200, headers={"Location": location})


async def list_sessions(request: Request) -> Response:
    """A page of the user's sessions, newest first."""
    message = bind_query(
        request,
        transcript_service_pb2.ListSessionsRequest(),
        {"pageSize": "pageSize", "pageToken": "pageToken", "parentSessionId": "parentSessionId"},
    )
    return json_response(await call_transcript(request, lambda t: t.ListSessions, message))


async def get_session(request: Request) -> Response:
    """One session of the user."""
    message = bind_query(
        request,
        transcript_service_pb2.GetSessionRequest(session_id=request.path_params["session_id"]),
        {"includeDeleted": "includeDeleted"},
    )
    return json_response(await call_transcript(request, lambda t: t.GetSession, message))


async def update_session(request: Request) -> Response:
    """Change the session fields named by `updateMask`; the path, not the body, names the session."""
    session = await parse_body(request, resources_pb2.Session())
    session.session_id = request.path_params["session_id"]
    message = bind_query(
        request, transcript_service_pb2.UpdateSessionRequest(session=session), {"updateMask": "updateMask"}
    )
    return json_response(await call_transcript(request, lambda t: t.UpdateSession, message))


async def delete_session(request: Request) -> Response:
    """Logically delete a session and its subtree."""
    message = bind_query(
        request, transcript_service_pb2.DeleteSessionRequest(session_id=request.path_params["session_id"]), {}
    )
    return json_response(await call_transcript(request, lambda t: t.DeleteSession, message))


ROUTES = [
    resource("/v1/sessions", "sessions", {"POST": create_session, "GET": list_sessions}),
    resource(
        "/v1/sessions/{session_id}",
        "session",
        {"GET": get_session, "PATCH": update_session, "DELETE": delete_session},
    ),
]
