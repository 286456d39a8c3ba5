"""The outline (history-outline-v1), pinned message pages and the capability list, on a real transcript."""

from __future__ import annotations

import uuid
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

ALICE = bearer(ALICE_TOKEN)
BOB = bearer(BOB_TOKEN)
OUTLINE = "/session-history/outline"
WITH_OUTLINE = {**ALICE, "X-Continuum-Capabilities": "history-outline-v1"}
RESPONSE_FIELDS = {
    "status",
    "generation",
    "snapshotSequence",
    "coverageSequence",
    "totalTurns",
    "entries",
    "nextTurn",
    "done",
}


def _message(role: str, text: str) -> dict[str, Any]:
    return {"role": f"MESSAGE_ROLE_{role}", "content": [{"text": text}]}


async def _session(gateway: httpx.AsyncClient, *messages: dict[str, Any]) -> tuple[str, list[str]]:
    session_id = f"o-{uuid.uuid4().hex[:12]}"
    created = await gateway.post("/v1/sessions", headers=ALICE, json={"sessionId": session_id})
    assert created.status_code == 201, created.text
    if not messages:
        return session_id, []
    appended = await gateway.post(f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": messages})
    assert appended.status_code == 200, appended.text
    return session_id, list(appended.json()["messageIds"])


async def _conversation(gateway: httpx.AsyncClient) -> tuple[str, list[str]]:
    return await _session(
        gateway,
        _message("USER", "first question"),
        _message("ASSISTANT", "first answer"),
        _message("USER", "second question"),
        _message("ASSISTANT", "second answer"),
        _message("USER", "third question"),
    )


async def _outline(gateway: httpx.AsyncClient, headers: dict[str, str], **params: str) -> dict[str, Any]:
    response = await gateway.get(OUTLINE, headers=headers, params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert set(body) == RESPONSE_FIELDS, body
    return body


async def test_without_the_capability_the_answer_is_an_explicit_unsupported(gateway: httpx.AsyncClient) -> None:
    session_id, _ = await _conversation(gateway)
    body = await _outline(gateway, ALICE, sessionId=session_id)
    assert body["status"] == "unsupported"
    assert body["entries"] == []
    assert body["totalTurns"] == 0


async def test_with_the_capability_turns_are_listed(gateway: httpx.AsyncClient) -> None:
    session_id, ids = await _conversation(gateway)
    body = await _outline(gateway, WITH_OUTLINE, sessionId=session_id)
    assert body["status"] == "ok"
    assert (body["totalTurns"], body["nextTurn"], body["done"]) == (3, 4, True)
    assert body["generation"].isdigit()  # int64 values are strings, as in every route
    assert int(body["snapshotSequence"]) >= 1
    assert int(body["coverageSequence"]) >= int(body["snapshotSequence"])
    entries = body["entries"]
    assert [(e["messageId"], e["turn"], e["position"], e["prompt"]) for e in entries] == [
        (ids[0], 1, "0", "first question"),
        (ids[2], 2, "2", "second question"),
        (ids[4], 3, "4", "third question"),
    ]
    assert [e.get("answer") for e in entries] == ["first answer", "second answer", None]
    assert "answer" not in entries[2]  # optional: absent, not null or ""
    # Imported messages carry no sampling records, so no counts are invented.
    assert not any("samplingCount" in e or "toolCallCount" in e for e in entries)


async def test_empty_entries_encode_as_an_empty_list(gateway: httpx.AsyncClient) -> None:
    session_id, _ = await _session(gateway)
    body = await _outline(gateway, WITH_OUTLINE, sessionId=session_id)
    assert (body["status"], body["entries"], body["totalTurns"], body["done"]) == ("ok", [], 0, True)


async def test_the_capability_header_is_a_comma_separated_list(gateway: httpx.AsyncClient) -> None:
    session_id, _ = await _conversation(gateway)
    headers = {**ALICE, "X-Continuum-Capabilities": "transcript-v2 , history-outline-v1"}
    assert (await _outline(gateway, headers, sessionId=session_id))["status"] == "ok"
    headers = {**ALICE, "X-Continuum-Capabilities": "history-outline-v2"}
    assert (await _outline(gateway, headers, sessionId=session_id))["status"] == "unsupported"


async def test_later_pages_keep_the_first_pages_cut(gateway: httpx.AsyncClient) -> None:
    session_id, ids = await _conversation(gateway)
    first = await _outline(gateway, WITH_OUTLINE, sessionId=session_id, limit="2")
    assert ([e["turn"] for e in first["entries"]], first["nextTurn"], first["done"]) == ([1, 2], 3, False)
    # A turn committed after the first page does not appear on pages pinned to its cut.
    await gateway.post(
        f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": [_message("USER", "fourth")]}
    )
    second = await _outline(
        gateway,
        WITH_OUTLINE,
        sessionId=session_id,
        startTurn=str(first["nextTurn"]),
        limit="2",
        generation=first["generation"],
        snapshotSequence=first["snapshotSequence"],
    )
    assert second["status"] == "ok"
    assert (second["snapshotSequence"], second["totalTurns"]) == (first["snapshotSequence"], 3)
    assert ([e["messageId"] for e in second["entries"]], second["done"]) == ([ids[4]], True)
    fresh = await _outline(gateway, WITH_OUTLINE, sessionId=session_id)
    assert fresh["totalTurns"] == 4


async def test_a_pin_of_a_rewritten_history_is_stale(gateway: httpx.AsyncClient) -> None:
    session_id, ids = await _conversation(gateway)
    first = await _outline(gateway, WITH_OUTLINE, sessionId=session_id)
    edited = await gateway.post(
        f"/v1/sessions/{session_id}/messages/{ids[2]}:edit", headers=ALICE, json={"content": [{"text": "changed"}]}
    )
    assert edited.status_code == 200, edited.text
    stale = await _outline(
        gateway,
        WITH_OUTLINE,
        sessionId=session_id,
        startTurn="2",
        generation=first["generation"],
        snapshotSequence=first["snapshotSequence"],
    )
    assert (stale["status"], stale["entries"]) == ("stale", [])
    assert int(stale["generation"]) > int(first["generation"])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({}, "sessionId"),
        ({"startTurn": "first"}, "startTurn"),
        ({"limit": "many"}, "limit"),
        ({"generation": "-"}, "generation"),
        ({"pageSize": "3"}, "pageSize"),
    ],
    ids=["no-session", "start-not-a-number", "limit-not-a-number", "generation-not-a-number", "unknown-parameter"],
)
async def test_malformed_parameters_are_400(gateway: httpx.AsyncClient, params: dict[str, str], field: str) -> None:
    session_id, _ = await _session(gateway)
    query = {"sessionId": session_id, **params} if field != "sessionId" else params
    error = assert_error(await gateway.get(OUTLINE, headers=WITH_OUTLINE, params=query), 400, "INVALID_ARGUMENT")
    assert [v["field"] for v in violations(error)] == [field]


