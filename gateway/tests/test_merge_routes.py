"""The session merge routes against a real merge service (API only) in front of a real transcript.

Each test starts from Alice and Bob without an unfinished merge and leaves them so: a test that
starts a merge cancels it before it ends.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_testing import (
    ALICE_TOKEN,
    BOB_TOKEN,
    assert_error,
    bearer,
    gateway_settings,
    serving,
    unused_address,
    violations,
)

from continuum_gateway.app import create_app
from continuum_gateway.errors import TYPE_URL_PREFIX
from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
BOB = bearer(BOB_TOKEN)
OPERATION_TYPE = TYPE_URL_PREFIX + "continuum.merge.v1.MergeOperation"


async def _sessions(gateway: httpx.AsyncClient, headers: dict[str, str], count: int = 2) -> list[str]:
    """`count` new root sessions of the user `headers` authenticate, each with a message."""
    ids = []
    for _ in range(count):
        session_id = f"m-{uuid.uuid4().hex[:12]}"
        created = await gateway.post("/v1/sessions", headers=headers, json={"sessionId": session_id, "title": "t"})
        assert created.status_code == 201, created.text
        message = {"role": "MESSAGE_ROLE_USER", "content": [{"text": "hello"}]}
        appended = await gateway.post(
            f"/v1/sessions/{session_id}/messages", headers=headers, json={"messages": [message]}
        )
        assert appended.status_code == 200, appended.text
        ids.append(session_id)
    return ids


def _start_body(sources: list[str], key: str, **fields: Any) -> dict[str, Any]:
    return {"sourceSessionIds": sources, "primarySessionId": sources[0], "idempotencyKey": key, **fields}


def _operation_detail(error: dict[str, Any]) -> dict[str, Any]:
    """The merge operation a conflict carries in its details."""
    operations: list[dict[str, Any]] = [d for d in error["details"] if d["@type"] == OPERATION_TYPE]
    assert len(operations) == 1, error
    return operations[0]


@pytest.fixture
async def started(merge_gateway: httpx.AsyncClient) -> AsyncIterator[tuple[dict[str, Any], list[str], str]]:
    """A merge of two new sessions of Alice's, cancelled when the test ends: (operation, sources, key)."""
    sources = await _sessions(merge_gateway, ALICE)
    key = f"key-{uuid.uuid4().hex}"
    response = await merge_gateway.post("/v1/session-merges", headers=ALICE, json=_start_body(sources, key))
    assert response.status_code == 201, response.text
    operation: dict[str, Any] = response.json()["operation"]
    yield operation, sources, key
    operation_id = operation["progress"]["operationId"]
    cancelled = await merge_gateway.post(f"/v1/session-merges/{operation_id}:cancel", headers=ALICE)
    assert cancelled.status_code == 200, cancelled.text


async def test_merge_v2_is_advertised_and_served_only_with_a_merge_address(
    merge_gateway: httpx.AsyncClient, gateway: httpx.AsyncClient
) -> None:
    with_merge = await merge_gateway.get("/v1/capabilities", headers=ALICE)
    assert with_merge.json()["capabilities"] == ["transcript-v2", "history-outline-v1", "compaction-v1", "merge-v2"]
    without = await gateway.get("/v1/capabilities", headers=ALICE)
    assert "merge-v2" not in without.json()["capabilities"]
    assert_error(await gateway.get("/v1/session-merges:active", headers=ALICE), 404, "NOT_FOUND", "ROUTE_NOT_FOUND")
    ready = await merge_gateway.get("/readyz")
    assert ready.json()["upstreams"] == {"transcript": "SERVING", "compaction": "SERVING", "merge": "SERVING"}


async def test_start_answers_the_operation_with_its_location_and_a_repeat_answers_it_again(
    merge_gateway: httpx.AsyncClient, started: tuple[dict[str, Any], list[str], str]
) -> None:
    operation, sources, key = started
    progress = operation["progress"]
    assert progress["protocolVersion"] == 2
    assert (progress["status"], progress["stage"]) == ("MERGE_STATUS_PREPARING", "MERGE_STAGE_SNAPSHOTTING")
    assert sorted(progress["lockedSourceSessionIds"]) == sorted(sources)
    assert progress["runEpoch"] == "1"  # int64: a string
    assert (progress["canCancel"], progress["targetAvailable"]) == (True, False)
    assert operation["parameters"]["sourceSessionIds"] == sources
    assert operation["idempotencyKey"] == key
    operation_id = progress["operationId"]

    again = await merge_gateway.post("/v1/session-merges", headers=ALICE, json=_start_body(sources, key))
    assert again.status_code == 200, again.text
    assert again.json()["created"] is False
    assert again.json()["operation"]["progress"]["operationId"] == operation_id
    assert again.headers["Location"] == f"/v1/session-merges/{operation_id}"

    read = await merge_gateway.get(f"/v1/session-merges/{operation_id}", headers=ALICE)
    assert read.status_code == 200, read.text
    assert read.json()["operation"]["progress"]["operationId"] == operation_id
    active = await merge_gateway.get("/v1/session-merges:active", headers=ALICE)
    assert active.status_code == 200, active.text
    assert active.json()["operation"]["progress"]["operationId"] == operation_id


