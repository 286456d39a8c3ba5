"""Handoff-read's errors. Handlers and the package reader raise these; the runtime maps them to gRPC
status in one place."""

from __future__ import annotations

import grpc

from continuum.handoff_read.v1 import error_reason_pb2
from continuum_runtime.errors import ErrorDetails, InvalidArgument, ServiceError

DOMAIN = "handoff-read.continuum"


class HandoffReadError(ServiceError):
    """Root of every error handoff-read reports; its reasons are values of handoff-read's ErrorReason."""

    domain = DOMAIN
    reasons = error_reason_pb2.ErrorReason


class BadRequest(InvalidArgument, HandoffReadError):
    """A request field or tool argument is malformed or over a limit; a BadRequest detail names it."""

    domain = DOMAIN


class NotBound(HandoffReadError):
    """The run's root session is not a completed, existing protocol-2 merge target."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "HANDOFF_NOT_BOUND"


class RefNotFound(HandoffReadError):
    """The ref names nothing registered in this package's manifests."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "HANDOFF_REF_NOT_FOUND"


class PackageDamaged(HandoffReadError):
    """The package no longer matches its recorded hashes, or a registered path is unsafe to open."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "HANDOFF_PACKAGE_DAMAGED"


class CursorInvalid(HandoffReadError):
    """The cursor is forged, of another package, or reused with other parameters."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "HANDOFF_CURSOR_INVALID"


class BudgetExceeded(HandoffReadError):
    """Verification or the call could not finish within the call's deadline."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "HANDOFF_READ_BUDGET_EXCEEDED"


class AssetTooLarge(HandoffReadError):
    """The asset's original is over the image budget; it was not read and is kept."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "HANDOFF_ASSET_TOO_LARGE"


class PermissionDenied(HandoffReadError):
    """The session or its merge operation belongs to another user."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "HANDOFF_PERMISSION_DENIED"


class Relayed(HandoffReadError):
    """Transcript or merge refused a call made for this request in a way handoff-read does not
    translate (e.g. RUN_NOT_FOUND): the caller sees that service's own code, domain and reason."""

    def __init__(self, details: ErrorDetails) -> None:
        super().__init__(details.message, metadata=details.metadata)
        self.code = details.code
        self.reason = details.reason or details.code.name
        self.domain = details.domain or DOMAIN


class TranscriptUnavailable(HandoffReadError):
    """Transcript could not be reached; nothing was read and the call may be retried."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TRANSCRIPT_UNAVAILABLE"


class MergeUnavailable(HandoffReadError):
    """Merge could not be reached; nothing was read and the call may be retried."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "MERGE_UNAVAILABLE"


class EntryDoesNotFit(HandoffReadError):
    """Not even the minimal reference entry fits the asked budget."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "HANDOFF_ENTRY_DOES_NOT_FIT"
