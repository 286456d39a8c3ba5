"""Refusals name fields as the HTTP request spelled them, and say what would be valid.

Services name fields by proto name (``page_token``, ``messages[1].tool_call_id``); the gateway
relays them by JSON name, a query parameter by its own name (``after``) and a path parameter by its
route name (``session_id``). Update masks take either spelling.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
from gateway_testing import ALICE_TOKEN, assert_error, bearer, violations

ALICE = bearer(ALICE_TOKEN)


async def _new_session(gateway: httpx.AsyncClient) -> str:
    session_id = f"n-{uuid.uuid4().hex[:12]}"
    response = await gateway.post("/v1/sessions", headers=ALICE, json={"sessionId": session_id})
    assert response.status_code == 201, response.text
    return session_id


def _named(response: httpx.Response, domain: str) -> tuple[str, str]:
    """The one violated field of a 400 from `domain`, and the error message."""
    error = assert_error(response, 400, "INVALID_ARGUMENT")
    assert error["details"][0]["domain"] == domain, error
    (violation,) = violations(error)
    return violation["field"], error["message"]


async def test_service_refusals_name_fields_by_their_json_names(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    tool_without_call = {"role": "MESSAGE_ROLE_TOOL", "content": [{"text": "result"}]}
    user: dict[str, Any] = {"role": "MESSAGE_ROLE_USER", "content": [{"text": "hi"}]}
    cases = [
        (await gateway.get("/v1/sessions", headers=ALICE, params={"pageToken": "forged"}), "pageToken"),
        (
            await gateway.post(
                f"/v1/sessions/{session_id}/messages", headers=ALICE, json={"messages": [user, tool_without_call]}
            ),
            "messages[1].toolCallId",
        ),
        (
            await gateway.patch(
                f"/v1/sessions/{session_id}",
                headers=ALICE,
                params={"updateMask": "workingDirectory"},
                json={"workingDirectory": "d" * 5000},
            ),
            "session.workingDirectory",
        ),
        # Query parameters by their own names, path parameters by their route names.
        (await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE, params={"after": "-1"}), "after"),
        (
            await gateway.get(
                "/session-history/outline",
                headers=ALICE,
                params={"sessionId": session_id, "generation": "-1"},
            ),
            "generation",
        ),
        (await gateway.get("/v1/sessions/not%20an%20id", headers=ALICE), "session_id"),
        (
            await gateway.patch(
                "/v1/sessions/not%20an%20id", headers=ALICE, params={"updateMask": "title"}, json={"title": "t"}
            ),
            "session_id",
        ),
    ]
    for response, expected in cases:
        field, message = _named(response, "transcript.continuum")
        assert field == expected, response.text
        assert message.startswith(f"{expected}: "), message


async def test_gateway_refusals_name_the_field_and_list_what_is_valid(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    messages = f"/v1/sessions/{session_id}/messages"
    role = await gateway.post(messages, headers=ALICE, json={"messages": [{"role": "USER"}]})
    field, message = _named(role, "gateway.continuum")
    assert field == "messages[0].role"
    assert message == (
        "messages[0].role: 'USER' is not one of MESSAGE_ROLE_UNSPECIFIED, MESSAGE_ROLE_USER, "
        "MESSAGE_ROLE_ASSISTANT, MESSAGE_ROLE_TOOL, MESSAGE_ROLE_SYSTEM"
    )
    typo = await gateway.post(
        messages, headers=ALICE, json={"messages": [{"role": "MESSAGE_ROLE_USER", "contnet": []}]}
    )
    field, message = _named(typo, "gateway.continuum")
    assert field == "messages[0].contnet"
    assert "content" in message  # the known fields are listed
    direction = await gateway.get(f"{messages}:page", headers=ALICE, params={"direction": "sideways"})
    assert _named(direction, "gateway.continuum") == ("direction", "direction: 'sideways' is not one of older, newer")
    size = await gateway.get("/v1/sessions", headers=ALICE, params={"pageSize": "ten"})
    assert _named(size, "gateway.continuum")[1] == "pageSize: 'ten' is not an integer from -2147483648 to 2147483647"
    tokens = await gateway.post(
        f"/v1/sessions/{session_id}/compaction:compactNow", headers=ALICE, json={"contextWindowTokens": True}
    )
    assert _named(tokens, "gateway.continuum")[0] == "contextWindowTokens"
    part = await gateway.post(
        messages,
        headers=ALICE,
        json={
            "messages": [{"role": "MESSAGE_ROLE_USER", "content": [{"text": "a", "attachment": {"attachmentId": "x"}}]}]
        },
    )
    field, message = _named(part, "gateway.continuum")
    assert field == "messages[0].content[0].attachment"
    assert "only one of text and attachment" in message
    # The body of PATCH is the request's session: its fields are named under it.
    kind = await gateway.patch(
        f"/v1/sessions/{session_id}", headers=ALICE, params={"updateMask": "title"}, json={"kind": "SUBTASK"}
    )
    assert _named(kind, "gateway.continuum")[0] == "session.kind"


async def test_update_masks_take_json_and_proto_names(gateway: httpx.AsyncClient) -> None:
    session_id = await _new_session(gateway)
    for mask, directory in [("workingDirectory", "/a"), ("working_directory", "/b"), ("title,workingDirectory", "/c")]:
        response = await gateway.patch(
            f"/v1/sessions/{session_id}",
            headers=ALICE,
            params={"updateMask": mask},
            json={"workingDirectory": directory, "title": mask},
        )
        assert response.status_code == 200, response.text
        assert response.json()["session"]["workingDirectory"] == directory
    assert response.json()["session"]["title"] == "title,workingDirectory"
    unknown = await gateway.patch(
        f"/v1/sessions/{session_id}", headers=ALICE, params={"updateMask": "owner"}, json={"owner": "bob"}
    )
    field, message = _named(unknown, "transcript.continuum")
    assert field == "updateMask"
    assert "'owner' is not one of title, model, working_directory" in message
