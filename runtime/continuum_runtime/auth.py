"""Service credentials and the acting user, both carried in gRPC metadata.

Every call to a service presents ``authorization: Bearer <service token>``. Calls made on behalf of
a user also carry ``x-continuum-user``; the service checks ownership against it.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Sequence

import grpc

from continuum_runtime.errors import ServiceError

AUTHORIZATION_KEY = "authorization"
ACTING_USER_KEY = "x-continuum-user"
USER_ID_PATTERN = re.compile(r"^[A-Za-z0-9._@-]{1,128}$")


class MissingActingUser(ServiceError):
    """A session-scoped call arrived without a valid acting user."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "ACTING_USER_REQUIRED"


def bearer_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: str) -> bool:
    """True when the metadata carries the expected bearer token (constant-time comparison)."""
    if not token:
        return False
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            presented = value.encode() if isinstance(value, str) else value
            return hmac.compare_digest(presented, expected)
    return False


def acting_user(context: grpc.aio.ServicerContext) -> str:
    """The user a call acts for; UNAUTHENTICATED when absent or malformed."""
    for key, value in context.invocation_metadata() or ():
        if key == ACTING_USER_KEY and isinstance(value, str) and USER_ID_PATTERN.match(value):
            return value
    raise MissingActingUser(f"metadata {ACTING_USER_KEY!r} must name the acting user")


def call_metadata(token: str, user: str | None = None) -> tuple[tuple[str, str], ...]:
    """Metadata a client attaches to every call: the service credential and, optionally, a user."""
    pairs = [(AUTHORIZATION_KEY, f"Bearer {token}")]
    if user is not None:
        pairs.append((ACTING_USER_KEY, user))
    return tuple(pairs)
