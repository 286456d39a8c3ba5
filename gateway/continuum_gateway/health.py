"""Probes, open without credentials.

GET /healthz  200 {"status": "ok"} while the process serves HTTP (liveness).
GET /readyz   200 {"status": "ok", "upstreams": {"transcript": "SERVING", "compaction": "SERVING"}}
              when every upstream reports SERVING on the standard gRPC health service; otherwise
              503 UNAVAILABLE (AIP-193) whose ErrorInfo metadata gives each upstream's status
              (readiness).
"""

from __future__ import annotations

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from continuum_gateway.errors import DOMAIN, error_response
from continuum_gateway.upstream import SERVING, upstreams_of


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


ROUTES = [Route("/healthz", healthz, methods=["GET"]), Route("/readyz", readyz, methods=["GET"])]
