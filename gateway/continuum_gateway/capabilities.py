"""The protocol capabilities the gateway speaks, and the route advertising them.

GET /v1/capabilities   200 {"capabilities": ["transcript-v2", "history-outline-v1", "compaction-v1", "agent-v1"]}

``transcript-v2``       the Follow WebSocket (`continuum_gateway.follow`); a browser must name it in
                        its hello, and one that does not is refused with UPGRADE_REQUIRED.
``history-outline-v1``  GET /session-history/outline (`continuum_gateway.outline`); answered with
                        ``"status": "unsupported"`` unless the browser advertises it.
``compaction-v1``       the compaction routes (`continuum_gateway.compaction`): the session's summary,
                        its compaction events, and ``:compactNow``.
``agent-v1``            the turn routes of the reference agent runtime (`continuum_gateway.turns`);
                        advertised only when the gateway is given the agent's address.

The names are the `wire_name`s of continuum.capability.v1.Capability. Like every route outside the
probes, it needs a bearer token.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from continuum_gateway.proto_schema import JsonSchema, SchemaBuilder
from continuum_gateway.routing import Operation, resource
from continuum_gateway.upstream import upstreams_of
from continuum_runtime.capabilities import AGENT_V1, COMPACTION_V1, HISTORY_OUTLINE_V1, TRANSCRIPT_V2

ADVERTISED = (TRANSCRIPT_V2, HISTORY_OUTLINE_V1, COMPACTION_V1)
# Advertised only when the gateway has an agent to send turns to.
OPTIONAL = (AGENT_V1,)


async def list_capabilities(request: Request) -> Response:
    """Every capability the gateway (and the services behind it) support."""
    names = list(ADVERTISED)
    if upstreams_of(request).agent is not None:
        names.append(AGENT_V1)
    return JSONResponse({"capabilities": names})


def capabilities_schema(schemas: SchemaBuilder) -> JsonSchema:
    """What `list_capabilities` answers."""
    names = {"type": "string", "enum": [*ADVERTISED, *OPTIONAL]}
    return {
        "type": "object",
        "properties": {"capabilities": {"type": "array", "items": names}},
        "required": ["capabilities"],
        "additionalProperties": False,
    }


ROUTES = [
    resource("/v1/capabilities", "capabilities", {"GET": Operation(list_capabilities, response=capabilities_schema)})
]
