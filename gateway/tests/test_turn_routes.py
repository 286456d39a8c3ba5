"""The turn routes against a real agent runtime (offline model) in front of real transcript and compaction."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_testing import ALICE_TOKEN, BOB_TOKEN, SERVICE_TOKEN, assert_error, bearer, gateway_settings, serving
from pydantic import SecretStr

from continuum_agent.server import start as start_agent
from continuum_agent.settings import AgentSettings
from continuum_gateway.app import create_app
from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
BOB = bearer(BOB_TOKEN)


@pytest.fixture(scope="module")
async def agent(
    transcript: GrpcService, compaction: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[GrpcService]:
    """A real agent runtime writing its offline answers at a pace a stop can catch."""
    settings = AgentSettings(
        data_dir=tmp_path_factory.mktemp("agent"),
        port=0,
        service_token=SecretStr(SERVICE_TOKEN),
        transcript_address=f"127.0.0.1:{transcript.port}",
        compaction_address=f"127.0.0.1:{compaction.port}",
        offline_delta_seconds=0.02,
    )
    service = await start_agent(settings)
    try:
        yield service
    finally:
        await service.stop(grace=0)


@pytest.fixture(scope="module")
async def turns_gateway(
    transcript: GrpcService, compaction: GrpcService, agent: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway given the agent's address."""
    settings = gateway_settings(
        tmp_path_factory.mktemp("gateway"),
        f"127.0.0.1:{transcript.port}",
        compaction_address=f"127.0.0.1:{compaction.port}",
        agent_address=f"127.0.0.1:{agent.port}",
    )
    async with serving(create_app(settings)) as client:
        yield client


async def _new_session(gateway: httpx.AsyncClient, working_directory: Path) -> str:
    session_id = f"t-{uuid.uuid4().hex[:12]}"
    body = {"sessionId": session_id, "title": "t", "workingDirectory": str(working_directory)}
    response = await gateway.post("/v1/sessions", headers=ALICE, json=body)
    assert response.status_code == 201, response.text
    return session_id


async def _messages(gateway: httpx.AsyncClient, session_id: str) -> list[dict[str, Any]]:
    response = await gateway.get(f"/v1/sessions/{session_id}/messages", headers=ALICE)
    assert response.status_code == 200, response.text
    messages: list[dict[str, Any]] = response.json()["messages"]
    return messages


async def _settled(gateway: httpx.AsyncClient, session_id: str, count: int) -> list[dict[str, Any]]:
    for _ in range(1000):
        messages = await _messages(gateway, session_id)
        if len(messages) >= count:
            return messages
        await asyncio.sleep(0.02)
    raise AssertionError("the turn did not finish")


async def test_capabilities_name_agent_v1_only_with_an_agent(
    turns_gateway: httpx.AsyncClient, gateway: httpx.AsyncClient
) -> None:
    with_agent = (await turns_gateway.get("/v1/capabilities", headers=ALICE)).json()["capabilities"]
    without = (await gateway.get("/v1/capabilities", headers=ALICE)).json()["capabilities"]

    assert "agent-v1" in with_agent and "agent-v1" not in without
    assert (await gateway.post("/v1/sessions/x/turns", headers=ALICE, json={"text": "hi"})).status_code == 404
    ready = await turns_gateway.get("/readyz")
    assert ready.json()["upstreams"]["agent"] == "SERVING"


async def test_a_turn_is_accepted_and_runs_to_its_answer(turns_gateway: httpx.AsyncClient, tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("displayName lives here\n")
    session_id = await _new_session(turns_gateway, tmp_path)

    response = await turns_gateway.post(
        f"/v1/sessions/{session_id}/turns", headers=ALICE, json={"text": "find displayName", "clientRequestId": "r1"}
    )

    assert response.status_code == 202, response.text
    body = response.json()
    assert set(body) == {"runId", "userMessageId"} and body["runId"].startswith("run-")
    messages = await _settled(turns_gateway, session_id, 5)
    assert [m["role"] for m in messages] == [
        "MESSAGE_ROLE_USER",
        "MESSAGE_ROLE_ASSISTANT",
        "MESSAGE_ROLE_TOOL",
        "MESSAGE_ROLE_TOOL",
        "MESSAGE_ROLE_ASSISTANT",
    ]
    assert messages[0]["messageId"] == body["userMessageId"]
    again = await turns_gateway.post(
        f"/v1/sessions/{session_id}/turns", headers=ALICE, json={"text": "find displayName", "clientRequestId": "r1"}
    )
    assert (again.status_code, again.json()) == (202, body)


async def test_a_running_turn_conflicts_and_can_be_stopped(turns_gateway: httpx.AsyncClient, tmp_path: Path) -> None:
    session_id = await _new_session(turns_gateway, tmp_path)
    turns = f"/v1/sessions/{session_id}/turns"
    started = await turns_gateway.post(turns, headers=ALICE, json={"text": "a long answer please"})
    assert started.status_code == 202
    await _settled(turns_gateway, session_id, 4)
    await asyncio.sleep(0.2)

    conflict = await turns_gateway.post(turns, headers=ALICE, json={"text": "again"})
    stopped = await turns_gateway.post(f"{turns}:stop", headers=ALICE)
    nothing = await turns_gateway.post(f"{turns}:stop", headers=ALICE)

    assert_error(conflict, 409, "FAILED_PRECONDITION", "SESSION_ALREADY_RUNNING")
    assert (stopped.status_code, stopped.json()) == (200, {"stopped": True})
    assert (nothing.status_code, nothing.json()) == (200, {"stopped": False})
    last = (await _messages(turns_gateway, session_id))[-1]
    assert (last["role"], last["status"]) == ("MESSAGE_ROLE_ASSISTANT", "MESSAGE_STATUS_INTERRUPTED")


async def test_bad_input_on_the_turn_routes(turns_gateway: httpx.AsyncClient, tmp_path: Path) -> None:
    session_id = await _new_session(turns_gateway, tmp_path)
    turns = f"/v1/sessions/{session_id}/turns"

    empty = await turns_gateway.post(turns, headers=ALICE, json={"text": ""})
    unknown_field = await turns_gateway.post(turns, headers=ALICE, json={"text": "x", "bogus": 1})
    not_json = await turns_gateway.post(turns, headers=ALICE, content=b"{")
    bad_id = await turns_gateway.post("/v1/sessions/bad.id/turns", headers=ALICE, json={"text": "x"})
    foreign = await turns_gateway.post(turns, headers=BOB, json={"text": "x"})
    missing = await turns_gateway.post("/v1/sessions/nope/turns", headers=ALICE, json={"text": "x"})
    anonymous = await turns_gateway.post(turns, json={"text": "x"})
    wrong_method = await turns_gateway.get(turns, headers=ALICE)
    stop_bad_id = await turns_gateway.post("/v1/sessions/bad.id/turns:stop", headers=ALICE)

    assert_error(empty, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
    assert empty.json()["error"]["details"][1]["fieldViolations"][0]["field"] == "text"
    assert_error(unknown_field, 400, "INVALID_ARGUMENT")
    assert_error(not_json, 400, "INVALID_ARGUMENT", "INVALID_JSON")
    error = assert_error(bad_id, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
    # A path parameter is named as the route names it.
    assert error["details"][1]["fieldViolations"][0]["field"] == "session_id"
    assert_error(foreign, 403, "PERMISSION_DENIED")
    assert_error(missing, 404, "NOT_FOUND")
    assert anonymous.status_code == 401
    assert wrong_method.status_code == 405
    assert_error(stop_bad_id, 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT")
    assert await _messages(turns_gateway, session_id) == []
