"""The gRPC-status → HTTP-status and → WebSocket-close-code tables, and every error body (AIP-193).

A body looks like::

    {"error": {"code": 404, "status": "NOT_FOUND", "message": "...",
               "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                            "reason": "SESSION_NOT_FOUND", "domain": "transcript.continuum",
                            "metadata": {...}},
                           {"@type": "type.googleapis.com/google.rpc.BadRequest",
                            "fieldViolations": [{"field": "...", "description": "..."}]}]}}

Errors the gateway detects itself raise `GatewayError`; failed service calls raise `UpstreamError`.
Both become responses only through the handlers here, so no route sets a status code on failure.

The Follow WebSocket sends the same body as a ``{"type": "error", "error": {...}}`` message and then
closes with `close_code_for(...)`: 4000 + the HTTP status of the same failure (RFC 6455 reserves
4000-4999 for applications), so a browser handles ``closeCode - 4000`` like a REST status. The
table, in full:

    ========================  =====  ==========
    gRPC code                 HTTP   WS close
    ========================  =====  ==========
    OK                        200    1000 (normal closure)
    CANCELLED                 499    4499
    UNKNOWN                   500    4500
    INVALID_ARGUMENT          400    4400
    DEADLINE_EXCEEDED         504    4504
    NOT_FOUND                 404    4404
    ALREADY_EXISTS            409    4409
    PERMISSION_DENIED         403    4403
    RESOURCE_EXHAUSTED        429    4429 (transient limits only)
    FAILED_PRECONDITION       400    4400
    ABORTED                   409    4409
    OUT_OF_RANGE              400    4400
    UNIMPLEMENTED             501    4501
    INTERNAL                  500    4500
    UNAVAILABLE               503    4503
    DATA_LOSS                 500    4500
    UNAUTHENTICATED           401    4401
    ========================  =====  ==========

A few refusals are more precise than their code (`REASON_HTTP_STATUS`): reason UPGRADE_REQUIRED
(FAILED_PRECONDITION: the peer lacks a required capability such as ``transcript-v2``) is HTTP 426
and close code 4426; REQUEST_TOO_LARGE (INVALID_ARGUMENT) is 413; REQUEST_TIMEOUT
(DEADLINE_EXCEEDED: the client's body stalled) is 408; METHOD_NOT_ALLOWED (UNIMPLEMENTED) is 405; a refusal
for the state a resource is in (`STATE_CONFLICTS`: SESSION_ALREADY_RUNNING, and a merge's MERGE_SOURCE_BUSY,
MERGE_STALE_OPERATION, MERGE_ALREADY_COMPLETED, MERGE_CANCEL_CLEANUP; all FAILED_PRECONDITION) is 409.

A service's conflict may carry a resource as a further status detail: a merge conflict carries the
merge operation as it stands after the refusal. The details of the types in `RELAYED_DETAILS` are
relayed into ``details`` in the proto3 JSON mapping of `google.protobuf.Any` (``"@type"`` then the
message's fields); any other detail is dropped.

A BadRequest relayed from a service names fields by proto name (``page_token``); the gateway names
them as the HTTP request spelled them (`UpstreamError.field_name`, set by the route: ``pageToken``,
a path parameter by its route name).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from google.protobuf import any_pb2, json_format
from google.protobuf.message import Message
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ExceptionHandler

from continuum.merge.v1 import error_reason_pb2 as merge_reasons
from continuum.merge.v1 import resources_pb2 as merge_resources
from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum_runtime.errors import FieldViolation, error_details

logger = logging.getLogger("continuum.gateway")

DOMAIN = "gateway.continuum"
ERROR_INFO_TYPE = "type.googleapis.com/google.rpc.ErrorInfo"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
TYPE_URL_PREFIX = "type.googleapis.com/"
# Status details a service may attach beside ErrorInfo and BadRequest that the gateway relays, by
# their full proto name. Anything else a status carries stays inside the gateway.
RELAYED_DETAILS: Mapping[str, type[Message]] = {
    merge_resources.MergeOperation.DESCRIPTOR.full_name: merge_resources.MergeOperation,
}

# Google's canonical mapping (google/rpc/code.proto). The only place a gRPC code meets HTTP.
HTTP_STATUS: Mapping[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNAUTHENTICATED: 401,
}

# The only place a gRPC code meets a WebSocket close code: 4000 + its HTTP status (derived from
# `HTTP_STATUS`, so the two tables cannot drift apart); OK is a normal closure.
WEBSOCKET_CLOSE_CODE: Mapping[grpc.StatusCode, int] = {
    code: 1000 if code == grpc.StatusCode.OK else 4000 + status for code, status in HTTP_STATUS.items()
}

# The peer lacks a capability this call needs (e.g. `transcript-v2`); there is no legacy fallback.
UPGRADE_REQUIRED = "UPGRADE_REQUIRED"
# The request body is over the gateway's limit.
REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"
# The request body stopped arriving.
REQUEST_TIMEOUT = "REQUEST_TIMEOUT"
# The route exists, but not with this method.
METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
# Refusals because of the state a resource is in, not because of the request (FAILED_PRECONDITION): a
# conflict, 409, as the seeds answer them. A session running a turn (seed 003); a merge whose state
# refuses the call (seed 000 §5.3), whose body carries the operation.
STATE_CONFLICTS = (
    transcript_reasons.ErrorReason.Name(transcript_reasons.SESSION_ALREADY_RUNNING),
    *(
        merge_reasons.ErrorReason.Name(reason)
        for reason in (
            merge_reasons.MERGE_SOURCE_BUSY,
            merge_reasons.MERGE_STALE_OPERATION,
            merge_reasons.MERGE_ALREADY_COMPLETED,
            merge_reasons.MERGE_CANCEL_CLEANUP,
        )
    ),
)
# ErrorInfo reasons with a more precise answer than their gRPC code's, in both tables.
REASON_HTTP_STATUS: Mapping[str, int] = {
    UPGRADE_REQUIRED: 426,
    REQUEST_TOO_LARGE: 413,
    REQUEST_TIMEOUT: 408,
    METHOD_NOT_ALLOWED: 405,
    **dict.fromkeys(STATE_CONFLICTS, 409),
}
REASON_CLOSE_CODE: Mapping[str, int] = {reason: 4000 + status for reason, status in REASON_HTTP_STATUS.items()}


def http_status_for(code: grpc.StatusCode, reason: str = "") -> int:
    """The HTTP status of a failure: its reason's, if the reason has one, else its code's."""
    return REASON_HTTP_STATUS.get(reason, HTTP_STATUS[code])


def close_code_for(code: grpc.StatusCode, reason: str = "") -> int:
    """The WebSocket close code of a failure: its reason's, if the reason has one, else its code's."""
    return REASON_CLOSE_CODE.get(reason, WEBSOCKET_CLOSE_CODE[code])


class GatewayError(Exception):
    """A failure the gateway detects itself, described the way a service would describe it.

    `http_status` overrides the tables only for refusals the HTTP layer words itself (a malformed
    header's 400, whatever Starlette answered).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        reason: str,
        metadata: Mapping[str, str] | None = None,
        violations: list[FieldViolation] | None = None,
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.violations = violations or []
        self.http_status = http_status if http_status is not None else http_status_for(code, reason)

    @classmethod
    def invalid_argument(cls, field: str, description: str, *, reason: str = "INVALID_ARGUMENT") -> GatewayError:
        """A malformed request, naming the offending field in a BadRequest detail."""
        return cls(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field}: {description}",
            reason=reason,
            violations=[FieldViolation(field, description)],
        )

    def body(self) -> dict[str, Any]:
        """This error as an AIP-193 body from the gateway's own domain."""
        return error_body(
            self.code,
            self.message,
            http_status=self.http_status,
            reason=self.reason,
            domain=DOMAIN,
            metadata=self.metadata,
            violations=self.violations,
        )

    def response(self) -> JSONResponse:
        """This error as an AIP-193 response from the gateway's own domain."""
        return body_response(self.body())


