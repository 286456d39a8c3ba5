"""Compaction routes (``compaction-v1``), each a thin translation onto one CompactionService RPC.

    GET  /v1/sessions/{session_id}/compaction                 GetCompactionSummary
         200 {"data": CompactionSummary} or {"data": null} when the session has no summary yet
    GET  /v1/sessions/{session_id}/compaction/events          ListCompactionEvents
         ?pageSize=&pageToken=&includeSummaryText=true|false
         200 {"events": [CompactionEvent, ...], "nextPageToken": "..."}, newest first
    POST /v1/sessions/{session_id}/compaction:compactNow      CompactNow
         optional body {"contextWindowTokens": "128000"}
         200 {"state": "COMPACT_NOW_STATE_COMPLETED" | "..._QUEUED" | "..._IN_PROGRESS",
              "report": CompactionReport (when it ran), "runId": "..." (the running turn, when QUEUED)}

Every call acts for the authenticated browser user; compaction (through transcript) decides whether
the user owns the session, so another user's session is 403 and an unknown one 404, as on the
session routes. Messages are proto JSON like every `/v1` route: int64 values (message ids, token
counts) are strings, enums their proto names, timestamps RFC 3339. ``:compactNow`` is an AIP-136
custom method, matched literally like ``messages:page``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from continuum.compaction.v1 import compaction_service_pb2
from continuum_gateway.protojson import bind_query, json_response, parse_body, to_json
from continuum_gateway.routing import resource
from continuum_gateway.upstream import call_compaction


async def get_compaction_summary(request: Request) -> Response:
    """The session's current summary; ``{"data": null}`` (not an error) when it has none."""
    message = bind_query(
        request, compaction_service_pb2.GetCompactionSummaryRequest(session_id=request.path_params["session_id"]), {}
    )
    response: compaction_service_pb2.GetCompactionSummaryResponse = await call_compaction(
        request, lambda c: c.GetCompactionSummary, message
    )
    return JSONResponse({"data": to_json(response.summary) if response.HasField("summary") else None})


async def list_compaction_events(request: Request) -> Response:
    """A page of the session's compaction attempts, newest first."""
    message = bind_query(
        request,
        compaction_service_pb2.ListCompactionEventsRequest(session_id=request.path_params["session_id"]),
        {"pageSize": "pageSize", "pageToken": "pageToken", "includeSummaryText": "includeSummaryText"},
    )
    return json_response(await call_compaction(request, lambda c: c.ListCompactionEvents, message))


async def compact_now(request: Request) -> Response:
    """Compact the idle session now, or queue compaction for its running turn."""
    message = await parse_body(request, compaction_service_pb2.CompactNowRequest())
    # The path names the session, whatever the body says.
    message.session_id = request.path_params["session_id"]
    bind_query(request, message, {})
    return json_response(await call_compaction(request, lambda c: c.CompactNow, message))


ROUTES = [
    resource("/v1/sessions/{session_id}/compaction", "compaction", {"GET": get_compaction_summary}),
    resource("/v1/sessions/{session_id}/compaction/events", "compaction_events", {"GET": list_compaction_events}),
    resource("/v1/sessions/{session_id}/compaction:compactNow", "compaction_compact_now", {"POST": compact_now}),
]
