"""Domain errors and their one mapping to `google.rpc.Status` with `ErrorInfo` (AIP-193).

Each service derives one root error type from `ServiceError`; handlers raise it and never set
status codes themselves. `GuardedServer` (in `guard`) turns it into a status.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    """One invalid request field, named by its path (e.g. ``messages[3].content``)."""

    field: str
    description: str


class ServiceError(Exception):
    """A failure the caller should see, with a canonical code and a machine-readable reason.

    Each service's root error type sets `reasons` to its proto package's ErrorReason enum: every
    `reason` of the service's errors must then be one of that enum's value names (checked when the
    class is defined), so the contract lists every reason a client can meet.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "INTERNAL"
    # Set by each service's root error type, e.g. "transcript.continuum".
    domain: str = "continuum"
    # The service's ErrorReason enum (a generated EnumTypeWrapper); None in the runtime's own types.
    reasons: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.reasons is not None and cls.reason not in cls.reasons.DESCRIPTOR.values_by_name:
            raise TypeError(
                f"{cls.__name__}.reason {cls.reason!r} is not a value of {cls.reasons.DESCRIPTOR.full_name}"
            )

    def __init__(
        self,
        message: str,
        *,
        metadata: Mapping[str, str | int] | None = None,
        violations: list[FieldViolation] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.violations = violations or []

    def to_status(self) -> status_pb2.Status:
        """The `google.rpc.Status` carrying this error's ErrorInfo (and BadRequest, if any)."""
        details = [_pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=self.domain, metadata=self.metadata))]
        if self.violations:
            bad_request = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                    for v in self.violations
                ]
            )
            details.append(_pack(bad_request))
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=details)


class InvalidArgument(ServiceError):
    """The request is malformed; `violations` names the fields."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_ARGUMENT"

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}", violations=[FieldViolation(field, description)])


class Unauthenticated(ServiceError):
    """No valid service credential."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


def _pack(message: error_details_pb2.ErrorInfo | error_details_pb2.BadRequest) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def internal_status() -> status_pb2.Status:
    """The status for an unexpected failure: no detail that could leak data."""
    info = error_details_pb2.ErrorInfo(reason="INTERNAL", domain="continuum")
    return status_pb2.Status(code=code_pb2.INTERNAL, message="internal error", details=[_pack(info)])


@dataclass(frozen=True)
class ErrorDetails:
    """What a client can read back from a failed call."""

    code: grpc.StatusCode
    message: str
    reason: str
    domain: str
    metadata: dict[str, str]
    violations: list[FieldViolation]
    # Every other status detail, still packed (e.g. the operation a merge conflict carries).
    others: tuple[any_pb2.Any, ...] = ()


def error_details(error: grpc.aio.AioRpcError | grpc.RpcError) -> ErrorDetails:
    """Decode the ErrorInfo and BadRequest of a failed call (empty reason when absent); any other
    detail is kept packed in `others`."""
    code: grpc.StatusCode = error.code()
    message: str = error.details() or ""
    reason, domain, metadata, violations = "", "", {}, []
    others: list[any_pb2.Any] = []
    status = _status_from_trailers(error)
    for detail in status.details if status is not None else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations = [FieldViolation(v.field, v.description) for v in bad.field_violations]
        else:
            others.append(detail)
    return ErrorDetails(code, message, reason, domain, metadata, violations, tuple(others))


def _status_from_trailers(error: grpc.aio.AioRpcError | grpc.RpcError) -> status_pb2.Status | None:
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY and isinstance(value, bytes):
            status = status_pb2.Status()
            status.ParseFromString(value)
            return status
    return None
