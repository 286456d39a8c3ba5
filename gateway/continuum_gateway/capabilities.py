"""The protocol capabilities the gateway speaks, and the route advertising them.

GET /v1/capabilities   200 {"capabilities": ["transcript-v2", "history-outline-v1", "compaction-v1"]}

``transcript-v2``       the Follow WebSocket (`continuum_gateway.follow`); a browser must name it in
                        its hello, and one that does not is refused with UPGRADE_REQUIRED.
``history-outline-v1``  GET /session-history/outline (`continuum_gateway.outline`); answered with
                        ``"status": "unsupported"`` unless the browser advertises it.
``compaction-v1``       the compaction routes (`continuum_gateway.compaction`): the session's summary,
                        its compaction events, and ``:compactNow``.
``merge-v2``            session merges; advertised only when the deployment runs merge
                        (``GATEWAY_MERGE_ADDRESS`` is set).

The names are the `wire_name`s of continuum.capability.v1.Capability. Like every route outside the
probes, it needs a bearer token.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from continuum_gateway.proto_schema import JsonSchema, SchemaBuilder
from continuum_gateway.routing import Operation, Resource, resource
from continuum_gateway.settings import GatewaySettings
from continuum_runtime.capabilities import COMPACTION_V1, HISTORY_OUTLINE_V1, MERGE_V2, TRANSCRIPT_V2

ALWAYS = (TRANSCRIPT_V2, HISTORY_OUTLINE_V1, COMPACTION_V1)
# Every capability this gateway can speak, whether or not the deployment runs the service behind it.
KNOWN = (*ALWAYS, MERGE_V2)


def advertised(settings: GatewaySettings) -> tuple[str, ...]:
    """The capabilities of this deployment: merge-v2 only when a merge service is configured."""
    return (*ALWAYS, MERGE_V2) if settings.merge_address else ALWAYS


def capabilities_schema(schemas: SchemaBuilder) -> JsonSchema:
    """What GET /v1/capabilities answers."""
    names = {"type": "string", "enum": list(KNOWN)}
    return {
        "type": "object",
        "properties": {"capabilities": {"type": "array", "items": names}},
        "required": ["capabilities"],
        "additionalProperties": False,
    }


def routes(settings: GatewaySettings) -> list[Resource]:
    """The route advertising this deployment's capabilities."""
    names = list(advertised(settings))

    async def list_capabilities(request: Request) -> Response:
        """Every capability the gateway (and the services behind it) support."""
        return JSONResponse({"capabilities": names})

    return [
        resource(
            "/v1/capabilities", "capabilities", {"GET": Operation(list_capabilities, response=capabilities_schema)}
        )
    ]
