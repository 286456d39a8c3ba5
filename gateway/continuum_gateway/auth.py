"""Browser authentication: `Authorization: Bearer <token>` of a configured user → that user's id.

`AuthMiddleware` refuses every request outside `OPEN_PATHS` that does not carry a known token, so a
route cannot forget to authenticate. Routes read the user with `acting_user(request)` and pass it to
the services, which decide ownership themselves.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping

import grpc
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from continuum_gateway.errors import DOMAIN, error_response

logger = logging.getLogger("continuum.gateway")

# Probes answer without credentials.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# Where the middleware leaves the authenticated user for the route (an ASGI scope extension key).
_USER_SCOPE_KEY = "continuum.user"


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


class AuthMiddleware:
    """Pure ASGI middleware: 401 (AIP-193, status UNAUTHENTICATED) unless the bearer token is known."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate HTTP requests outside `OPEN_PATHS`; pass everything else through."""
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        user = self.authenticator.user_for(Headers(scope=scope).get("authorization"))
        if user is None:
            logger.info("request unauthenticated", extra={"method": scope["method"], "path": scope["path"]})
            response = error_response(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid bearer token is required",
                reason="UNAUTHENTICATED",
                domain=DOMAIN,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        scope[_USER_SCOPE_KEY] = user
        await self.app(scope, receive, send)


def acting_user(request: Request) -> str:
    """The authenticated user of a request that passed `AuthMiddleware`."""
    user = request.scope.get(_USER_SCOPE_KEY)
    if not isinstance(user, str):
        # Only reachable if a route under OPEN_PATHS asks for a user: a programming error.
        raise RuntimeError("acting_user() called on a request that was not authenticated")
    return user


def request_user(scope: Scope) -> str | None:
    """The authenticated user of a request, if any (for logs)."""
    user = scope.get(_USER_SCOPE_KEY)
    return user if isinstance(user, str) else None
