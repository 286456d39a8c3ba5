"""Transcript's errors. Handlers raise these; the runtime maps them to gRPC status in one place."""

from __future__ import annotations

import grpc

from continuum.transcript.v1 import error_reason_pb2
from continuum_runtime import paging
from continuum_runtime.errors import InvalidArgument, ServiceError

DOMAIN = "transcript.continuum"


class TranscriptError(ServiceError):
    """Root of every error transcript reports; reasons are values of transcript's ErrorReason."""

    domain = DOMAIN
    reasons = error_reason_pb2.ErrorReason


class BadRequest(InvalidArgument, TranscriptError):
    """A request field is malformed or over a limit."""

    domain = DOMAIN

    def within(self, prefix: str) -> BadRequest:
        """The same refusal of a field that was named relative to `prefix` (e.g. ".role" within "messages[3]")."""
        (violation,) = self.violations
        return BadRequest(prefix + violation.field, violation.description)


class SessionNotFound(TranscriptError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "SESSION_NOT_FOUND"


class SessionPermissionDenied(TranscriptError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "SESSION_PERMISSION_DENIED"


class SessionAlreadyExists(TranscriptError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "SESSION_ALREADY_EXISTS"


class MessageNotFound(TranscriptError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "MESSAGE_NOT_FOUND"


class MessageNotEditable(TranscriptError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MESSAGE_NOT_EDITABLE"


class HistoryGenerationMismatch(TranscriptError):
    code = grpc.StatusCode.ABORTED
    reason = "HISTORY_GENERATION_MISMATCH"


class MessageAlreadyCompacted(TranscriptError):
    """The edited USER message is at or below the session's compaction fence."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "MESSAGE_ALREADY_COMPACTED"


class CompactionFenceMoved(TranscriptError):
    """A compaction fence was refused: another compaction moved the fence after the caller read it."""

    code = grpc.StatusCode.ABORTED
    reason = "COMPACTION_FENCE_MOVED"


class HistoryRewritten(TranscriptError):
    """A compaction fence was refused: an edit rewrote the history after the caller loaded it."""

    code = grpc.StatusCode.ABORTED
    reason = "HISTORY_REWRITTEN"


class AttachmentNotFound(TranscriptError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "ATTACHMENT_NOT_FOUND"


class AttachmentTooLarge(TranscriptError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "ATTACHMENT_TOO_LARGE"


class SessionAlreadyRunning(TranscriptError):
    """A run was refused because the session's tree is claimed."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_ALREADY_RUNNING"


class SessionBusy(TranscriptError):
    """A merge or compaction claim was refused; metadata names the holder's kind."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_BUSY"


class ClaimNotFound(TranscriptError):
    """The claim expired or was released; its holder no longer guards the sessions."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "CLAIM_NOT_HELD"


class RunNotFound(TranscriptError):
    """No live run of the acting user has this run id."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "RUN_NOT_FOUND"


class RunAmbiguous(TranscriptError):
    """The run id does not name one claim over one session tree."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "RUN_AMBIGUOUS"


class PageTokenInvalid(paging.PageTokenInvalid, TranscriptError):
    """A page token this deployment did not issue for the request; a BadRequest names the field."""

    domain = DOMAIN


class AttemptConflict(TranscriptError):
    """A sampling call does not match the attempt that is open (or its chunk order)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "ATTEMPT_CONFLICT"


class AttemptTooLarge(TranscriptError):
    """The attempt's streamed text would pass the message size limit (its message could not be stored)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "ATTEMPT_TOO_LARGE"


class TooManyOpenAttempts(TranscriptError):
    """The session has as many open sampling attempts as allowed; commit or cancel one first."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "TOO_MANY_OPEN_ATTEMPTS"


class TooManyPendingPrompts(TranscriptError):
    """The session has as many pending prompts as allowed; resolve one first."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "TOO_MANY_PENDING_PROMPTS"


class PublishBacklogFull(TranscriptError):
    """Accepted batches are waiting to be saved and the backlog is full; retry later."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "PUBLISH_BACKLOG_FULL"


class PublisherUnavailable(TranscriptError):
    """The session's live transcript moved to another stream generation or process; retry."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "PUBLISHER_MOVED"


class UpgradeRequired(TranscriptError):
    """The peer did not advertise the protocol this call speaks; there is no legacy fallback."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "UPGRADE_REQUIRED"


__all__ = ["BadRequest", "TranscriptError"]
