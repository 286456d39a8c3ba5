"""Compaction's errors. Handlers raise these; the runtime maps them to gRPC status in one place."""

from __future__ import annotations

import grpc

from continuum.compaction.v1 import error_reason_pb2
from continuum_runtime import paging
from continuum_runtime.errors import ErrorDetails, InvalidArgument, ServiceError

DOMAIN = "compaction.continuum"


class CompactionError(ServiceError):
    """Root of every error compaction reports; its own reasons are values of compaction's ErrorReason."""

    domain = DOMAIN
    reasons = error_reason_pb2.ErrorReason


class BadRequest(InvalidArgument, CompactionError):
    """A request field is malformed or over a limit."""

    domain = DOMAIN


class PageTokenInvalid(paging.PageTokenInvalid, CompactionError):
    """A page token this deployment did not issue for the request; a BadRequest names the field."""

    domain = DOMAIN


class TranscriptRefused(CompactionError):
    """Transcript refused a call made for this request (unknown session, not the owner, ...).

    The caller sees transcript's own code and reason: compaction adds nothing it could get wrong.
    """

    def __init__(self, details: ErrorDetails) -> None:
        super().__init__(details.message, metadata=details.metadata)
        self.code = details.code
        self.reason = details.reason or details.code.name
        self.domain = details.domain or DOMAIN


class TranscriptUnavailable(CompactionError):
    """Transcript could not be reached; the request changed nothing and may be retried."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TRANSCRIPT_UNAVAILABLE"


class SessionBusy(CompactionError):
    """Another kind of work (a merge) holds the session; manual compaction cannot run or queue."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_BUSY"


class CapacityExceeded(CompactionError):
    """A merged session's minimal reference entry and the current request do not fit the window together."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "CONTEXT_CAPACITY_EXCEEDED"
