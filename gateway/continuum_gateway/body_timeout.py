"""A cut-off for request bodies that stall: 408 (DEADLINE_EXCEEDED, REQUEST_TIMEOUT) in AIP-193 form.

Like a web server's client body timeout, the limit is on the wait for each next piece of the body,
not on the whole transfer: a large body that keeps arriving is never cut off, a client that stops
sending mid-body is, instead of holding a connection and a request slot for as long as it likes.
"""

from __future__ import annotations

import asyncio

import grpc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from continuum_gateway.errors import GatewayError


def stalled(timeout: float) -> GatewayError:
    """The refusal of a body that stalled for `timeout` seconds (408, from the reason)."""
    return GatewayError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the request body stalled for {timeout:g} s",
        reason="REQUEST_TIMEOUT",
        metadata={"timeout_seconds": f"{timeout:g}"},
    )


class BodyTimeoutMiddleware:
    """Pure ASGI middleware: each read of an HTTP request body waits at most `timeout` seconds."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Apply the timeout to HTTP requests."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False

        async def receive_in_time() -> Message:
            nonlocal body_done
            if body_done:
                # Past the body, a receive waits for the client to disconnect: no limit there.
                return await receive()
            try:
                async with asyncio.timeout(self.timeout):
                    message = await receive()
            except TimeoutError:
                # Raised inside the route's body read; the app's GatewayError handler answers.
                raise stalled(self.timeout) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        await self.app(scope, receive_in_time, send)
