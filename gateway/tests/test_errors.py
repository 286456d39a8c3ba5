"""The gRPC → HTTP table, the AIP-193 body, and how failures of every origin become responses."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from gateway_testing import ALICE_TOKEN, assert_error, bearer, gateway_settings, serving, unused_address, violations
from grpc_status import rpc_status
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from continuum.gateway.v1 import error_reason_pb2 as gateway_reasons
from continuum.merge.v1 import error_reason_pb2 as merge_reasons
from continuum.merge.v1 import resources_pb2 as merge_resources
from continuum.transcript.v1 import error_reason_pb2 as transcript_reasons
from continuum.transcript.v1 import resources_pb2 as transcript_resources
from continuum_gateway.access_log import AccessLogMiddleware
from continuum_gateway.app import create_app
from continuum_gateway.errors import (
    HTTP_STATUS,
    REASON_HTTP_STATUS,
    WEBSOCKET_CLOSE_CODE,
    GatewayError,
    UpstreamError,
    body_close_code,
    close_code_for,
    error_body,
    http_status_for,
    upstream_error_body,
    upstream_error_response,
)
from continuum_gateway.protojson import MAX_BODY_DEPTH
from continuum_runtime.errors import FieldViolation, InvalidArgument, ServiceError, Unauthenticated

# google/rpc/code.proto, written out independently of the table under test.
CANONICAL = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
    "UNAUTHENTICATED": 401,
}


def test_table_is_googles_canonical_mapping_for_every_code() -> None:
    assert {code.name: status for code, status in HTTP_STATUS.items()} == CANONICAL
    assert set(HTTP_STATUS) == set(grpc.StatusCode)


def test_close_codes_are_4000_plus_the_http_status_for_every_code() -> None:
    assert set(WEBSOCKET_CLOSE_CODE) == set(grpc.StatusCode)
    for code, close in WEBSOCKET_CLOSE_CODE.items():
        assert close == (1000 if code == grpc.StatusCode.OK else 4000 + CANONICAL[code.name]), code
        assert 4000 <= close <= 4999 or close == 1000  # RFC 6455: 4000-4999 belong to the application


def test_upgrade_required_is_426_and_4426_whoever_detects_it() -> None:
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    assert close_code_for(precondition) == 4400
    assert close_code_for(precondition, "UPGRADE_REQUIRED") == 4426
    own = GatewayError(precondition, "upgrade", reason="UPGRADE_REQUIRED")
    assert (own.http_status, body_close_code(own.body())) == (426, 4426)

    class _UpgradeRequired(ServiceError):
        code = precondition
        reason = "UPGRADE_REQUIRED"
        domain = "transcript.continuum"

    relayed = upstream_error_body(_failed_call(precondition, "upgrade", _UpgradeRequired("upgrade")))
    assert (relayed["error"]["code"], body_close_code(relayed)) == (426, 4426)
    other = upstream_error_body(_failed_call(grpc.StatusCode.NOT_FOUND, "x", _NotFound("x")))
    assert body_close_code(other) == 4404


def test_body_carries_error_info_and_field_violations() -> None:
    body = error_body(
        grpc.StatusCode.INVALID_ARGUMENT,
        "messages[0].content: empty",
        reason="MESSAGE_EMPTY",
        domain="transcript.continuum",
        metadata={"session_id": "s1"},
        violations=[FieldViolation("messages[0].content", "empty")],
    )
    assert body == {
        "error": {
            "code": 400,
            "status": "INVALID_ARGUMENT",
            "message": "messages[0].content: empty",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "MESSAGE_EMPTY",
                    "domain": "transcript.continuum",
                    "metadata": {"session_id": "s1"},
                },
                {
                    "@type": "type.googleapis.com/google.rpc.BadRequest",
                    "fieldViolations": [{"field": "messages[0].content", "description": "empty"}],
                },
            ],
        }
    }


def test_body_without_reason_has_no_details() -> None:
    assert error_body(grpc.StatusCode.NOT_FOUND, "gone")["error"] == {
        "code": 404,
        "status": "NOT_FOUND",
        "message": "gone",
        "details": [],
    }


def test_gateway_error_http_status_follows_the_table_unless_overridden() -> None:
    assert GatewayError(grpc.StatusCode.ABORTED, "x", reason="R").response().status_code == 409
    overridden = GatewayError(grpc.StatusCode.UNIMPLEMENTED, "x", reason="R", http_status=405)
    assert overridden.response().status_code == 405


def _failed_call(status: grpc.StatusCode, details: str, service_error: ServiceError | None = None) -> UpstreamError:
    """A real AioRpcError as a grpc.aio client raises it, optionally carrying a service's status."""
    trailing = grpc.aio.Metadata()
    if service_error is not None:
        converted = rpc_status.to_status(service_error.to_status())
        trailing = grpc.aio.Metadata(*converted.trailing_metadata)
    return UpstreamError("transcript", grpc.aio.AioRpcError(status, grpc.aio.Metadata(), trailing, details))


