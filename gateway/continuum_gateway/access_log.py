"""One log line per request, and the last-resort answer to an unexpected exception.

The line carries method, route template, status, duration and user id: never the query string
(page tokens), headers (bearer tokens) or bodies (message content).
"""

from __future__ import annotations

import logging
import time

from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from continuum_gateway.auth import request_user
from continuum_gateway.errors import internal_error_response

logger = logging.getLogger("continuum.gateway.access")


class AccessLogMiddleware:
    """Pure ASGI middleware; outermost of the gateway's own, so it sees every response (401s included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request, log its outcome, and answer a bare 500 if it raised unexpectedly."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        except Exception:
            # The runtime's JSON log formatter records the exception type only: exception messages
            # can quote request content.
            logger.exception("request failed", extra=_fields(scope))
            if status is not None:
                # Headers are out; all that is left is to let the server drop the connection.
                raise
            status = 500
            await internal_error_response()(scope, receive, send)
        finally:
            duration_ms = round((time.perf_counter() - started) * 1000, 1)
            logger.info("request", extra={**_fields(scope), "status": status, "duration_ms": duration_ms})


def _fields(scope: Scope) -> dict[str, object]:
    route = scope.get("route")
    return {
        "method": scope["method"],
        # The template (/v1/sessions/{session_id}) groups requests; the ids are in `path_params`.
        "route": route.path if isinstance(route, Route) else None,
        "path": scope["path"],
        "user": request_user(scope),
    }
