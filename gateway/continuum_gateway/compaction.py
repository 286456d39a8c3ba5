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

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import resources_pb2
from continuum_gateway.proto_schema import Direction, JsonSchema, SchemaBuilder
from continuum_gateway.protojson import json_response, to_json
from continuum_gateway.routing import Operation, bind, resource
from continuum_gateway.upstream import call_compaction


async def get_compaction_summary(request: Request) -> Response:
    """The session's current summary; ``{"data": null}`` (not an error) when it has none."""
    message = await bind(request, api.GetCompactionSummaryRequest())
    response: api.GetCompactionSummaryResponse = await call_compaction(
        request, lambda c: c.GetCompactionSummary, message
    )
    return JSONResponse({"data": to_json(response.summary) if response.HasField("summary") else None})


def summary_schema(schemas: SchemaBuilder) -> JsonSchema:
    """What `get_compaction_summary` answers."""
    summary = schemas.message(resources_pb2.CompactionSummary.DESCRIPTOR, Direction.OUTPUT)
    return {
        "type": "object",
        "properties": {
            "data": {"anyOf": [summary, {"type": "null"}], "description": "The summary; null when there is none yet."}
        },
        "required": ["data"],
        "additionalProperties": False,
    }


async def list_compaction_events(request: Request) -> Response:
    """A page of the session's compaction attempts, newest first."""
    message = await bind(request, api.ListCompactionEventsRequest())
    return json_response(await call_compaction(request, lambda c: c.ListCompactionEvents, message))


async def compact_now(request: Request) -> Response:
    """Compact the idle session now, or queue compaction for its running turn."""
    message = await bind(request, api.CompactNowRequest())
    return json_response(await call_compaction(request, lambda c: c.CompactNow, message))


_SESSION_ID = {"session_id": "sessionId"}

ROUTES = [
    resource(
        "/v1/sessions/{session_id}/compaction",
        "compaction",
        {
            "GET": Operation(
                get_compaction_summary,
                request=api.GetCompactionSummaryRequest,
                path=_SESSION_ID,
                response=summary_schema,
            )
        },
    ),
    resource(
        "/v1/sessions/{session_id}/compaction/events",
        "compaction_events",
        {
            "GET": Operation(
                list_compaction_events,
                request=api.ListCompactionEventsRequest,
                path=_SESSION_ID,
                query={"pageSize": "pageSize", "pageToken": "pageToken", "includeSummaryText": "includeSummaryText"},
                response=api.ListCompactionEventsResponse,
            )
        },
    ),
    resource(
        "/v1/sessions/{session_id}/compaction:compactNow",
        "compaction_compact_now",
        {
            "POST": Operation(
                compact_now,
                request=api.CompactNowRequest,
                body="*",
                path=_SESSION_ID,
                response=api.CompactNowResponse,
            )
        },
    ),
]