class _NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "SESSION_NOT_FOUND"
    domain = "transcript.continuum"


class _WithResources(ServiceError):
    """A conflict carrying resources beside its ErrorInfo, as merge's conflicts carry their operation."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "MERGE_ACTIVE_EXISTS"
    domain = "merge.continuum"

    def __init__(self, *resources: Any) -> None:
        super().__init__("an unfinished merge exists")
        self.resources = resources

    def to_status(self) -> Any:
        status = super().to_status()
        for resource in self.resources:
            status.details.add().Pack(resource)
        return status


def test_a_merge_operation_a_refusal_carries_is_relayed_and_nothing_else_is() -> None:
    operation = merge_resources.MergeOperation(
        progress=merge_resources.MergeProgress(
            operation_id="a" * 32, run_epoch=3, status=merge_resources.MERGE_STATUS_PAUSED
        ),
        idempotency_key="k",
    )
    session = transcript_resources.Session(session_id="s", title="not for the browser")
    failure = _failed_call(grpc.StatusCode.ALREADY_EXISTS, "x", _WithResources(session, operation))

    body = upstream_error_body(failure)

    assert body["error"]["code"] == 409
    info, relayed = body["error"]["details"]
    assert info["reason"] == "MERGE_ACTIVE_EXISTS"
    assert relayed["@type"] == "type.googleapis.com/continuum.merge.v1.MergeOperation"
    assert relayed["progress"]["operationId"] == "a" * 32
    assert relayed["progress"]["runEpoch"] == "3"
    assert relayed["progress"]["status"] == "MERGE_STATUS_PAUSED"
    # Every field without presence is there, zero values included, as in a response.
    assert relayed["progress"]["snapshotSealed"] is False
    assert relayed["idempotencyKey"] == "k"


def _error_of(response: Response) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(bytes(response.body))["error"]
    return error


def test_service_refusal_is_relayed_with_its_error_info() -> None:
    failure = _failed_call(
        grpc.StatusCode.NOT_FOUND, "no such session", _NotFound("no such session", metadata={"session_id": "s9"})
    )
    response = upstream_error_response(failure)
    assert response.status_code == 404
    assert _error_of(response) == {
        "code": 404,
        "status": "NOT_FOUND",
        "message": "no such session",
        "details": [
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "SESSION_NOT_FOUND",
                "domain": "transcript.continuum",
                "metadata": {"session_id": "s9"},
            }
        ],
    }


def test_service_bad_request_keeps_field_violations() -> None:
    refusal = InvalidArgument("messages[0].role", "must be set")
    response = upstream_error_response(_failed_call(grpc.StatusCode.INVALID_ARGUMENT, refusal.message, refusal))
    assert response.status_code == 400
    assert _error_of(response)["details"][1] == {
        "@type": "type.googleapis.com/google.rpc.BadRequest",
        "fieldViolations": [{"field": "messages[0].role", "description": "must be set"}],
    }


def test_transport_failure_is_described_by_the_gateway_not_grpc() -> None:
    raw = "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.1.2.3:50151: Connection refused"
    response = upstream_error_response(_failed_call(grpc.StatusCode.UNAVAILABLE, raw))
    assert response.status_code == 503
    error = _error_of(response)
    assert error["status"] == "UNAVAILABLE"
    assert error["message"] == "transcript is unavailable"
    assert "10.1.2.3" not in str(error)


def test_deadline_is_a_504() -> None:
    response = upstream_error_response(_failed_call(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert (response.status_code, _error_of(response)["status"]) == (504, "DEADLINE_EXCEEDED")


def test_bare_internal_from_grpc_reveals_nothing() -> None:
    response = upstream_error_response(_failed_call(grpc.StatusCode.UNKNOWN, "Unexpected <class 'KeyError'>: 'row 7'"))
    assert response.status_code == 500
    error = _error_of(response)
    assert (error["status"], error["message"]) == ("INTERNAL", "internal error")
    assert "row 7" not in str(error)


def test_service_refusing_the_gateway_credential_is_not_the_browsers_401() -> None:
    refusal = Unauthenticated("a valid service credential is required")
    response = upstream_error_response(_failed_call(grpc.StatusCode.UNAUTHENTICATED, refusal.message, refusal))
    assert response.status_code == 500
    assert _error_of(response)["message"] == "internal error"


async def test_unexpected_exception_is_a_bare_500_and_logs_no_message(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("secret message content")

    transport = httpx.ASGITransport(app=AccessLogMiddleware(broken))
    with caplog.at_level(logging.INFO, logger="continuum"):
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as client:
            response = await client.get("/v1/sessions")
    error = assert_error(response, 500, "INTERNAL", "INTERNAL")
    assert error["message"] == "internal error"
    assert "secret" not in response.text
    assert any(record.getMessage() == "request failed" for record in caplog.records)
    assert any(getattr(record, "status", None) == 500 for record in caplog.records)


@pytest.fixture
async def gateway_without_upstream(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway accepting bodies of at most 1 KiB, with nothing behind it."""
    async with serving(create_app(gateway_settings(tmp_path, unused_address(), max_request_bytes=1024))) as client:
        yield client


