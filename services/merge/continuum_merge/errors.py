"""Merge's errors. Handlers raise these; the runtime maps them to gRPC status in one place.

A conflict carries the operation as it stands after the refusal, packed as a status detail next to
the ErrorInfo, so a client can show the latest state without another call.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2

from continuum.merge.v1 import error_reason_pb2
from continuum.merge.v1 import resources_pb2 as pb
from continuum_runtime.errors import ErrorDetails, InvalidArgument, ServiceError

DOMAIN = "merge.continuum"


class MergeError(ServiceError):
    """Root of every error merge reports; its own reasons are values of merge's ErrorReason."""

    domain = DOMAIN
    reasons = error_reason_pb2.ErrorReason


class BadRequest(InvalidArgument, MergeError):
    """A request field is malformed or over a limit; a BadRequest detail names it."""

    domain = DOMAIN


class OperationNotFound(MergeError):
    """No such operation (of any user)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "MERGE_OPERATION_NOT_FOUND"


class PermissionDenied(MergeError):
    """The operation belongs to another user."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "MERGE_PERMISSION_DENIED"


class OperationConflict(MergeError):
    """A refusal that carries the latest state of the operation it concerns."""

    def __init__(
        self, message: str, operation: pb.MergeOperation, metadata: dict[str, str | int] | None = None
    ) -> None:
        super().__init__(message, metadata={"operation_id": operation.progress.operation_id, **(metadata or {})})
        self.operation = operation

    def to_status(self) -> status_pb2.Status:
        """The ErrorInfo status with the operation appended as a detail."""
        status = super().to_status()
        packed = any_pb2.Any()
        packed.Pack(self.operation)
        status.details.append(packed)
        return status


class ActiveExists(OperationConflict):
    """The user already has an unfinished merge (the detail is that operation)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "MERGE_ACTIVE_EXISTS"


class IdempotencyConflict(OperationConflict):
    """The idempotency key was used with other parameters (the detail is its operation)."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "MERGE_IDEMPOTENCY_CONFLICT"


class StaleOperation(OperationConflict):
    """The call names a run epoch or state the operation has left."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MERGE_STALE_OPERATION"


class AlreadyCompleted(OperationConflict):
    """The operation is completed; it can no longer be cancelled."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MERGE_ALREADY_COMPLETED"


class CancelCleanup(OperationConflict):
    """A cancelled operation's writer is still stopping; a new start must wait a moment."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MERGE_CANCEL_CLEANUP"


class SourceBusy(MergeError):
    """A source session is running or claimed; metadata names it and its holder."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MERGE_SOURCE_BUSY"


class TranscriptRefused(MergeError):
    """Transcript refused a call made for this request (unknown session, another user's, ...).

    The caller sees transcript's own code, domain and reason: merge adds nothing it could get wrong.
    """

    def __init__(self, details: ErrorDetails) -> None:
        super().__init__(details.message, metadata=details.metadata)
        self.code = details.code
        self.reason = details.reason or details.code.name
        self.domain = details.domain or DOMAIN


class TranscriptUnavailable(MergeError):
    """Transcript could not be reached; the request changed nothing and may be retried."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TRANSCRIPT_UNAVAILABLE"
