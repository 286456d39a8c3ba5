"""A cap on request body size that answers in AIP-193 form (413, INVALID_ARGUMENT, REQUEST_TOO_LARGE).

Starlette's own `max_body_size` replaces the app's response with a plain-text 413 whenever the
declared length is too large, so the gateway enforces the cap itself.
"""

from __future__ import annotations

import grpc
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from continuum_gateway.errors import GatewayError


def too_large(max_bytes: int) -> GatewayError:
    """The refusal of a body over `max_bytes` (413, from the reason)."""
    return GatewayError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request body exceeds {max_bytes} bytes",
        reason="REQUEST_TOO_LARGE",
        metadata={"max_bytes": str(max_bytes)},
    )


class BodyLimitMiddleware:
    """Pure ASGI middleware: refuse a declared Content-Length over the cap before the route runs, and
    stop reading a body (chunked or lying about its length) once it goes over."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Apply the cap to HTTP requests."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def receive_within_limit() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read; the app's GatewayError handler answers.
                    raise too_large(self.max_bytes)
            return message

        await self.app(scope, receive_within_limit, send)
