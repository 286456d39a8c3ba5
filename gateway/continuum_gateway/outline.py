"""The durable turn directory (``history-outline-v1``): one thin translation onto GetHistoryOutline.

    GET /session-history/outline?sessionId=&startTurn=&limit=&generation=&snapshotSequence=
        X-Continuum-Capabilities: history-outline-v1

``startTurn`` is one-based (1 when absent), ``limit`` 128 when absent and at most 1000. A first page
has no pin; later pages pass the first response's ``generation`` and ``snapshotSequence`` to keep its
cut. The browser advertises the capability in the ``X-Continuum-Capabilities`` header (a
comma-separated list; the same header on every request, unlike a query parameter). Without it the
answer is still 200, with ``"status": "unsupported"`` and nothing else of note: an explicit refusal,
never a silent empty outline.

The response has the fields of the seed's API, in proto JSON (int64 values as strings)::

    {"status": "ok" | "stale" | "unsupported", "generation": "3", "snapshotSequence": "41",
     "coverageSequence": "41", "totalTurns": 2, "nextTurn": 0, "done": true,
     "entries": [{"messageId": "7", "turn": 1, "position": "0", "prompt": "...", "answer": "...",
                  "finalMessageId": "9", "elapsed": "1.200s", "samplingCount": 1, "toolCallCount": 0}]}

The seed names the Follow stream generation plainly ``generation`` here (the proto calls it
``stream_generation``); the route keeps the seed's names in both directions. ``elapsed`` is a proto
JSON duration (``"1.200s"``).

``answer``, ``samplingCount`` and ``toolCallCount`` appear only when the backend has them (imports
without count records do not invent counts); ``entries`` is ``[]`` when empty. ``status`` is the
lowercase form of the proto's PinStatus. Malformed parameters are 400 like every other route.
"""

from __future__ import annotations

import copy
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from continuum.transcript.v1 import transcript_service_pb2
from continuum_gateway.errors import GatewayError
from continuum_gateway.proto_schema import Direction, JsonSchema, SchemaBuilder, component_name
from continuum_gateway.protojson import to_json
from continuum_gateway.routing import Operation, bind, resource
from continuum_gateway.upstream import call_transcript
from continuum_runtime.wire_names import HISTORY_OUTLINE_V1

CAPABILITIES_HEADER = "X-Continuum-Capabilities"
_PIN_STATUS_PREFIX = "PIN_STATUS_"


def advertised_capabilities(request: Request) -> set[str]:
    """The capabilities a browser names in `CAPABILITIES_HEADER` (every occurrence, comma-separated)."""
    return {item.strip() for value in request.headers.getlist(CAPABILITIES_HEADER) for item in value.split(",")} - {""}


def outline_json(response: transcript_service_pb2.GetHistoryOutlineResponse) -> dict[str, Any]:
    """The browser's form of an outline page: proto JSON, lowercase status, `entries` always present."""
    body = to_json(response)
    body["generation"] = body.pop("streamGeneration")
    body["status"] = str(body["status"]).removeprefix(_PIN_STATUS_PREFIX).lower()
    body.setdefault("entries", [])
    return body


async def history_outline(request: Request) -> Response:
    """A page of the session's turn directory, pinned to the first page's cut when asked."""
    message = await bind(request, transcript_service_pb2.GetHistoryOutlineRequest())
    if not message.session_id:
        raise GatewayError.invalid_argument("sessionId", "is required")
    if HISTORY_OUTLINE_V1 in advertised_capabilities(request):
        message.capabilities.append(HISTORY_OUTLINE_V1)
    response: transcript_service_pb2.GetHistoryOutlineResponse = await call_transcript(
        request, lambda t: t.GetHistoryOutline, message
    )
    return JSONResponse(outline_json(response))


def outline_schema(schemas: SchemaBuilder) -> JsonSchema:
    """What `history_outline` answers: GetHistoryOutlineResponse with the seed's names (`outline_json`)."""
    descriptor = transcript_service_pb2.GetHistoryOutlineResponse.DESCRIPTOR
    schemas.message(descriptor, Direction.OUTPUT)
    schema = copy.deepcopy(schemas.components[component_name(descriptor, Direction.OUTPUT)])
    properties = schema["properties"]
    properties["generation"] = properties.pop("streamGeneration")
    schema["required"] = ["generation" if name == "streamGeneration" else name for name in schema["required"]]
    statuses = [
        value.name.removeprefix(_PIN_STATUS_PREFIX).lower()
        for value in transcript_service_pb2.PinStatus.DESCRIPTOR.values
    ]
    properties["status"] = {
        "type": "string",
        "enum": statuses,
        "description": "`ok`; `stale` (the pinned generation is gone: re-follow for a fresh baseline); "
        f"`unsupported` (the request did not advertise {HISTORY_OUTLINE_V1}).",
    }
    return schema


ROUTES = [
    resource(
        "/session-history/outline",
        "history_outline",
        {
            "GET": Operation(
                history_outline,
                request=transcript_service_pb2.GetHistoryOutlineRequest,
                query={
                    "sessionId": "sessionId",
                    "startTurn": "startTurn",
                    "limit": "limit",
                    "generation": "streamGeneration",
                    "snapshotSequence": "snapshotSequence",
                },
                headers={
                    CAPABILITIES_HEADER: f"Capabilities the client speaks, comma-separated; `{HISTORY_OUTLINE_V1}` "
                    'for an outline (without it the answer is `"status": "unsupported"`).'
                },
                response=outline_schema,
            )
        },
    )
]
