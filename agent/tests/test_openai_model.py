"""The OpenAI-compatible path: the real HTTP client against a scripted chat-completions server on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agent_testing import running_agent
from model_server_testing import MODEL, FakeModelServer, Reply, json_reply

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_agent.model import OpenAIChatModel, message_text
from continuum_agent.tools import DEFINITIONS
from continuum_runtime.provider import ProviderBadResponse, ProviderInputTooLarge, ProviderSettings

API_KEY = "sk-PRIVATE-test-key"


def tool_call_reply(*calls: tuple[str, str, dict[str, Any]]) -> Reply:
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for call_id, name, arguments in calls
        ],
    }
    return json_reply({"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]})


def answer_reply(text: str) -> Reply:
    message = {"role": "assistant", "content": text}
    return json_reply({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})


@pytest.fixture
async def server() -> AsyncIterator[FakeModelServer]:
    started = FakeModelServer()
    await started.start()
    yield started
    await started.stop()


def model_for(server: FakeModelServer) -> OpenAIChatModel:
    settings = ProviderSettings(kind="openai", base_url=server.url, model=MODEL, api_key=API_KEY, max_retries=2)
    return OpenAIChatModel(settings)


async def test_tool_rounds_go_through_the_http_client(
    server: FakeModelServer, tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    server.script(
        Reply(status=429, headers=(("Retry-After", "0"),)),
        tool_call_reply(("c1", "read_file", {"path": "notes.txt"})),
        answer_reply("The notes say hello."),
    )
    async with running_agent(tmp_path, database_url, model=model_for(server), tool_result_max_bytes=1024) as agent:
        (agent.workdir / "notes.txt").write_text("hello from the notes" + " and more" * 200)
        await agent.new_session("s1")
        await agent.start_turn("s1", "What do the notes say?")
        await agent.wait_idle("s1")
        messages = await agent.messages("s1")

    assert [m.role for m in messages] == [
        tpb.MESSAGE_ROLE_USER,
        tpb.MESSAGE_ROLE_ASSISTANT,
        tpb.MESSAGE_ROLE_TOOL,
        tpb.MESSAGE_ROLE_ASSISTANT,
    ]
    assert [(c.tool_call_id, c.name) for c in messages[1].tool_calls] == [("c1", "read_file")]
    read = json.loads(message_text(messages[2]))
    assert read["text"].startswith("hello from the notes") and read["truncated"] is True
    # Transcript flags a TOOL result that says it was truncated.
    assert messages[2].result_truncated
    assert message_text(messages[3]) == "The notes say hello."
    first, retried, second = (request.json() for request in server.requests)
    assert first == retried
    assert server.requests[0].headers["authorization"] == f"Bearer {API_KEY}"
    assert first["model"] == MODEL
    assert [t["function"]["name"] for t in first["tools"]] == ["list_directory", "read_file", "search_text"]
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "tool"]
    assert second["messages"][2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert second["messages"][3]["tool_call_id"] == "c1"
    logged = "\n".join(record.getMessage() + str(record.__dict__) for record in caplog.records)
    assert API_KEY not in logged and "hello from the notes" not in logged and "notes say" not in logged


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (Reply(status=401, body=b'{"error": {"code": "invalid_api_key"}}'), "AUTH_FAILED"),
        (Reply(status=200, body=b"not json"), "BAD_RESPONSE"),
        (json_reply({"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}), "OUTPUT_TRUNCATED"),
    ],
)
async def test_a_failing_provider_ends_the_turn_with_a_note_and_frees_the_session(
    server: FakeModelServer, tmp_path: Path, database_url: str, reply: Reply, reason: str
) -> None:
    server.script(reply)
    async with running_agent(tmp_path, database_url, model=model_for(server)) as agent:
        await agent.new_session("s1")
        await agent.start_turn("s1", "hello")
        await agent.wait_idle("s1")
        messages = await agent.messages("s1")

    assert [m.role for m in messages] == [tpb.MESSAGE_ROLE_USER, tpb.MESSAGE_ROLE_ASSISTANT]
    assert message_text(messages[1]).startswith(f"The model provider failed ({reason})")


async def test_an_oversized_answer_is_refused_unread_and_a_refusal_is_classified(server: FakeModelServer) -> None:
    """The agent's model shares the runtime's exchange: its byte limit and its refusal classes."""
    settings = ProviderSettings(
        kind="openai", base_url=server.url, model=MODEL, api_key=API_KEY, max_retries=0, max_response_bytes=64 * 1024
    )
    model = OpenAIChatModel(settings)
    history = [tpb.Message(role=tpb.MESSAGE_ROLE_USER, content=[tpb.ContentPart(text="hello")])]
    try:
        server.script(answer_reply("x" * (4 * 1024 * 1024)))
        with pytest.raises(ProviderBadResponse, match="over 65536 bytes"):
            await model.reply("", history, DEFINITIONS)
        server.script(json_reply({"error": {"code": "context_length_exceeded", "message": "too long"}}, status=400))
        with pytest.raises(ProviderInputTooLarge):
            await model.reply("", history, DEFINITIONS)
    finally:
        await model.aclose()
    assert len(server.requests) == 2