@pytest.mark.parametrize("params", [{"limit": "1001"}, {"startTurn": "-1"}], ids=["limit-over-1000", "negative-start"])
async def test_out_of_range_values_are_refused_by_transcript_as_400(
    gateway: httpx.AsyncClient, params: dict[str, str]
) -> None:
    session_id, _ = await _session(gateway)
    response = await gateway.get(OUTLINE, headers=WITH_OUTLINE, params={"sessionId": session_id, **params})
    assert_error(response, 400, "INVALID_ARGUMENT")


async def test_only_the_owner_reads_the_outline(gateway: httpx.AsyncClient) -> None:
    session_id, _ = await _conversation(gateway)
    for headers in ({**BOB, "X-Continuum-Capabilities": "history-outline-v1"}, BOB):
        response = await gateway.get(OUTLINE, headers=headers, params={"sessionId": session_id})
        assert_error(response, 403, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED")
    response = await gateway.get(OUTLINE, headers=WITH_OUTLINE, params={"sessionId": session_id + "-missing"})
    assert_error(response, 404, "NOT_FOUND", "SESSION_NOT_FOUND")
    assert_error(await gateway.get(OUTLINE, params={"sessionId": session_id}), 401, "UNAUTHENTICATED")


async def test_a_pinned_page_shows_its_cut_then_turns_stale(gateway: httpx.AsyncClient) -> None:
    session_id, ids = await _conversation(gateway)
    page_url = f"/v1/sessions/{session_id}/messages:page"
    latest = await gateway.get(page_url, headers=ALICE)
    assert latest.status_code == 200, latest.text
    assert latest.json()["status"] == "PIN_STATUS_OK"
    generation = latest.json()["streamGeneration"]
    cut = (await _outline(gateway, WITH_OUTLINE, sessionId=session_id))["snapshotSequence"]
    await gateway.post(
        f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": [_message("ASSISTANT", "late")]}
    )
    pin = {"streamGeneration": generation, "snapshotSequence": cut}
    pinned = await gateway.get(page_url, headers=ALICE, params=pin)
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["status"] == "PIN_STATUS_OK"
    assert [m["messageId"] for m in pinned.json()["messages"]] == ids  # not the later message
    unpinned = await gateway.get(page_url, headers=ALICE)
    assert len(unpinned.json()["messages"]) == len(ids) + 1

    edited = await gateway.post(
        f"/v1/sessions/{session_id}/messages/{ids[4]}:edit", headers=ALICE, json={"content": [{"text": "changed"}]}
    )
    assert edited.status_code == 200, edited.text
    stale = await gateway.get(page_url, headers=ALICE, params=pin)
    assert stale.status_code == 200, stale.text
    assert stale.json()["status"] == "PIN_STATUS_STALE"
    assert stale.json()["messages"] == []
    assert int(stale.json()["streamGeneration"]) > int(generation)


async def test_a_malformed_pin_is_400(gateway: httpx.AsyncClient) -> None:
    session_id, _ = await _session(gateway)
    response = await gateway.get(
        f"/v1/sessions/{session_id}/messages:page", headers=ALICE, params={"snapshotSequence": "latest"}
    )
    error = assert_error(response, 400, "INVALID_ARGUMENT")
    assert [v["field"] for v in violations(error)] == ["snapshotSequence"]


async def test_capabilities_are_advertised(gateway: httpx.AsyncClient) -> None:
    response = await gateway.get("/v1/capabilities", headers=ALICE)
    assert response.status_code == 200, response.text
    assert response.json() == {"capabilities": ["transcript-v2", "history-outline-v1", "compaction-v1"]}
    assert_error(await gateway.get("/v1/capabilities"), 401, "UNAUTHENTICATED")


async def test_merge_v2_is_advertised_when_the_deployment_runs_merge(tmp_path: Path) -> None:
    settings = gateway_settings(tmp_path, unused_address(), merge_address=unused_address())
    async with serving(create_app(settings)) as gateway:
        response = await gateway.get("/v1/capabilities", headers=ALICE)
    assert response.json() == {"capabilities": ["transcript-v2", "history-outline-v1", "compaction-v1", "merge-v2"]}
