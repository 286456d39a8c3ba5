"""The compaction routes against real transcript and compaction services (offline provider, default thresholds)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from gateway_testing import ALICE_TOKEN, BOB_TOKEN, SERVICE_TOKEN, assert_error, bearer, violations
from google.protobuf import duration_pb2

from continuum.transcript.v1 import resources_pb2, transcript_service_pb2, transcript_service_pb2_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
BOB = bearer(BOB_TOKEN)


async def _new_session(gateway: httpx.AsyncClient) -> str:
    session_id = f"c-{uuid.uuid4().hex[:12]}"
    response = await gateway.post("/v1/sessions", headers=ALICE, json={"sessionId": session_id, "title": "t"})
    assert response.status_code == 201, response.text
    return session_id


async def _turns(gateway: httpx.AsyncClient, session_id: str, count: int) -> list[int]:
    """Append `count` complete turns (a user message and the assistant's reply); their message ids."""
    messages: list[dict[str, Any]] = []
    for turn in range(1, count + 1):
        messages.append({"role": "MESSAGE_ROLE_USER", "content": [{"text": f"question {turn}: what is {turn}?"}]})
        messages.append({"role": "MESSAGE_ROLE_ASSISTANT", "content": [{"text": f"answer {turn}: it is {turn}."}]})
    response = await gateway.post(f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": messages})
    assert response.status_code == 200, response.text
    return [int(message_id) for message_id in response.json()["messageIds"]]


def _paths(session_id: str) -> tuple[str, str, str]:
    base = f"/v1/sessions/{session_id}/compaction"
    return base, f"{base}/events", f"{base}:compactNow"


async def test_a_new_session_has_no_summary_and_no_events(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    summary, events, _ = _paths(session_id)

    got = await gateway.get(summary, headers=ALICE)
    assert (got.status_code, got.json()) == (200, {"data": None})
    listed = await gateway.get(events, headers=ALICE)
    assert (listed.status_code, listed.json()) == (200, {"events": [], "nextPageToken": ""})


async def test_compact_now_on_an_idle_session_compacts_and_is_recorded(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    ids = await _turns(gateway, session_id, 4)
    summary, events, compact_now = _paths(session_id)

    response = await gateway.post(compact_now, headers=ALICE)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["state"] == "COMPACT_NOW_STATE_COMPLETED"
    assert body["runId"] == ""
    report = body["report"]
    assert (report["outcome"], report["triggerMode"]) == ("COMPACTION_OUTCOME_COMPACTED", "TRIGGER_MODE_MANUAL")
    # Turn 4 is current and turns 2-3 stay verbatim: only turn 1 (its question and answer) is summarized.
    assert (report["boundaryBefore"], report["boundaryAfter"]) == ("0", str(ids[1]))
    assert int(report["eventId"]) > 0

    got = await gateway.get(summary, headers=ALICE)
    assert got.status_code == 200, got.text
    data = got.json()["data"]
    assert data["sessionId"] == session_id
    assert data["lastCompactedMessageId"] == str(ids[1])  # int64 travels as a string in proto JSON
    assert int(data["lastCompactedMessageId"]) > 0
    assert data["compactCount"] == 1
    assert data["model"] == "offline-extractive-1"
    assert "question 1" in data["summaryText"]
    assert data["createTime"].endswith("Z")
    assert data["updateTime"].endswith("Z")

    listed = await gateway.get(events, headers=ALICE)
    assert listed.status_code == 200, listed.text
    [event] = listed.json()["events"]
    assert (event["eventId"], event["sessionId"]) == (report["eventId"], session_id)
    assert (event["triggerMode"], event["outcome"]) == ("TRIGGER_MODE_MANUAL", "COMPACTION_OUTCOME_COMPACTED")
    assert (event["boundaryBefore"], event["boundaryAfter"]) == ("0", str(ids[1]))
    assert event["summaryText"] == ""  # only on request: summaries can be long
    with_text = await gateway.get(events, headers=ALICE, params={"includeSummaryText": "true"})
    assert with_text.json()["events"][0]["summaryText"] == data["summaryText"]


async def test_events_are_paged_newest_first(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    await _turns(gateway, session_id, 4)
    _, events, compact_now = _paths(session_id)
    outcomes = []
    for _ in range(2):
        response = await gateway.post(compact_now, headers=ALICE, json={"contextWindowTokens": "32000"})
        assert response.status_code == 200, response.text
        outcomes.append(response.json()["report"]["outcome"])
    # Nothing new happened between the two: the second has no whole turn left to compact.
    assert outcomes == ["COMPACTION_OUTCOME_COMPACTED", "COMPACTION_OUTCOME_NOTHING_TO_COMPACT"]

    first = await gateway.get(events, headers=ALICE, params={"pageSize": 1})
    assert first.status_code == 200, first.text
    [newest] = first.json()["events"]
    token = first.json()["nextPageToken"]
    assert newest["outcome"] == "COMPACTION_OUTCOME_NOTHING_TO_COMPACT"
    assert token
    second = await gateway.get(events, headers=ALICE, params={"pageSize": 1, "pageToken": token})
    assert second.status_code == 200, second.text
    assert [e["outcome"] for e in second.json()["events"]] == ["COMPACTION_OUTCOME_COMPACTED"]
    assert second.json()["nextPageToken"] == ""


async def test_compact_now_while_a_turn_runs_is_queued_for_that_run(
    gateway: httpx.AsyncClient, transcript: GrpcService
) -> None:
    session_id = await _new_session(gateway)
    await _turns(gateway, session_id, 4)
    _, _, compact_now = _paths(session_id)
    channel = open_channel(f"127.0.0.1:{transcript.port}")
    stub = transcript_service_pb2_grpc.TranscriptServiceStub(channel)
    metadata = call_metadata(SERVICE_TOKEN, "alice")
    try:
        claim = await stub.AcquireClaims(
            transcript_service_pb2.AcquireClaimsRequest(
                session_ids=[session_id],
                kind=resources_pb2.CLAIM_KIND_RUN,
                holder="run-7",
                ttl=duration_pb2.Duration(seconds=60),
            ),
            metadata=metadata,
        )
        try:
            response = await gateway.post(compact_now, headers=ALICE)
        finally:
            await stub.ReleaseClaims(
                transcript_service_pb2.ReleaseClaimsRequest(claim_id=claim.claim.claim_id), metadata=metadata
            )
    finally:
        await channel.close()
    assert response.status_code == 200, response.text
    assert response.json() == {"state": "COMPACT_NOW_STATE_QUEUED", "runId": "run-7"}


async def test_another_users_session_is_403_and_an_unknown_one_404(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    await _turns(gateway, session_id, 4)
    summary, events, compact_now = _paths(session_id)
    for response in [
        await gateway.get(summary, headers=BOB),
        await gateway.get(events, headers=BOB),
        await gateway.post(compact_now, headers=BOB),
    ]:
        error = assert_error(response, 403, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED")
        assert error["details"][0]["domain"] == "transcript.continuum", error
    # Bob's attempt compacted nothing of Alice's.
    assert (await gateway.get(summary, headers=ALICE)).json() == {"data": None}

    summary, events, compact_now = _paths("no-such-session")
    for response in [
        await gateway.get(summary, headers=ALICE),
        await gateway.get(events, headers=ALICE),
        await gateway.post(compact_now, headers=ALICE),
    ]:
        assert_error(response, 404, "NOT_FOUND", "SESSION_NOT_FOUND")


async def test_the_routes_need_a_bearer_token(gateway: httpx.AsyncClient) -> None:
    summary, events, compact_now = _paths("any")
    for response in [await gateway.get(summary), await gateway.get(events), await gateway.post(compact_now)]:
        assert_error(response, 401, "UNAUTHENTICATED")


async def test_bad_input_is_400_naming_the_field(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    summary, events, compact_now = _paths(session_id)
    # Refused by the gateway itself: not JSON, not proto JSON of the request, unknown parameters.
    gateway_cases: list[tuple[httpx.Response, str, str]] = [
        (await gateway.post(compact_now, headers=ALICE, content=b"{not json"), "body", "INVALID_JSON"),
        (await gateway.post(compact_now, headers=ALICE, json=[1]), "body", "INVALID_JSON"),
        (
            await gateway.post(compact_now, headers=ALICE, json={"contextWindow": 1}),
            "contextWindow",
            "INVALID_ARGUMENT",
        ),
        (
            await gateway.post(compact_now, headers=ALICE, json={"contextWindowTokens": "lots"}),
            "contextWindowTokens",
            "INVALID_ARGUMENT",
        ),
        (await gateway.post(compact_now, headers=ALICE, params={"force": "1"}), "force", "INVALID_ARGUMENT"),
        (await gateway.get(summary, headers=ALICE, params={"pageSize": "1"}), "pageSize", "INVALID_ARGUMENT"),
        (await gateway.get(events, headers=ALICE, params={"pageSize": "ten"}), "pageSize", "INVALID_ARGUMENT"),
        (
            await gateway.get(events, headers=ALICE, params={"includeSummaryText": "maybe"}),
            "includeSummaryText",
            "INVALID_ARGUMENT",
        ),
    ]
    for response, field, reason in gateway_cases:
        error = assert_error(response, 400, "INVALID_ARGUMENT", reason)
        assert error["details"][0]["domain"] == "gateway.continuum", error
        assert [v["field"] for v in violations(error)] == [field], error
    # Refused by compaction, and relayed naming the fields as the request did (camelCase; the path
    # parameter by its route name).
    invalid = "INVALID_ARGUMENT"
    service_cases: list[tuple[httpx.Response, str, str]] = [
        (
            await gateway.post(compact_now, headers=ALICE, json={"contextWindowTokens": -5}),
            "contextWindowTokens",
            invalid,
        ),
        (
            await gateway.post(compact_now, headers=ALICE, json={"contextWindowTokens": 10}),
            "contextWindowTokens",
            invalid,
        ),
        (await gateway.get(events, headers=ALICE, params={"pageSize": "-1"}), "pageSize", invalid),
        (await gateway.get(events, headers=ALICE, params={"pageToken": "forged"}), "pageToken", "PAGE_TOKEN_INVALID"),
        (await gateway.get("/v1/sessions/not%20an%20id/compaction", headers=ALICE), "session_id", invalid),
    ]
    for response, field, reason in service_cases:
        error = assert_error(response, 400, "INVALID_ARGUMENT", reason)
        assert error["details"][0]["domain"] == "compaction.continuum", error
        assert [v["field"] for v in violations(error)] == [field], error
    assert service_cases[0][0].json()["error"]["message"].startswith("contextWindowTokens: ")
    assert "between 1024 and" in service_cases[0][0].json()["error"]["message"]
    # Nothing was compacted by the refused calls.
    assert (await gateway.get(summary, headers=ALICE)).json() == {"data": None}


async def test_wrong_methods_are_405(gateway: httpx.AsyncClient) -> None:
    summary, events, compact_now = _paths("any")
    for response, allowed in [
        (await gateway.post(summary, headers=ALICE), "GET"),
        (await gateway.delete(events, headers=ALICE), "GET"),
        (await gateway.get(compact_now, headers=ALICE), "POST"),
    ]:
        assert_error(response, 405, "UNIMPLEMENTED", "METHOD_NOT_ALLOWED")
        assert allowed in response.headers["allow"]


async def test_an_unreachable_compaction_is_503(offline_gateway: httpx.AsyncClient) -> None:
    summary, _, _ = _paths("any")
    error = assert_error(await offline_gateway.get(summary, headers=ALICE), 503, "UNAVAILABLE", "UPSTREAM_UNAVAILABLE")
    assert error["message"] == "compaction is unavailable"
    assert error["details"][0]["metadata"] == {"upstream": "compaction"}


async def test_memory_injection_can_be_turned_off_and_on(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    path = f"/v1/sessions/{session_id}"
    assert (await gateway.get(path, headers=ALICE)).json()["session"]["memoryInjectionDisabled"] is False
    for disabled in (True, False):
        patched = await gateway.patch(
            path,
            headers=ALICE,
            params={"updateMask": "memoryInjectionDisabled"},
            json={"memoryInjectionDisabled": disabled},
        )
        assert patched.status_code == 200, patched.text
        assert patched.json()["session"]["memoryInjectionDisabled"] is disabled
        got = await gateway.get(path, headers=ALICE)
        assert got.json()["session"]["memoryInjectionDisabled"] is disabled
    forbidden = await gateway.patch(
        path, headers=BOB, params={"updateMask": "memoryInjectionDisabled"}, json={"memoryInjectionDisabled": True}
    )
    assert_error(forbidden, 403, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED")