async def test_unknown_route_is_an_aip193_404(offline_gateway: httpx.AsyncClient) -> None:
    response = await offline_gateway.get("/v1/nothing-here", headers=bearer(ALICE_TOKEN))
    assert_error(response, 404, "NOT_FOUND", "ROUTE_NOT_FOUND")


async def test_wrong_method_is_405_allowing_every_method_of_the_resource(offline_gateway: httpx.AsyncClient) -> None:
    response = await offline_gateway.put("/v1/sessions/s1", headers=bearer(ALICE_TOKEN))
    assert_error(response, 405, "UNIMPLEMENTED", "METHOD_NOT_ALLOWED")
    assert set(response.headers["allow"].split(", ")) == {"GET", "HEAD", "PATCH", "DELETE"}


async def test_a_custom_method_sent_with_the_wrong_method_is_405_not_a_bad_id(
    offline_gateway: httpx.AsyncClient,
) -> None:
    # `5:edit` is no message id: the route is `…/messages/{message_id}:edit`, which takes POST only.
    response = await offline_gateway.get("/v1/sessions/s-a/messages/5:edit", headers=bearer(ALICE_TOKEN))
    assert_error(response, 405, "UNIMPLEMENTED", "METHOD_NOT_ALLOWED")
    assert response.headers["allow"] == "POST"
    # Any other colon belongs to the id, which goes to the service to be checked (down here: 503).
    response = await offline_gateway.get("/v1/sessions/s:a", headers=bearer(ALICE_TOKEN))
    assert_error(response, 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")


async def test_body_over_the_limit_is_413(gateway_without_upstream: httpx.AsyncClient) -> None:
    body = b'{"title": "' + b"x" * 2048 + b'"}'
    declared = await gateway_without_upstream.post("/v1/sessions", headers=bearer(ALICE_TOKEN), content=body)
    assert_error(declared, 413, "INVALID_ARGUMENT", "REQUEST_TOO_LARGE")

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 256):
            yield body[start : start + 256]

    # Without Content-Length the cap is enforced while the body streams in.
    streamed = await gateway_without_upstream.post("/v1/sessions", headers=bearer(ALICE_TOKEN), content=chunks())
    assert_error(streamed, 413, "INVALID_ARGUMENT", "REQUEST_TOO_LARGE")


