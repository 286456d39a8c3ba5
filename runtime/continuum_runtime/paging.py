"""AIP-158 page tokens: opaque to callers, authenticated, bound to the request that produced them.

A token is ``<payload>.<mac>``, both base64url: the payload is the JSON of a typed cursor, and the mac
is an HMAC-SHA256, under the deployment's secret, of the request parameters the token is valid for
and the payload. Only a token this deployment issued, for the same parameters, decodes; its cursor is
then validated into its declared type once more, so a token from an older release with another
cursor shape is refused like a forged one. Everything else is the caller's INVALID_ARGUMENT
(`PAGE_TOKEN_INVALID`, with a BadRequest naming the field), never a failure of the service.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import secrets
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from continuum_runtime.errors import InvalidArgument

logger = logging.getLogger("continuum.paging")

# Anything longer was not issued here (cursors are a few ids); refused before any decoding work.
MAX_TOKEN_CHARS = 1024
_MAC_BYTES = 32


class Cursor(BaseModel):
    """Base of the typed cursors a page token carries: frozen, strict, no unknown fields."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")


CursorT = TypeVar("CursorT", bound=Cursor)


class PageTokenInvalid(InvalidArgument):
    """The page token was not issued by this deployment for these request parameters."""

    reason = "PAGE_TOKEN_INVALID"

    def __init__(self, field: str = "page_token", description: str = "is not a token issued for this request") -> None:
        super().__init__(field, description)


class PageTokens(Generic[CursorT]):
    """Issues and opens the page tokens of one list call.

    `invalid` is the service's own PAGE_TOKEN_INVALID error type (so the refusal carries the
    service's error domain); `cursor` the type of the position a token resumes from.
    """

    def __init__(self, secret: bytes, cursor: type[CursorT], invalid: type[PageTokenInvalid]) -> None:
        if len(secret) < 16:
            raise ValueError("a page-token secret needs at least 16 bytes")
        self._secret = secret
        self._cursor = cursor
        self._invalid = invalid

    def issue(self, position: CursorT, parameters: dict[str, Any]) -> str:
        """A token that resumes at `position` and is valid only with the same `parameters`."""
        payload = position.model_dump_json().encode()
        mac = self._mac(payload, parameters)
        return f"{_b64(payload)}.{_b64(mac)}"

    def open(self, token: str, parameters: dict[str, Any], field: str = "page_token") -> CursorT | None:
        """The cursor inside `token` (None for the empty token, the first page).

        Raises the service's PAGE_TOKEN_INVALID error for anything this deployment did not issue
        for these parameters.
        """
        if not token:
            return None
        if len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
            raise self._invalid(field)
        encoded_payload, encoded_mac = token.split(".")
        try:
            payload, mac = _unb64(encoded_payload), _unb64(encoded_mac)
        except (binascii.Error, ValueError):
            raise self._invalid(field) from None
        if not hmac.compare_digest(mac, self._mac(payload, parameters)):
            raise self._invalid(field, "is not a token issued for this request (or was issued for other parameters)")
        try:
            return self._cursor.model_validate(json.loads(payload))
        except (ValueError, ValidationError):
            # Authentic but of another shape: a token of an older release. Never the service's fault.
            raise self._invalid(field, "was issued by an incompatible version; start from the first page") from None

    def _mac(self, payload: bytes, parameters: dict[str, Any]) -> bytes:
        bound = json.dumps(parameters, sort_keys=True, separators=(",", ":"), default=str).encode()
        return hmac.new(self._secret, bound + b"\n" + payload, hashlib.sha256).digest()[:_MAC_BYTES]


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    if not text or not all(c.isalnum() or c in "-_" for c in text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def token_secret(configured: str, service: str) -> bytes:
    """The secret page tokens are signed with: the configured one, or a random one for this process.

    Without a configured secret, tokens stop working when the process restarts and are refused by
    other replicas; that is safe (the client starts from the first page) but worth a warning.
    """
    if configured:
        return configured.encode()
    logger.warning(
        "no page-token secret configured: page tokens are valid in this process only",
        extra={"service": service, "setting": f"{service.upper()}_PAGE_TOKEN_SECRET"},
    )
    return secrets.token_bytes(32)


def page_size(requested: int, *, default: int, maximum: int) -> int:
    """AIP-158: zero means the default, larger than the maximum is coerced down. Negative is the
    caller's error and is checked by validation before this."""
    if requested <= 0:
        return default
    return min(requested, maximum)
