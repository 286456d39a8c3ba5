"""Browser authentication: `Authorization: Bearer <token>` of a configured user → that user's id.

`AuthMiddleware` refuses every request outside its open paths (the routes whose operations are all
`public`: the probes and the API reference) that does not carry a known token, so a route cannot
forget to authenticate. Routes read the user with `acting_user(request)` and pass it to
the services, which decide ownership themselves.

WebSocket handshakes are authenticated the same way, with one addition because browsers cannot set
headers on a WebSocket: on the WebSocket paths the app names (the Follow route), the token may come
as a subprotocol instead, ``continuum.bearer.<base64url(token), unpadded>``. A browser opens::

    new WebSocket(url, ["continuum.follow.v1", "continuum.bearer." + base64url(token)])

and the gateway selects ``continuum.follow.v1``, never echoing the credential. Tokens are not taken
from query strings, which end up in proxy logs and browser history.

A WebSocket without a known token is refused after the upgrade: the gateway accepts, sends the same
401 AIP-193 body as HTTP as ``{"type": "error", "error": {...}}`` and closes with 4401 (see
`errors`). A browser is shown neither the status nor the body of a handshake refused over HTTP (only
an anonymous 1006), so this is the one way it can tell a bad token from a network failure.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import grpc
from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from continuum_gateway.errors import DOMAIN, body_close_code, body_response, error_body, websocket_error_message

logger = logging.getLogger("continuum.gateway")

# Where the middleware leaves the authenticated user for the route (an ASGI scope extension key).
_USER_SCOPE_KEY = "continuum.user"
# A WebSocket subprotocol carrying a bearer token: this prefix, then the token in unpadded base64url.
BEARER_SUBPROTOCOL_PREFIX = "continuum.bearer."


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Resolves bearer tokens to user ids.

    Tokens are looked up by their SHA-256 digest: a dictionary lookup on the digest reveals nothing
    usable about the token through timing, unlike comparing tokens themselves.
    """

    def __init__(self, tokens: Mapping[str, str]) -> None:
        self._users = {_digest(token): user for token, user in tokens.items()}

    def user_for(self, authorization: str | None) -> str | None:
        """The user an `Authorization` header value stands for, or None when it names nobody."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        return self._users.get(_digest(token))

    def user_for_subprotocols(self, subprotocols: Sequence[str]) -> str | None:
        """The user of the one bearer subprotocol offered, or None (none, several, malformed, unknown)."""
        offered = [p[len(BEARER_SUBPROTOCOL_PREFIX) :] for p in subprotocols if p.startswith(BEARER_SUBPROTOCOL_PREFIX)]
        if len(offered) != 1:
            return None
        encoded = offered[0]
        try:
            token = base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_", validate=True).decode()
        except (binascii.Error, ValueError):
            return None
        return self._users.get(_digest(token)) if token else None


def bearer_subprotocol(token: str) -> str:
    """The subprotocol a WebSocket client offers to present `token` (for clients and tests)."""
    return BEARER_SUBPROTOCOL_PREFIX + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")


def _unauthenticated_body() -> dict[str, Any]:
    """The refusal of a request without a known token, for HTTP and WebSocket alike."""
    return error_body(
        grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required", reason="UNAUTHENTICATED", domain=DOMAIN
    )


class AuthMiddleware:
    """Pure ASGI middleware: 401 (AIP-193, status UNAUTHENTICATED) unless the bearer token is known.

    `open_paths` answer without a token (HTTP only). `subprotocol_paths` are the WebSocket paths (as
    compiled route patterns) where a bearer subprotocol is accepted in place of the Authorization
    header; nowhere else is it.
    `subprotocols` are the application subprotocols the gateway's WebSocket routes select; a refused
    WebSocket selects one of them too, or a browser would drop the connection before the error.
    """

    def __init__(
        self,
        app: ASGIApp,
        authenticator: Authenticator,
        open_paths: Collection[str] = (),
        subprotocol_paths: Sequence[re.Pattern[str]] = (),
        subprotocols: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.authenticator = authenticator
        self.open_paths = frozenset(open_paths)
        self.subprotocol_paths = tuple(subprotocol_paths)
        self.subprotocols = frozenset(subprotocols)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate HTTP requests outside `open_paths` and every WebSocket handshake."""
        if scope["type"] not in ("http", "websocket") or (scope["type"] == "http" and scope["path"] in self.open_paths):
            await self.app(scope, receive, send)
            return
        user = self.authenticator.user_for(Headers(scope=scope).get("authorization"))
        if user is None and scope["type"] == "websocket" and self._takes_subprotocol(scope["path"]):
            user = self.authenticator.user_for_subprotocols(scope.get("subprotocols", []))
        if user is None:
            method = scope.get("method", "WEBSOCKET")
            logger.info("request unauthenticated", extra={"method": method, "path": scope["path"]})
            if scope["type"] == "websocket":
                await self._refuse_websocket(scope, receive, send)
                return
            response = body_response(_unauthenticated_body(), headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope[_USER_SCOPE_KEY] = user
        await self.app(scope, receive, send)

    async def _refuse_websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        offered = scope.get("subprotocols", [])
        selected = next((p for p in offered if p in self.subprotocols), None)
        body = _unauthenticated_body()
        # OSError: the client is gone already (the server's disconnect error derives from it).
        with contextlib.suppress(OSError):
            await send({"type": "websocket.accept", "subprotocol": selected})
            await send({"type": "websocket.send", "text": websocket_error_message(body)})
            await send({"type": "websocket.close", "code": body_close_code(body)})

    def _takes_subprotocol(self, path: str) -> bool:
        return any(pattern.match(path) for pattern in self.subprotocol_paths)


def acting_user(request: HTTPConnection) -> str:
    """The authenticated user of a request (or WebSocket) that passed `AuthMiddleware`."""
    user = request.scope.get(_USER_SCOPE_KEY)
    if not isinstance(user, str):
        # Only reachable if an open route asks for a user: a programming error.
        raise RuntimeError("acting_user() called on a request that was not authenticated")
    return user


def request_user(scope: Scope) -> str | None:
    """The authenticated user of a request, if any (for logs)."""
    user = scope.get(_USER_SCOPE_KEY)
    return user if isinstance(user, str) else None