async def test_conflicts_carry_the_latest_operation(
    merge_gateway: httpx.AsyncClient, started: tuple[dict[str, Any], list[str], str]
) -> None:
    operation, sources, key = started
    operation_id = operation["progress"]["operationId"]
    others = await _sessions(merge_gateway, ALICE)

    second = await merge_gateway.post(
        "/v1/session-merges", headers=ALICE, json=_start_body(others, f"other-{uuid.uuid4().hex}")
    )
    error = assert_error(second, 409, "ALREADY_EXISTS", "MERGE_ACTIVE_EXISTS")
    assert error["details"][0]["domain"] == "merge.continuum"
    assert _operation_detail(error)["progress"]["operationId"] == operation_id

    reused = await merge_gateway.post("/v1/session-merges", headers=ALICE, json=_start_body(others, key))
    error = assert_error(reused, 409, "ALREADY_EXISTS", "MERGE_IDEMPOTENCY_CONFLICT")
    assert _operation_detail(error)["parameters"]["sourceSessionIds"] == sources

    # Only a paused operation resumes: the refusal shows the operation still preparing.
    resume = await merge_gateway.post(
        f"/v1/session-merges/{operation_id}:resume", headers=ALICE, json={"expectedEpoch": "1"}
    )
    error = assert_error(resume, 409, "FAILED_PRECONDITION", "MERGE_STALE_OPERATION")
    assert _operation_detail(error)["progress"]["status"] == "MERGE_STATUS_PREPARING"


async def test_cancel_frees_the_slot_and_a_repeated_cancel_answers_the_same(merge_gateway: httpx.AsyncClient) -> None:
    sources = await _sessions(merge_gateway, ALICE)
    started = await merge_gateway.post(
        "/v1/session-merges", headers=ALICE, json=_start_body(sources, f"k-{uuid.uuid4().hex}")
    )
    operation_id = started.json()["operation"]["progress"]["operationId"]
    cancelled = await merge_gateway.post(f"/v1/session-merges/{operation_id}:cancel", headers=ALICE)
    assert cancelled.status_code == 200, cancelled.text
    progress = cancelled.json()["operation"]["progress"]
    assert progress["status"] == "MERGE_STATUS_CANCELLED"
    assert progress["lockedSourceSessionIds"] == []
    again = await merge_gateway.post(f"/v1/session-merges/{operation_id}:cancel", headers=ALICE)
    assert again.status_code == 200, again.text
    assert again.json()["operation"]["progress"]["status"] == "MERGE_STATUS_CANCELLED"

    none = await merge_gateway.get("/v1/session-merges:active", headers=ALICE)
    assert (none.status_code, none.content) == (204, b"")
    # The sources are free again: a session can take a new message.
    message = {"role": "MESSAGE_ROLE_USER", "content": [{"text": "again"}]}
    appended = await merge_gateway.post(
        f"/v1/sessions/{sources[0]}/messages", headers=ALICE, json={"messages": [message]}
    )
    assert appended.status_code == 200, appended.text


