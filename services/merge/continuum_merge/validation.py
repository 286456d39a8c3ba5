"""Input checks of every merge RPC: bad input is refused before anything is read or written."""

from __future__ import annotations

import re

from continuum.merge.v1 import merge_service_pb2 as api
from continuum_merge.errors import BadRequest
from continuum_merge.store import Parameters

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPERATION_ID = re.compile(r"^[a-f0-9]{32}$")
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
MIN_SOURCES = 2
MAX_SOURCES = 5
MAX_TITLE_CHARS = 200
MAX_MODEL_CHARS = 200


def _printable(value: str, field: str, limit: int) -> str:
    if len(value) > limit:
        raise BadRequest(field, f"must be at most {limit} characters")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        raise BadRequest(field, "must not contain control characters")
    return value


def operation_id(value: str) -> str:
    """An operation id as merge issues them."""
    if not OPERATION_ID.match(value):
        raise BadRequest("operation_id", "must be an operation id (32 lowercase hex digits)")
    return value


def session_id(value: str, field: str) -> str:
    """A session id as transcript accepts them."""
    if not SESSION_ID.match(value):
        raise BadRequest(field, "must be 1-64 characters of letters, digits, '-' or '_'")
    return value


def model(value: str) -> str:
    """An optional model name."""
    if value != value.strip():
        raise BadRequest("model", "must not start or end with spaces")
    return _printable(value, "model", MAX_MODEL_CHARS)


def start(request: api.StartMergeRequest) -> Parameters:
    """Checks of StartMerge; the normalized parameters, or BadRequest naming the first bad field."""
    sources = list(request.source_session_ids)
    if not MIN_SOURCES <= len(sources) <= MAX_SOURCES:
        raise BadRequest("source_session_ids", f"must name {MIN_SOURCES} to {MAX_SOURCES} sessions")
    seen: set[str] = set()
    for index, source in enumerate(sources):
        field = f"source_session_ids[{index}]"
        if not SESSION_ID.match(source):
            raise BadRequest(field, "must be 1-64 characters of letters, digits, '-' or '_'")
        if source in seen:
            raise BadRequest(field, "names a session twice")
        seen.add(source)
    if not request.primary_session_id:
        raise BadRequest("primary_session_id", "is required")
    if request.primary_session_id not in seen:
        raise BadRequest("primary_session_id", "must be one of the source sessions")
    title = _printable(request.title, "title", MAX_TITLE_CHARS)
    if not IDEMPOTENCY_KEY.match(request.idempotency_key):
        raise BadRequest("idempotency_key", "must be 1-128 letters, digits or '_', '.', ':', '-'")
    return Parameters(tuple(sources), request.primary_session_id, title, model(request.model))


def resume(request: api.ResumeMergeRequest) -> tuple[str, int, str]:
    """Checks of ResumeMerge: operation id, expected epoch, optional model."""
    operation = operation_id(request.operation_id)
    if request.expected_epoch < 1:
        raise BadRequest("expected_epoch", "must be the run_epoch the caller saw (at least 1)")
    return operation, request.expected_epoch, model(request.model)
