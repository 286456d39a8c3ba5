"""Probes, open without credentials.

GET /healthz  200 {"status": "ok"} while the process serves HTTP (liveness).
GET /readyz   200 {"status": "ok", "upstreams": {"transcript": "SERVING", "compaction": "SERVING"}}
              (and "merge" / "agent" when the gateway has their addresses)
              when every upstream reports SERVING on the standard gRPC health service; otherwise
              503 UNAVAILABLE (AIP-193) whose ErrorInfo metadata gives each upstream's status
              (readiness).
"""

from __future__ import annotations

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from continuum_gateway.errors import DOMAIN, error_response
from continuum_gateway.proto_schema import JsonSchema, SchemaBuilder
from continuum_gateway.routing import Operation, resource
from continuum_gateway.upstream import SERVING, UPSTREAM_NAMES, upstreams_of


async def healthz(request: Request) -> Response:
    """Liveness: the process answers HTTP."""
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    """Readiness: every upstream answers its health check with SERVING."""
    statuses = await upstreams_of(request).readiness()
    down = sorted(name for name, status in statuses.items() if status != SERVING)
    if not down:
        return JSONResponse({"status": "ok", "upstreams": statuses})
    return error_response(
        grpc.StatusCode.UNAVAILABLE,
        "not ready: " + ", ".join(f"{name} is {statuses[name]}" for name in down),
        reason="UPSTREAM_NOT_READY",
        domain=DOMAIN,
        metadata=statuses,
    )


_OK: JsonSchema = {"type": "string", "const": "ok"}


def healthz_schema(schemas: SchemaBuilder) -> JsonSchema:
    """What `healthz` answers."""
    return {"type": "object", "properties": {"status": _OK}, "required": ["status"], "additionalProperties": False}


def readyz_schema(schemas: SchemaBuilder) -> JsonSchema:
    """What `readyz` answers when ready."""
    upstreams = {"type": "object", "properties": {name: {"type": "string"} for name in UPSTREAM_NAMES}}
    return {
        "type": "object",
        "properties": {"status": _OK, "upstreams": upstreams},
        "required": ["status", "upstreams"],
        "additionalProperties": False,
    }


ROUTES = [
    resource("/healthz", "healthz", {"GET": Operation(healthz, response=healthz_schema, errors={}, public=True)}),
    resource(
        "/readyz",
        "readyz",
        {
            "GET": Operation(
                readyz,
                response=readyz_schema,
                statuses={200: "Every upstream is SERVING."},
                errors={503: "An upstream is not ready; the ErrorInfo metadata gives each upstream's status."},
                public=True,
            )
        },
    ),
]