async def test_another_users_operation_and_sessions_are_403(
    merge_gateway: httpx.AsyncClient, started: tuple[dict[str, Any], list[str], str]
) -> None:
    operation, sources, _ = started
    operation_id = operation["progress"]["operationId"]
    for response in (
        await merge_gateway.get(f"/v1/session-merges/{operation_id}", headers=BOB),
        await merge_gateway.post(f"/v1/session-merges/{operation_id}:cancel", headers=BOB),
        await merge_gateway.post(f"/v1/session-merges/{operation_id}:resume", headers=BOB, json={"expectedEpoch": "1"}),
    ):
        assert_error(response, 403, "PERMISSION_DENIED", "MERGE_PERMISSION_DENIED")
    # Bob has no merge of his own; Alice's is untouched.
    assert (await merge_gateway.get("/v1/session-merges:active", headers=BOB)).status_code == 204
    read = await merge_gateway.get(f"/v1/session-merges/{operation_id}", headers=ALICE)
    assert read.json()["operation"]["progress"]["status"] == "MERGE_STATUS_PREPARING"
    # Alice's sessions are not Bob's to merge (transcript refuses; its domain is kept).
    bobs = await _sessions(merge_gateway, BOB, count=1)
    refused = await merge_gateway.post(
        "/v1/session-merges", headers=BOB, json=_start_body([bobs[0], sources[1]], f"b-{uuid.uuid4().hex}")
    )
    error = assert_error(refused, 403, "PERMISSION_DENIED")
    assert error["details"][0]["domain"] == "transcript.continuum"
    assert (await merge_gateway.get("/v1/session-merges:active", headers=BOB)).status_code == 204


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sourceSessionIds": ["a"], "primarySessionId": "a", "idempotencyKey": "k"}, "sourceSessionIds"),
        ({"sourceSessionIds": ["a", "a"], "primarySessionId": "a", "idempotencyKey": "k"}, "sourceSessionIds[1]"),
        ({"sourceSessionIds": ["a", "b/c"], "primarySessionId": "a", "idempotencyKey": "k"}, "sourceSessionIds[1]"),
        ({"sourceSessionIds": ["a", "b"], "primarySessionId": "c", "idempotencyKey": "k"}, "primarySessionId"),
        ({"sourceSessionIds": ["a", "b"], "primarySessionId": "a"}, "idempotencyKey"),
        ({"sourceSessionIds": ["a", "b"], "primarySessionId": "a", "idempotencyKey": "k k"}, "idempotencyKey"),
        (_start_body(["a", "b"], "k", title="t" * 201), "title"),
        (_start_body(["a", "b"], "k", model=" padded"), "model"),
        # Refused by the gateway itself, before merge is called.
        (_start_body(["a", "b"], "k", sourceSessionIds="a"), "sourceSessionIds"),
        (_start_body(["a", "b"], "k", operationId="x"), "operationId"),
    ],
)
async def test_bad_start_requests_name_the_field(
    merge_gateway: httpx.AsyncClient, body: dict[str, Any], field: str
) -> None:
    error = assert_error(
        await merge_gateway.post("/v1/session-merges", headers=ALICE, json=body), 400, "INVALID_ARGUMENT"
    )
    assert [v["field"] for v in violations(error)] == [field], error


async def test_bad_ids_and_epochs_name_the_parameter(merge_gateway: httpx.AsyncClient) -> None:
    unknown = uuid.uuid4().hex
    for response in (
        await merge_gateway.get("/v1/session-merges/not-an-id", headers=ALICE),
        await merge_gateway.post("/v1/session-merges/not-an-id:cancel", headers=ALICE),
        await merge_gateway.post("/v1/session-merges/not-an-id:resume", headers=ALICE, json={"expectedEpoch": "1"}),
    ):
        error = assert_error(response, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
        assert [v["field"] for v in violations(error)] == ["operation_id"], error
    for epoch in ("0", "-3"):
        resume = await merge_gateway.post(
            f"/v1/session-merges/{unknown}:resume", headers=ALICE, json={"expectedEpoch": epoch}
        )
        error = assert_error(resume, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
        assert [v["field"] for v in violations(error)] == ["expectedEpoch"], error
    malformed = await merge_gateway.post(
        f"/v1/session-merges/{unknown}:resume", headers=ALICE, json={"expectedEpoch": "three"}
    )
    assert [v["field"] for v in violations(assert_error(malformed, 400, "INVALID_ARGUMENT"))] == ["expectedEpoch"]
    for response in (
        await merge_gateway.get(f"/v1/session-merges/{unknown}", headers=ALICE),
        await merge_gateway.post(f"/v1/session-merges/{unknown}:cancel", headers=ALICE),
    ):
        assert_error(response, 404, "NOT_FOUND", "MERGE_OPERATION_NOT_FOUND")
    # The path names the operation: a body naming another is refused, one naming the same is fine.
    other = await merge_gateway.post(
        f"/v1/session-merges/{unknown}:resume", headers=ALICE, json={"expectedEpoch": "1", "operationId": "x"}
    )
    assert [v["field"] for v in violations(assert_error(other, 400, "INVALID_ARGUMENT"))] == ["operationId"]
    named = await merge_gateway.post(
        f"/v1/session-merges/{unknown}:resume", headers=ALICE, json={"expectedEpoch": "1", "operationId": unknown}
    )
    assert_error(named, 404, "NOT_FOUND", "MERGE_OPERATION_NOT_FOUND")
    assert_error(
        await merge_gateway.get("/v1/session-merges", headers=ALICE), 405, "UNIMPLEMENTED", "METHOD_NOT_ALLOWED"
    )
    assert_error(await merge_gateway.post("/v1/session-merges", headers={}, json={}), 401, "UNAUTHENTICATED")


async def test_an_unreachable_merge_service_is_503(transcript: GrpcService, tmp_path: Path) -> None:
    settings = gateway_settings(tmp_path, f"127.0.0.1:{transcript.port}", merge_address=unused_address())
    async with serving(create_app(settings)) as client:
        response = await client.get("/v1/session-merges:active", headers=ALICE)
        error = assert_error(response, 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")
        assert error["details"][0]["metadata"] == {"upstream": "merge"}
        ready = await client.get("/readyz")
        assert_error(ready, 503, "UNAVAILABLE", "UPSTREAM_NOT_READY")
