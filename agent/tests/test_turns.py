"""Turns end to end: a real transcript, compaction and agent, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from agent_testing import AgentStack, running_agent
from compaction_testing import OWNER

from continuum.agent.v1 import agent_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_agent.model import OfflineModel, Reply, message_text
from continuum_runtime.errors import error_details

QUESTION = "Please rename name to displayName everywhere"


def _workspace(root: Path) -> None:
    (root / "src").mkdir()
    (root / "src" / "user.py").write_text("class User:\n    displayName: str\n    name: str\n")
    (root / "README.md").write_text("The user has a displayName.\n")


def _roles(messages: Sequence[tpb.Message]) -> list[str]:
    return [tpb.MessageRole.Name(m.role).removeprefix("MESSAGE_ROLE_") for m in messages]


async def _tool_results_stored(agent: AgentStack, session_id: str) -> None:
    """Wait until the turn's tool round is stored (its answer is written next); fail after 30 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        if sum(m.role == tpb.MESSAGE_ROLE_TOOL for m in await agent.messages(session_id)) == 2:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the tool round was not stored within 30 s")


async def _refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_a_turn_takes_one_tool_round_and_streams_its_answer(
    agent: AgentStack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    _workspace(agent.workdir)
    await agent.new_session("s1")

    started = await agent.start_turn("s1", QUESTION)
    await agent.wait_idle("s1")

    messages = await agent.messages("s1")
    assert _roles(messages) == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
    user, calling, listed, searched, answer = messages
    assert user.message_id == started.user_message_id and message_text(user) == QUESTION
    assert started.run_id.startswith("run-") and user.metadata["runId"] == started.run_id
    assert [(c.name, json.loads(c.arguments)) for c in calling.tool_calls] == [
        ("list_directory", {"path": "."}),
        ("search_text", {"query": "displayName"}),
    ]
    assert [listed.tool_call_id, searched.tool_call_id] == [c.tool_call_id for c in calling.tool_calls]
    assert [e["name"] for e in json.loads(message_text(listed))["entries"]] == ["README.md", "src"]
    found = json.loads(message_text(searched))["matches"]
    assert [(m["path"], m["line"]) for m in found] == [("README.md", 1), ("src/user.py", 2)]
    assert '2 line(s) contain "displayName"' in message_text(answer)
    assert all(m.status == tpb.MESSAGE_STATUS_COMPLETE for m in messages)
    assert answer.metadata["runId"] == started.run_id
    # Logs carry ids and counts, never what the user, the model or a tool wrote.
    logged = "\n".join(f"{record.getMessage()} {record.__dict__}" for record in caplog.records)
    assert "turn started" in logged and "tool round done" in logged
    assert "displayName" not in logged and "Here is what I found" not in logged


async def test_a_second_turn_while_one_runs_is_refused_and_stores_nothing(tmp_path: Path, database_url: str) -> None:
    async with running_agent(tmp_path, database_url, offline_delta_seconds=0.05) as agent:
        await agent.new_session("s1")
        await agent.start_turn("s1", "first")

        refused = await _refused(agent.start_turn("s1", "second"))

        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_details(refused).reason == "SESSION_ALREADY_RUNNING"
        assert await agent.stop_turn("s1")
        await agent.wait_idle("s1")
        assert [message_text(m) for m in await agent.messages("s1") if m.role == tpb.MESSAGE_ROLE_USER] == ["first"]


async def test_a_session_claimed_by_someone_else_is_refused_with_transcripts_reason(agent: AgentStack) -> None:
    await agent.new_session("s1")
    claim_id = await agent.try_claim("s1", holder="another-runtime")
    assert claim_id is not None

    refused = await _refused(agent.start_turn("s1", "hello"))

    details = error_details(refused)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (details.reason, details.domain) == ("SESSION_ALREADY_RUNNING", "transcript.continuum")
    assert details.metadata["holder"] == "another-runtime"
    assert await agent.messages("s1") == []
    await agent.release(claim_id)
    await agent.start_turn("s1", "hello")
    await agent.wait_idle("s1")


async def test_a_retried_client_request_id_gets_the_first_answer(agent: AgentStack) -> None:
    await agent.new_session("s1")
    first = await agent.start_turn("s1", "hello", client_request_id="req-1")
    await agent.wait_idle("s1")

    again = await agent.start_turn("s1", "hello", client_request_id="req-1")
    reused = await _refused(agent.start_turn("s1", "other text", client_request_id="req-1"))

    assert again == first
    assert reused.code() == grpc.StatusCode.ABORTED
    assert error_details(reused).reason == "CLIENT_REQUEST_ID_REUSED"
    users = [m for m in await agent.messages("s1") if m.role == tpb.MESSAGE_ROLE_USER]
    assert [(m.message_id, m.metadata["clientRequestId"]) for m in users] == [(first.user_message_id, "req-1")]


async def test_concurrent_retries_of_one_request_start_one_turn(agent: AgentStack) -> None:
    await agent.new_session("s1")

    answers = await asyncio.gather(*(agent.start_turn("s1", "hello", client_request_id="req-2") for _ in range(4)))
    await agent.wait_idle("s1")

    assert len({(a.run_id, a.user_message_id) for a in answers}) == 1
    assert sum(m.role == tpb.MESSAGE_ROLE_USER for m in await agent.messages("s1")) == 1


async def test_a_turn_stopped_mid_answer_keeps_what_was_shown_as_interrupted(tmp_path: Path, database_url: str) -> None:
    # The answer takes seconds to write (about 35 words), so the stop lands inside it even on a busy machine.
    async with running_agent(tmp_path, database_url, offline_delta_seconds=0.1) as agent:
        await agent.new_session("s1")
        await agent.start_turn("s1", QUESTION)
        # The answer streams once the tool results are stored; let a few words of it be shown.
        await _tool_results_stored(agent, "s1")
        await asyncio.sleep(0.3)

        assert await agent.stop_turn("s1")

        messages = await agent.messages("s1")
        assert _roles(messages) == ["USER", "ASSISTANT", "TOOL", "TOOL", "ASSISTANT"]
        shown = messages[-1]
        assert shown.status == tpb.MESSAGE_STATUS_INTERRUPTED
        assert message_text(shown).startswith("Here is")
        assert not message_text(shown).endswith("real answers.")
        # The claim is free at once, and a second stop finds nothing to stop.
        assert await agent.try_claim("s1") is not None
        assert not await agent.stop_turn("s1")


async def test_bad_input_is_refused_on_every_rpc(agent: AgentStack) -> None:
    await agent.new_session("s1")
    await agent.new_session("theirs", owner="bob")
    cases: list[tuple[api.StartTurnRequest, str]] = [
        (api.StartTurnRequest(session_id="", text="x"), "session_id"),
        (api.StartTurnRequest(session_id="bad/id", text="x"), "session_id"),
        (api.StartTurnRequest(session_id="s1", text="  "), "text"),
        (api.StartTurnRequest(session_id="s1", text="x" * 1_000_001), "text"),
        (api.StartTurnRequest(session_id="s1", text="x", client_request_id="no spaces"), "client_request_id"),
    ]
    for request, field in cases:
        refused = await _refused(agent.stub.StartTurn(request, metadata=agent.user()))
        details = error_details(refused)
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert [v.field for v in details.violations] == [field]
    stop = await _refused(agent.stub.StopTurn(api.StopTurnRequest(session_id="../x"), metadata=agent.user()))
    assert stop.code() == grpc.StatusCode.INVALID_ARGUMENT

    missing = await _refused(
        agent.stub.StartTurn(api.StartTurnRequest(session_id="nope", text="x"), metadata=agent.user())
    )
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    foreign = await _refused(
        agent.stub.StartTurn(api.StartTurnRequest(session_id="theirs", text="x"), metadata=agent.user())
    )
    assert foreign.code() == grpc.StatusCode.PERMISSION_DENIED
    anonymous = await _refused(agent.stub.StartTurn(api.StartTurnRequest(session_id="s1", text="x")))
    assert anonymous.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await agent.messages("s1") == []
    assert not await agent.stop_turn("s1")


class GatedModel:
    """The offline script, holding its first reply until the test opens the gate."""

    name = "gated"

    def __init__(self) -> None:
        self.inner = OfflineModel(0.0)
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()
        self.calls = 0

    async def reply(
        self, system_prompt: str, history: Sequence[tpb.Message], definitions: Sequence[dict[str, Any]]
    ) -> Reply:
        self.calls += 1
        if self.calls == 3:
            self.waiting.set()
            await self.gate.wait()
        return await self.inner.reply(system_prompt, history, definitions)

    async def aclose(self) -> None:
        return None


async def test_compact_now_while_running_fires_at_the_next_tool_round_boundary(
    tmp_path: Path, database_url: str
) -> None:
    model = GatedModel()
    overrides: dict[str, object] = {"recent_turns": 0, "min_compact_message_count": 1, "min_new_message_count": 1}
    async with running_agent(tmp_path, database_url, model=model, compaction_overrides=overrides) as agent:
        await agent.new_session("s1")
        await agent.start_turn("s1", "first question")
        await agent.wait_idle("s1")
        second = await agent.start_turn("s1", "second question")
        await model.waiting.wait()

        queued: capi.CompactNowResponse = await agent.services.stub.CompactNow(
            capi.CompactNowRequest(session_id="s1"), metadata=agent.user()
        )
        assert queued.state == capi.COMPACT_NOW_STATE_QUEUED and queued.run_id == second.run_id
        model.gate.set()
        await agent.wait_idle("s1")

        summary: capi.GetCompactionSummaryResponse = await agent.services.stub.GetCompactionSummary(
            capi.GetCompactionSummaryRequest(session_id="s1"), metadata=agent.user()
        )
        first_turn = [m.message_id for m in await agent.messages("s1")][:5]
        assert summary.HasField("summary")
        assert summary.summary.last_compacted_message_id == first_turn[-1]


async def test_a_session_without_working_directory_gets_refusals_as_tool_results(agent: AgentStack) -> None:
    await agent.services.transcript.stub.CreateSession(
        tapi.CreateSessionRequest(session_id="bare", kind=tpb.SESSION_KIND_CHAT),
        metadata=agent.user(OWNER),
    )
    await agent.start_turn("bare", "look around")
    await agent.wait_idle("bare")

    tool_results = [
        json.loads(message_text(m)) for m in await agent.messages("bare") if m.role == tpb.MESSAGE_ROLE_TOOL
    ]
    assert tool_results == [{"error": "the session has no working directory"}] * 2


async def test_a_turn_whose_claim_is_taken_away_stops_and_stores_what_was_shown(
    tmp_path: Path, database_url: str
) -> None:
    async with running_agent(
        tmp_path, database_url, offline_delta_seconds=0.1, claim_renew_seconds=0.2, claim_ttl_seconds=3
    ) as agent:
        await agent.new_session("s1")
        started = await agent.start_turn("s1", QUESTION)
        await _tool_results_stored(agent, "s1")

        # An operator frees the session (as for a stuck runtime): the agent's next renewal fails.
        released = await agent.services.transcript.stub.ReleaseHolderClaims(
            tapi.ReleaseHolderClaimsRequest(holder=started.run_id, kind=tpb.CLAIM_KIND_RUN),
            metadata=agent.services.transcript.system,
        )
        assert len(released.claim_ids) == 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline:
            last = (await agent.messages("s1"))[-1]
            if last.role == tpb.MESSAGE_ROLE_ASSISTANT and not last.tool_calls:
                break
            await asyncio.sleep(0.01)

        assert last.status == tpb.MESSAGE_STATUS_INTERRUPTED
        # Stop (answered once the turn settled, if it is still releasing) frees the session for a new turn.
        await agent.stop_turn("s1")
        await agent.start_turn("s1", "again")
        await agent.wait_idle("s1")


async def test_a_turn_that_cannot_reach_compaction_says_so_and_frees_the_session(
    tmp_path: Path, database_url: str
) -> None:
    async with running_agent(tmp_path, database_url, compaction_address="127.0.0.1:1") as agent:
        await agent.new_session("s1")
        await agent.start_turn("s1", "hello")
        await agent.wait_idle("s1")
        messages = await agent.messages("s1")

    assert _roles(messages) == ["USER", "ASSISTANT"]
    assert (
        message_text(messages[1]) == "The turn failed (COMPACTION_UNAVAILABLE); nothing more was done. Try again later."
    )