async def test_upstream_down_is_503(offline_gateway: httpx.AsyncClient) -> None:
    response = await offline_gateway.post("/v1/sessions", headers=bearer(ALICE_TOKEN), json={"title": "t"})
    error = assert_error(response, 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")
    assert error["details"][0]["metadata"] == {"upstream": "transcript"}


async def test_bad_json_is_refused_by_the_gateway_before_any_upstream_call(offline_gateway: httpx.AsyncClient) -> None:
    # The upstream is down: a 400 proves the gateway refused the body itself.
    for body in (b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b"[" * 100_000):
        response = await offline_gateway.post("/v1/sessions", headers=bearer(ALICE_TOKEN), content=body)
        error = assert_error(response, 400, "INVALID_ARGUMENT", "INVALID_JSON")
        assert violations(error)[0]["field"] == "body"
    response = await offline_gateway.post("/v1/sessions", headers=bearer(ALICE_TOKEN), json={"titel": "typo"})
    error = assert_error(response, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
    assert "titel" in error["message"]


async def test_bodies_nested_deeper_than_protobuf_decodes_are_refused_naming_where(
    offline_gateway: httpx.AsyncClient,
) -> None:
    # Metadata is free-form JSON; at 33 levels or more it passed here, then failed upstream as a 500.
    metadata: dict[str, object] = {"leaf": 1}
    for _ in range(MAX_BODY_DEPTH):
        metadata = {"a": metadata}
    response = await offline_gateway.post("/v1/sessions", headers=bearer(ALICE_TOKEN), json={"metadata": metadata})
    error = assert_error(response, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
    (violation,) = violations(error)
    assert violation["field"] == "metadata" + ".a" * (MAX_BODY_DEPTH - 1)
    assert f"more than {MAX_BODY_DEPTH} levels" in violation["description"]
    # Just within the bound it goes on to the service (down here: 503).
    within_bound = await offline_gateway.post(
        "/v1/sessions",
        headers=bearer(ALICE_TOKEN),
        json={"metadata": metadata["a"]["a"]},  # type: ignore[index]
    )
    assert_error(within_bound, 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")


async def test_a_method_without_a_body_refuses_one_instead_of_ignoring_it(offline_gateway: httpx.AsyncClient) -> None:
    session = "/v1/sessions/s-a"
    for body in (b"junk", b"[1]"):
        response = await offline_gateway.request("DELETE", session, headers=bearer(ALICE_TOKEN), content=body)
        assert violations(assert_error(response, 400, "INVALID_ARGUMENT", "INVALID_JSON"))[0]["field"] == "body"
    unknown = await offline_gateway.request("DELETE", session, headers=bearer(ALICE_TOKEN), json={"force": True})
    assert violations(assert_error(unknown, 400, "INVALID_ARGUMENT"))[0]["field"] == "body"
    # None, or an empty object, is what the method takes (the service is down here: 503).
    for body in (b"", b"{}"):
        response = await offline_gateway.request("DELETE", session, headers=bearer(ALICE_TOKEN), content=body)
        assert_error(response, 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")


async def test_a_body_naming_another_resource_than_the_path_is_refused(offline_gateway: httpx.AsyncClient) -> None:
    update = "/v1/sessions/s-a?updateMask=title"
    other = await offline_gateway.patch(update, headers=bearer(ALICE_TOKEN), json={"sessionId": "s-b", "title": "t"})
    (violation,) = violations(assert_error(other, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT"))
    assert violation["field"] == "session.sessionId" and "s-a" in violation["description"]
    same = await offline_gateway.patch(update, headers=bearer(ALICE_TOKEN), json={"sessionId": "s-a", "title": "t"})
    assert_error(same, 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")


def test_reasons_more_precise_than_their_code_have_their_own_status() -> None:
    assert http_status_for(grpc.StatusCode.DEADLINE_EXCEEDED, "REQUEST_TIMEOUT") == 408
    assert http_status_for(grpc.StatusCode.DEADLINE_EXCEEDED) == 504
    assert http_status_for(grpc.StatusCode.INVALID_ARGUMENT, "REQUEST_TOO_LARGE") == 413
    assert http_status_for(grpc.StatusCode.UNIMPLEMENTED, "METHOD_NOT_ALLOWED") == 405
    assert http_status_for(grpc.StatusCode.FAILED_PRECONDITION, "MERGE_ALREADY_COMPLETED") == 409
    assert http_status_for(grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING") == 409
    assert http_status_for(grpc.StatusCode.FAILED_PRECONDITION, "ATTEMPT_CONFLICT") == 400
    # Every such reason is one a contract names.
    named = {
        *gateway_reasons.ErrorReason.keys(),
        *merge_reasons.ErrorReason.keys(),
        *transcript_reasons.ErrorReason.keys(),
    }
    assert set(REASON_HTTP_STATUS) <= named
