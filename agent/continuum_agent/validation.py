"""Request checks; each failure names its field."""

from __future__ import annotations

import re

from continuum_agent.errors import BadRequest

# Transcript's session ids: letters, digits, '-' and '_', 1 to 64 characters.
_SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CLIENT_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MAX_TEXT_CHARS = 1_000_000


def session_id(value: str) -> str:
    """A well-formed session id."""
    if not _SESSION_ID.match(value):
        raise BadRequest("session_id", "must be 1-64 characters of letters, digits, '-' or '_'")
    return value


def text(value: str) -> str:
    """The user's message."""
    if not value.strip():
        raise BadRequest("text", "must not be empty")
    if len(value) > MAX_TEXT_CHARS:
        raise BadRequest("text", f"must be at most {MAX_TEXT_CHARS} characters")
    return value


def client_request_id(value: str) -> str:
    """Empty, or a well-formed id."""
    if value and not _CLIENT_REQUEST_ID.match(value):
        raise BadRequest("client_request_id", "must be 1-128 letters, digits or '_.:-'")
    return value