def _as_written(field: str) -> str:
    return field


class UpstreamError(Exception):
    """A call to a service failed; `upstream` names the service (e.g. "transcript").

    `field_name` turns a field path of the service's BadRequest (``session.working_directory``)
    into the client's name of that field (``session.workingDirectory``); by default paths are relayed
    as the service wrote them.
    """

    def __init__(
        self, upstream: str, error: grpc.aio.AioRpcError, field_name: Callable[[str], str] = _as_written
    ) -> None:
        super().__init__(f"{upstream} call failed with {error.code().name}")
        self.upstream = upstream
        self.error = error
        self.field_name = field_name


def error_body(
    code: grpc.StatusCode,
    message: str,
    *,
    http_status: int | None = None,
    reason: str = "",
    domain: str = "",
    metadata: Mapping[str, str] | None = None,
    violations: list[FieldViolation] | None = None,
    resources: list[Message] | None = None,
) -> dict[str, Any]:
    """The AIP-193 JSON body: HTTP code, gRPC code name, message, ErrorInfo and BadRequest details,
    then `resources` (a conflict's latest state), each as a JSON `Any`."""
    details: list[dict[str, Any]] = []
    if reason:
        details.append({"@type": ERROR_INFO_TYPE, "reason": reason, "domain": domain, "metadata": dict(metadata or {})})
    if violations:
        details.append(
            {
                "@type": BAD_REQUEST_TYPE,
                "fieldViolations": [{"field": v.field, "description": v.description} for v in violations],
            }
        )
    for resource in resources or []:
        fields = json_format.MessageToDict(resource, always_print_fields_with_no_presence=True)
        details.append({"@type": TYPE_URL_PREFIX + resource.DESCRIPTOR.full_name, **fields})
    return {
        "error": {
            "code": http_status if http_status is not None else http_status_for(code, reason),
            "status": code.name,
            "message": message,
            "details": details,
        }
    }


