"""The protocol capabilities the gateway speaks, and the route advertising them.

GET /v1/capabilities   200 {"capabilities": ["transcript-v2", "history-outline-v1", "compaction-v1",
                                             "merge-v2", "agent-v1"]}

``transcript-v2``       the Follow WebSocket (`continuum_gateway.follow`); a browser must name it in
                        its hello, and one that does not is refused with UPGRADE_REQUIRED.
``history-outline-v1``  GET /session-history/outline (`continuum_gateway.outline`); answered with
                        ``"status": "unsupported"`` unless the browser advertises it.
``compaction-v1``       the compaction routes (`continuum_gateway.compaction`): the session's summary,
                        its compaction events, and ``:compactNow``.
``merge-v2``            the session merge routes (`continuum_gateway.merges`); advertised (and
                        served) only when the gateway has a merge address.
``agent-v1``            the turn routes of the reference agent runtime (`continuum_gateway.turns`);
                        advertised only when the gateway is given the agent's address.

The names are the `wire_name`s of continuum.capability.v1.Capability. Like every route outside the
probes, it needs a bearer token.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from continuum_gateway.proto_schema import JsonSchema, SchemaBuilder
from continuum_gateway.routing import Operation, Resource, resource
from continuum_gateway.settings import GatewaySettings
from continuum_runtime.wire_names import AGENT_V1, COMPACTION_V1, HISTORY_OUTLINE_V1, MERGE_V2, TRANSCRIPT_V2


def advertised(settings: GatewaySettings) -> tuple[str, ...]:
    """Every capability a gateway with `settings` (and the services behind it) supports."""
    return (
        TRANSCRIPT_V2,
        HISTORY_OUTLINE_V1,
        COMPACTION_V1,
        # Only with the service behind them: the merge routes and the reference agent's turn routes.
        *((MERGE_V2,) if settings.merge_address else ()),
        *((AGENT_V1,) if settings.agent_address else ()),
    )


def routes(settings: GatewaySettings) -> list[Resource]:
    """The capabilities route of a gateway with `settings`."""
    names = advertised(settings)

    async def list_capabilities(request: Request) -> Response:
        """Every capability the gateway (and the services behind it) support."""
        return JSONResponse({"capabilities": list(names)})

    def capabilities_schema(schemas: SchemaBuilder) -> JsonSchema:
        """What `list_capabilities` answers."""
        return {
            "type": "object",
            "properties": {"capabilities": {"type": "array", "items": {"type": "string", "enum": list(names)}}},
            "required": ["capabilities"],
            "additionalProperties": False,
        }

    return [
        resource(
            "/v1/capabilities", "capabilities", {"GET": Operation(list_capabilities, response=capabilities_schema)}
        )
    ]
