"""The agent's errors. Handlers raise these; the runtime maps them to gRPC status in one place."""

from __future__ import annotations

import grpc

from continuum.agent.v1 import error_reason_pb2
from continuum_runtime.errors import ErrorDetails, InvalidArgument, ServiceError

DOMAIN = "agent.continuum"


class AgentError(ServiceError):
    """Root of every error the agent reports; its own reasons are values of the agent's ErrorReason."""

    domain = DOMAIN
    reasons = error_reason_pb2.ErrorReason


class BadRequest(InvalidArgument, AgentError):
    """A request field is malformed or over a limit."""

    domain = DOMAIN


class UpstreamRefused(AgentError):
    """Transcript or compaction refused a call made for this request; the caller sees that service's
    own code, reason and domain (e.g. transcript's SESSION_ALREADY_RUNNING)."""

    def __init__(self, details: ErrorDetails) -> None:
        super().__init__(details.message, metadata=details.metadata)
        self.code = details.code
        self.reason = details.reason or details.code.name
        self.domain = details.domain or DOMAIN


class TranscriptUnavailable(AgentError):
    """Transcript could not be reached; the call may be retried."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TRANSCRIPT_UNAVAILABLE"


class CompactionUnavailable(AgentError):
    """Compaction could not be reached; the turn's context could not be built."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "COMPACTION_UNAVAILABLE"


class HandoffReadUnavailable(AgentError):
    """Handoff-read could not be reached; the HandoffRead call's result says so to the model."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "HANDOFF_READ_UNAVAILABLE"


class TurnAlreadyRunning(AgentError):
    """A turn of the session is already running in this agent."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "SESSION_ALREADY_RUNNING"


class ClientRequestIdReused(AgentError):
    """The client_request_id answered another session or text before."""

    code = grpc.StatusCode.ABORTED
    reason = "CLIENT_REQUEST_ID_REUSED"


class TooManyTurns(AgentError):
    """This process already runs `max_running_turns` turns."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "TOO_MANY_TURNS"