def body_response(body: dict[str, Any], headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An AIP-193 body as a response whose HTTP status is the body's `code`."""
    return JSONResponse(body, status_code=body["error"]["code"], headers=headers)


def error_response(
    code: grpc.StatusCode, message: str, *, headers: Mapping[str, str] | None = None, **details: Any
) -> JSONResponse:
    """`error_body(code, message, **details)` as a response whose HTTP status matches the body's `code`."""
    return body_response(error_body(code, message, **details), headers)


def internal_error_body() -> dict[str, Any]:
    """The body for an unexpected failure: nothing about what went wrong leaves the process."""
    return error_body(grpc.StatusCode.INTERNAL, "internal error", reason="INTERNAL", domain=DOMAIN)


def internal_error_response() -> JSONResponse:
    """The response for an unexpected failure: nothing about what went wrong leaves the process."""
    return body_response(internal_error_body())


def websocket_error_message(body: Mapping[str, Any]) -> str:
    """An AIP-193 body as a WebSocket error message: ``{"type": "error", "error": {...}}``."""
    return json.dumps({"type": "error", **body}, separators=(",", ":"), ensure_ascii=False)


def body_close_code(body: Mapping[str, Any]) -> int:
    """The WebSocket close code that goes with an AIP-193 body (from its status and ErrorInfo reason)."""
    error = body["error"]
    reasons = [d["reason"] for d in error["details"] if d.get("@type") == ERROR_INFO_TYPE]
    return close_code_for(grpc.StatusCode[error["status"]], reasons[0] if reasons else "")


def upstream_error_response(failure: UpstreamError) -> JSONResponse:
    """`upstream_error_body(failure)` as a response."""
    return body_response(upstream_error_body(failure))


def upstream_error_body(failure: UpstreamError) -> dict[str, Any]:
    """Relay a service's refusal; replace what gRPC itself produced with the gateway's own wording.

    A status carrying ErrorInfo was written on purpose by a Continuum service (`continuum_runtime.errors`)
    and is safe to relay as is. One without came from the gRPC stack (connection refused, deadline,
    a framework crash) and may quote addresses or internals, so the gateway describes it itself.
    """
    details = error_details(failure.error)
    upstream = failure.upstream
    if details.code == grpc.StatusCode.UNAUTHENTICATED:
        # The service refused the gateway's own credential or acting user: a deployment fault, not
        # the browser's. Answering 401 would make the browser discard a perfectly good token.
        logger.error(
            "upstream refused the gateway's credential", extra={"upstream": upstream, "reason": details.reason}
        )
        return internal_error_body()
    if details.reason:
        logger.info(
            "upstream refused call",
            extra={"upstream": upstream, "code": details.code.name, "reason": details.reason},
        )
        violations = [FieldViolation(failure.field_name(v.field), v.description) for v in details.violations]
        message = details.message
        for written, named in zip(details.violations, violations, strict=True):
            # Services word a refusal "<field>: <description>"; the message names the field as the body does.
            if message.startswith(f"{written.field}: "):
                message = named.field + message[len(written.field) :]
        return error_body(
            details.code,
            message,
            reason=details.reason,
            domain=details.domain,
            metadata=details.metadata,
            violations=violations,
            resources=_relayed(details.others),
        )
    logger.warning("upstream call failed", extra={"upstream": upstream, "code": details.code.name})
    if details.code == grpc.StatusCode.UNAVAILABLE:
        message, reason = f"{upstream} is unavailable", "UPSTREAM_UNAVAILABLE"
    elif details.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message, reason = f"{upstream} did not answer in time", "UPSTREAM_TIMEOUT"
    elif details.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # gRPC's own RESOURCE_EXHAUSTED (no ErrorInfo) means a message over the channel's size limit:
        # a permanent failure, so not a 429 that would tell the client to come back later.
        return error_body(
            grpc.StatusCode.INTERNAL,
            f"{upstream} answered with more than the gateway accepts",
            reason="UPSTREAM_RESPONSE_TOO_LARGE",
            domain=DOMAIN,
            metadata={"upstream": upstream},
        )
    elif HTTP_STATUS[details.code] >= 500:
        return internal_error_body()
    else:
        message, reason = f"{upstream} refused the call", "UPSTREAM_REFUSED"
    return error_body(details.code, message, reason=reason, domain=DOMAIN, metadata={"upstream": upstream})


def _relayed(others: tuple[any_pb2.Any, ...]) -> list[Message]:
    """The details of `others` (packed `Any`s) whose types the gateway relays, unpacked."""
    relayed = []
    for packed in others:
        kind = RELAYED_DETAILS.get(packed.TypeName())
        if kind is not None:
            message = kind()
            if packed.Unpack(message):
                relayed.append(message)
    return relayed


def _http_exception_error(exc: HTTPException) -> GatewayError:
    """Routing and framework refusals (no such route, wrong method) in AIP-193 form."""
    if exc.status_code == 404:
        return GatewayError(grpc.StatusCode.NOT_FOUND, "no such resource", reason="ROUTE_NOT_FOUND")
    if exc.status_code == 405:
        return GatewayError(grpc.StatusCode.UNIMPLEMENTED, "method not allowed", reason="METHOD_NOT_ALLOWED")
    if exc.status_code < 500:
        return GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT, exc.detail, reason="BAD_REQUEST", http_status=exc.status_code
        )
    return GatewayError(grpc.StatusCode.INTERNAL, "internal error", reason="INTERNAL")


async def _handle_gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def _handle_upstream_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, UpstreamError)
    return upstream_error_response(exc)


async def _handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    response = _http_exception_error(exc).response()
    if exc.headers:
        # e.g. Allow on a 405.
        response.headers.update(exc.headers)
    return response


def exception_handlers() -> dict[Any, ExceptionHandler]:
    """Starlette exception handlers turning every expected failure into an AIP-193 response.

    Anything else is caught by `access_log.AccessLogMiddleware`, which answers a bare 500.
    """
    return {
        GatewayError: _handle_gateway_error,
        UpstreamError: _handle_upstream_error,
        HTTPException: _handle_http_exception,
    }
