"""Every route against a real transcript service: success shapes, ownership and validation errors."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_testing import (
    ALICE_TOKEN,
    BOB_TOKEN,
    SERVICE_TOKEN,
    assert_error,
    bearer,
    gateway_settings,
    serving,
    violations,
)
from pydantic import SecretStr

from continuum_gateway.app import create_app
from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
BOB = bearer(BOB_TOKEN)


def _user(text: str) -> dict[str, Any]:
    return {"role": "MESSAGE_ROLE_USER", "content": [{"text": text}]}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "MESSAGE_ROLE_ASSISTANT", "content": [{"text": text}]}


async def _new_session(gateway: httpx.AsyncClient, **fields: Any) -> str:
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    response = await gateway.post("/v1/sessions", headers=ALICE, json={"sessionId": session_id, **fields})
    assert response.status_code == 201, response.text
    return session_id


async def _append(gateway: httpx.AsyncClient, session_id: str, *messages: dict[str, Any]) -> list[str]:
    response = await gateway.post(f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": messages})
    assert response.status_code == 200, response.text
    return list(response.json()["messageIds"])


async def test_create_is_201_then_200_when_repeated(gateway: httpx.AsyncClient) -> None:
    session_id = f"s-{uuid.uuid4().hex[:12]}"
    body = {"sessionId": session_id, "title": "first", "kind": "SESSION_KIND_CHAT", "model": "m1"}
    created = await gateway.post("/v1/sessions", headers=ALICE, json=body)
    assert created.status_code == 201, created.text
    assert created.headers["location"] == f"/v1/sessions/{session_id}"
    payload = created.json()
    assert payload["created"] is True
    session = payload["session"]
    assert (session["sessionId"], session["owner"], session["title"]) == (session_id, "alice", "first")
    assert session["rootSessionId"] == session_id
    assert isinstance(session["historyGeneration"], str)  # int64 travels as a string in proto JSON
    assert session["historyGeneration"].isdigit()
    again = await gateway.post("/v1/sessions", headers=ALICE, json=body)
    assert again.status_code == 200, again.text
    assert again.json()["created"] is False


async def test_create_without_id_gets_one(gateway: httpx.AsyncClient) -> None:
    response = await gateway.post("/v1/sessions", headers=ALICE, json={"title": "untitled"})
    assert response.status_code == 201, response.text
    assert response.json()["session"]["sessionId"]


async def test_get_list_update_delete(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway, title="before", model="m1")
    child_id = await _new_session(gateway, parentSessionId=session_id, kind="SESSION_KIND_SUBTASK")

    got = await gateway.get(f"/v1/sessions/{session_id}", headers=ALICE)
    assert got.status_code == 200, got.text
    assert got.json()["session"]["title"] == "before"

    children = await gateway.get("/v1/sessions", headers=ALICE, params={"parentSessionId": session_id})
    assert children.status_code == 200, children.text
    assert [s["sessionId"] for s in children.json()["sessions"]] == [child_id]

    first_page = await gateway.get("/v1/sessions", headers=ALICE, params={"pageSize": "1"})
    assert first_page.status_code == 200, first_page.text
    assert len(first_page.json()["sessions"]) == 1
    token = first_page.json()["nextPageToken"]
    assert token
    second_page = await gateway.get("/v1/sessions", headers=ALICE, params={"pageSize": "1", "pageToken": token})
    assert second_page.status_code == 200, second_page.text
    assert second_page.json()["sessions"][0]["sessionId"] != first_page.json()["sessions"][0]["sessionId"]

    updated = await gateway.patch(
        f"/v1/sessions/{session_id}",
        headers=ALICE,
        params={"updateMask": "title,model"},
        json={"title": "after", "model": "m2", "workingDirectory": "/ignored/not/in/mask"},
    )
    assert updated.status_code == 200, updated.text
    session = updated.json()["session"]
    assert (session["title"], session["model"], session["workingDirectory"]) == ("after", "m2", "")

    deleted = await gateway.delete(f"/v1/sessions/{session_id}", headers=ALICE)
    assert deleted.status_code == 200, deleted.text
    assert set(deleted.json()["deletedSessionIds"]) == {session_id, child_id}
    assert_error(await gateway.get(f"/v1/sessions/{session_id}", headers=ALICE), 404, "NOT_FOUND", "SESSION_NOT_FOUND")
    kept = await gateway.get(f"/v1/sessions/{session_id}", headers=ALICE, params={"includeDeleted": "true"})
    assert kept.status_code == 200, kept.text
    assert kept.json()["session"]["deleteTime"]


async def test_messages_append_list_page_get_edit(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    ids = await _append(gateway, session_id, _user("one"), _assistant("two"), _user("three"), _assistant("four"))
    generation = (await gateway.get(f"/v1/sessions/{session_id}", headers=ALICE)).json()["session"]["historyGeneration"]
    assert len(ids) == 4
    assert [int(i) for i in ids] == sorted(int(i) for i in ids)

    after = await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE, params={"after": ids[0]})
    assert after.status_code == 200, after.text
    assert [m["messageId"] for m in after.json()["messages"]] == ids[1:]
    paged = await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE, params={"pageSize": "3"})
    assert [m["messageId"] for m in paged.json()["messages"]] == ids[:3]
    rest = await gateway.get(
        f"/v1/sessions/{session_id}/messages",
        headers=ALICE,
        params={"pageSize": "3", "pageToken": paged.json()["nextPageToken"]},
    )
    assert [m["messageId"] for m in rest.json()["messages"]] == ids[3:]

    latest = await gateway.get(f"/v1/sessions/{session_id}/messages:page", headers=ALICE, params={"pageSize": "2"})
    assert latest.status_code == 200, latest.text
    assert [m["messageId"] for m in latest.json()["messages"]] == ids[2:]
    assert (latest.json()["hasOlder"], latest.json()["hasNewer"]) == (True, False)
    older = await gateway.get(
        f"/v1/sessions/{session_id}/messages:page",
        headers=ALICE,
        params={"anchor": ids[2], "direction": "older", "pageSize": "2"},
    )
    assert [m["messageId"] for m in older.json()["messages"]] == ids[:2]
    newer = await gateway.get(
        f"/v1/sessions/{session_id}/messages:page", headers=ALICE, params={"anchor": ids[0], "direction": "NEWER"}
    )
    assert [m["messageId"] for m in newer.json()["messages"]] == ids[1:]

    one = await gateway.get(f"/v1/sessions/{session_id}/messages/{ids[1]}", headers=ALICE)
    assert one.status_code == 200, one.text
    assert one.json()["message"]["content"] == [{"text": "two"}]

    edited = await gateway.post(
        f"/v1/sessions/{session_id}/messages/{ids[2]}:edit",
        headers=ALICE,
        json={"content": [{"text": "three, edited"}], "expectedHistoryGeneration": generation},
    )
    assert edited.status_code == 200, edited.text
    assert edited.json()["historyGeneration"] == str(int(generation) + 1)
    assert edited.json()["deletedMessageCount"] == 1
    live = await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE)
    assert [m["content"][0]["text"] for m in live.json()["messages"]] == ["one", "two", "three, edited"]

    stale = await gateway.post(
        f"/v1/sessions/{session_id}/messages/{ids[2]}:edit",
        headers=ALICE,
        json={"content": [{"text": "again"}], "expectedHistoryGeneration": generation},
    )
    assert_error(stale, 409, "ABORTED", "HISTORY_GENERATION_MISMATCH")
    not_user = await gateway.post(
        f"/v1/sessions/{session_id}/messages/{ids[1]}:edit", headers=ALICE, json={"content": [{"text": "x"}]}
    )
    assert_error(not_user, 400, "FAILED_PRECONDITION", "MESSAGE_NOT_EDITABLE")


async def test_truncated_tool_results_carry_result_truncated(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    call = {"toolCallId": "c1", "name": "grep_search", "arguments": "{}"}
    truncated = {"role": "MESSAGE_ROLE_TOOL", "toolCallId": "c1", "content": [{"text": '{"truncated": true}'}]}
    plain = {"role": "MESSAGE_ROLE_TOOL", "toolCallId": "c1", "content": [{"text": "ok"}]}
    await _append(gateway, session_id, {**_assistant("searching"), "toolCalls": [call]}, truncated, plain)
    listed = await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE)
    assert listed.status_code == 200, listed.text
    messages = listed.json()["messages"]
    assert [m["resultTruncated"] for m in messages] == [False, True, False]
    assert messages[1]["metadata"] == {"resultTruncated": True}


async def test_another_users_session_is_403(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    message_id = (await _append(gateway, session_id, _user("private")))[0]
    attempts = [
        gateway.get(f"/v1/sessions/{session_id}", headers=BOB),
        gateway.patch(f"/v1/sessions/{session_id}", headers=BOB, params={"updateMask": "title"}, json={"title": "x"}),
        gateway.delete(f"/v1/sessions/{session_id}", headers=BOB),
        gateway.post(f"/v1/sessions/{session_id}/messages", headers=BOB, json={"messages": [_user("x")]}),
        gateway.get(f"/v1/sessions/{session_id}/messages", headers=BOB),
        gateway.get(f"/v1/sessions/{session_id}/messages:page", headers=BOB),
        gateway.get(f"/v1/sessions/{session_id}/messages/{message_id}", headers=BOB),
        gateway.post(
            f"/v1/sessions/{session_id}/messages/{message_id}:edit", headers=BOB, json={"content": [{"text": "x"}]}
        ),
    ]
    for attempt in attempts:
        response = await attempt
        error = assert_error(response, 403, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED")
        assert "private" not in response.text
        assert error["details"][0]["domain"] == "transcript.continuum"


async def test_unknown_ids_are_404(gateway: httpx.AsyncClient) -> None:
    assert_error(
        await gateway.get("/v1/sessions/no-such-session", headers=ALICE), 404, "NOT_FOUND", "SESSION_NOT_FOUND"
    )
    assert_error(
        await gateway.get("/v1/sessions/no-such-session/messages", headers=ALICE), 404, "NOT_FOUND", "SESSION_NOT_FOUND"
    )
    session_id = await _new_session(gateway)
    assert_error(
        await gateway.get(f"/v1/sessions/{session_id}/messages/999999999", headers=ALICE),
        404,
        "NOT_FOUND",
        "MESSAGE_NOT_FOUND",
    )


async def test_bad_bodies_and_parameters_are_400(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    messages = f"/v1/sessions/{session_id}/messages"
    cases: list[tuple[httpx.Response, str]] = [
        (await gateway.post(messages, headers=ALICE, content=b"{not json"), "body"),
        (
            await gateway.post(messages, headers=ALICE, json={"messages": [{"role": "MESSAGE_ROLE_NOPE"}]}),
            "messages[0].role",
        ),
        (await gateway.post(messages, headers=ALICE, json={"mesages": []}), "mesages"),
        (await gateway.get(messages, headers=ALICE, params={"after": "seven"}), "after"),
        (await gateway.get(messages, headers=ALICE, params={"after": "99999999999999999999"}), "after"),
        (await gateway.get(messages, headers=ALICE, params={"afterr": "1"}), "afterr"),
        (await gateway.get(messages, headers=ALICE, params=[("after", "1"), ("after", "2")]), "after"),
        (await gateway.get(f"{messages}:page", headers=ALICE, params={"direction": "sideways"}), "direction"),
        (await gateway.get(f"{messages}/abc", headers=ALICE), "message_id"),
        (
            await gateway.patch(
                f"/v1/sessions/{session_id}", headers=ALICE, params={"updateMask": "working directory"}, json={}
            ),
            "updateMask",
        ),
        (await gateway.get("/v1/sessions", headers=ALICE, params={"pageSize": "ten"}), "pageSize"),
        (
            await gateway.get(f"/v1/sessions/{session_id}", headers=ALICE, params={"includeDeleted": "maybe"}),
            "includeDeleted",
        ),
        (await gateway.delete(f"/v1/sessions/{session_id}", headers=ALICE, params={"force": "1"}), "force"),
    ]
    for response, field in cases:
        error = assert_error(response, 400, "INVALID_ARGUMENT")
        assert error["details"][0]["domain"] == "gateway.continuum", error
        assert [v["field"] for v in violations(error)] == [field], error


async def test_transcript_validation_is_relayed_as_400(gateway: httpx.AsyncClient) -> None:
    response = await gateway.post("/v1/sessions", headers=ALICE, json={"sessionId": "spaces are not allowed"})
    error = assert_error(response, 400, "INVALID_ARGUMENT")
    assert error["details"][0]["domain"] == "transcript.continuum", error


async def test_a_wrong_service_token_is_the_gateways_fault_not_the_browsers(
    transcript: GrpcService, tmp_path: Path
) -> None:
    settings = gateway_settings(tmp_path, f"127.0.0.1:{transcript.port}", service_token=SecretStr("not-the-token"))
    async with serving(create_app(settings)) as misconfigured:
        response = await misconfigured.get("/v1/sessions", headers=ALICE)
    error = assert_error(response, 500, "INTERNAL", "INTERNAL")
    assert error["message"] == "internal error"


async def test_logs_carry_no_tokens_or_content(gateway: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    secret_text = f"content-{uuid.uuid4().hex}"
    with caplog.at_level(logging.DEBUG):
        session_id = await _new_session(gateway, title=secret_text)
        await _append(gateway, session_id, _user(secret_text))
        await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE)
        await gateway.get(f"/v1/sessions/{session_id}", headers=BOB)
        await gateway.post(f"/v1/sessions/{session_id}/messages", headers=ALICE, content=b'{"x": "' + b"y" * 10 + b"")
        await gateway.get("/v1/sessions", headers=bearer("wrong-token"))
    # Only the gateway's records: the in-process transcript server's SQL debug lines are its own affair.
    records = [r for r in caplog.records if r.name.startswith("continuum.gateway")]
    assert records, "expected access log lines"
    logged = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in records)
    for secret in (secret_text, ALICE_TOKEN, BOB_TOKEN, SERVICE_TOKEN, "wrong-token"):
        assert secret not in logged
    access = [r for r in records if r.getMessage() == "request"]
    assert {getattr(r, "route", None) for r in access} >= {"/v1/sessions", "/v1/sessions/{session_id}/messages"}
