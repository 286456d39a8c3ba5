"""AIP-158 page tokens: opaque to callers, bound to the request parameters that produced them."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any


class PageTokenError(ValueError):
    """The token is malformed or was issued for different request parameters."""


def _fingerprint(parameters: dict[str, Any]) -> str:
    canonical = json.dumps(parameters, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def encode_page_token(cursor: Any, parameters: dict[str, Any]) -> str:
    """A token that resumes after `cursor` and is valid only with the same `parameters`."""
    body = json.dumps({"c": cursor, "p": _fingerprint(parameters)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(body.encode()).decode().rstrip("=")


def decode_page_token(token: str, parameters: dict[str, Any]) -> Any:
    """The cursor inside `token`; raises PageTokenError if it is foreign or for other parameters."""
    try:
        padded = token + "=" * (-len(token) % 4)
        body = json.loads(base64.urlsafe_b64decode(padded.encode()))
    except (binascii.Error, ValueError, UnicodeDecodeError) as error:
        raise PageTokenError("page_token is not a token this service issued") from error
    if not isinstance(body, dict) or "c" not in body or body.get("p") != _fingerprint(parameters):
        raise PageTokenError("page_token was issued for a request with different parameters")
    return body["c"]


def page_size(requested: int, *, default: int, maximum: int) -> int:
    """AIP-158: zero means the default, larger than the maximum is coerced down. Negative is the
    caller's error and is checked by validation before this."""
    if requested <= 0:
        return default
    return min(requested, maximum)
