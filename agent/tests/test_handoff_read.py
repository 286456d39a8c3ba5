"""HandoffRead in the agent, through the real services: transcript, merge (a merge run to completion by the
offline provider), handoff-read, compaction and the agent with its offline model. The model is offered
HandoffRead only in the merged session (as BuildContext returns it) and calls it in its tool round; the
agent runs the call through handoff-read for the run that holds the RUN claim and stores the bounded
answer, or the refusal's reason, as the tool result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from agent_testing import agent_settings
from compaction_testing import RecordingProxy, compaction_settings
from handoff_testing import FAST, completed_merge, running_handoff_read
from merge_testing import OWNER, MergeStack, running_merge
from transcript_testing import SERVICE_TOKEN

from continuum.agent.v1 import agent_service_pb2 as api
from continuum.agent.v1 import agent_service_pb2_grpc as api_grpc
from continuum.handoff_read.v1 import handoff_read_service_pb2 as hapi
from continuum.merge.v1 import resources_pb2 as mpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_agent import handoff
from continuum_agent.model import message_text
from continuum_agent.server import start as start_agent
from continuum_compaction.server import start as start_compaction
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.wire_names import HANDOFF_READ_TOOL

# What handoff-read answers today once the binding verified: its package reader is not wired in yet.
RESULT_MAX_BYTES = 4096


@dataclass
class Merged:
    """Every service, with a completed merge whose target the agent's turns run in."""

    merge: MergeStack
    operation: mpb.MergeOperation
    agent: api_grpc.AgentServiceStub
    # Between the agent and handoff-read: records the agent's calls, or stages an outage.
    proxy: RecordingProxy

    @property
    def target(self) -> str:
        return self.operation.progress.target_session_id

    async def turn(self, session_id: str, text: str) -> api.StartTurnResponse:
        """Start a turn and wait until it released its claim."""
        metadata = call_metadata(SERVICE_TOKEN, OWNER)
        started: api.StartTurnResponse = await self.agent.StartTurn(
            api.StartTurnRequest(session_id=session_id, text=text), metadata=metadata
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline:
            try:
                await self.merge.transcript.stub.GetRun(tapi.GetRunRequest(run_id=started.run_id), metadata=metadata)
            except grpc.aio.AioRpcError:  # RUN_NOT_FOUND: the turn released its claim
                return started
            await asyncio.sleep(0.05)
        raise AssertionError("the turn did not end within 60 s")

    async def messages(self, session_id: str) -> list[tpb.Message]:
        response = await self.merge.transcript.stub.ListMessagesAfter(
            tapi.ListMessagesAfterRequest(session_id=session_id, page_size=1000),
            metadata=call_metadata(SERVICE_TOKEN, OWNER),
        )
        return list(response.messages)


@pytest.fixture
async def merged(tmp_path: Path, database_url: str) -> AsyncIterator[Merged]:
    async with running_merge(tmp_path, database_url, overrides=FAST) as merge:
        operation = await completed_merge(merge)
        async with running_handoff_read(tmp_path, merge) as (_, handoff_read, _):
            proxy = RecordingProxy()
            proxy.target(handoff_read.port)
            await proxy.start()
            settings = compaction_settings(
                tmp_path,
                database_url,
                merge.transcript.service.port,
                handoff_read_address=f"127.0.0.1:{handoff_read.port}",
                context_window_tokens=128_000,
                trigger_ratio=0.9,
                recent_turns=2,
                consume_session_events=False,
            )
            compaction = await start_compaction(settings, None)
            agent = await start_agent(
                agent_settings(
                    tmp_path,
                    merge.transcript.service.port,
                    compaction.port,
                    handoff_read_address=f"127.0.0.1:{proxy.port}",
                    tool_result_max_bytes=RESULT_MAX_BYTES,
                )
            )
            channel = open_channel(f"127.0.0.1:{agent.port}")
            try:
                yield Merged(merge, operation, api_grpc.AgentServiceStub(channel), proxy)
            finally:
                await channel.close()
                await agent.stop(grace=0)
                await compaction.stop(grace=0)
                await proxy.stop()


async def test_a_merged_sessions_turn_calls_handoff_read_for_its_run_and_stores_the_answer(merged: Merged) -> None:
    started = await merged.turn(merged.target, "Continue the client work")

    messages = [m for m in await merged.messages(merged.target) if m.message_id >= started.user_message_id]
    calling = next(m for m in messages if m.role == tpb.MESSAGE_ROLE_ASSISTANT and m.tool_calls)
    [call] = [c for c in calling.tool_calls if c.name == HANDOFF_READ_TOOL]
    assert json.loads(call.arguments) == {"action": "list"}
    # One call, for the run that holds the RUN claim (handoff-read resolves the session from it).
    [(name, raw)] = merged.proxy.calls
    sent = hapi.ExecuteHandoffReadRequest.FromString(raw)
    assert (name, sent.run_id, json.loads(sent.arguments_json)) == (
        "ExecuteHandoffRead",
        started.run_id,
        {"action": "list"},
    )
    [result] = [m for m in messages if m.role == tpb.MESSAGE_ROLE_TOOL and m.tool_call_id == call.tool_call_id]
    assert result.metadata["runId"] == started.run_id and result.metadata["tool"] == HANDOFF_READ_TOOL
    text = message_text(result)
    assert len(text.encode()) <= RESULT_MAX_BYTES
    answer = json.loads(text)
    # The binding of the agent's own run verified (a wrong run or session would be RUN_NOT_FOUND /
    # HANDOFF_NOT_BOUND), and the answer is the package's directory: both merged sources among it.
    assert "reason" not in answer, answer
    assert answer["complete"] is True and answer["packageVersion"]
    assert len([entry for entry in answer["entries"] if entry["kind"] == "source"]) == 2
    assert "archive answered" in message_text(messages[-1])
    # The model read the result and answered; the turn ended normally.
    assert messages[-1].role == tpb.MESSAGE_ROLE_ASSISTANT and not messages[-1].tool_calls
    assert messages[-1].status == tpb.MESSAGE_STATUS_COMPLETE

    # An ordinary session of the same user is offered no HandoffRead, so its model never calls it.
    await merged.merge.new_session("plain")
    await merged.turn("plain", "Look around")
    plain = await merged.messages("plain")
    assert [c.name for m in plain for c in m.tool_calls] == ["list_directory", "search_text"]
    assert len(merged.proxy.calls) == 1


async def test_an_unreachable_handoff_read_is_a_tool_error_and_the_turn_goes_on(merged: Merged) -> None:
    merged.proxy.unavailable.add("ExecuteHandoffRead")

    started = await merged.turn(merged.target, "Continue the client work")

    messages = [m for m in await merged.messages(merged.target) if m.message_id >= started.user_message_id]
    [result] = [m for m in messages if m.role == tpb.MESSAGE_ROLE_TOOL and m.metadata["tool"] == HANDOFF_READ_TOOL]
    assert json.loads(message_text(result))["reason"] == "HANDOFF_READ_UNAVAILABLE"
    assert messages[-1].role == tpb.MESSAGE_ROLE_ASSISTANT and not messages[-1].tool_calls
    assert messages[-1].status == tpb.MESSAGE_STATUS_COMPLETE
    assert "A tool was refused" in message_text(messages[-1])


def test_a_large_answer_is_cut_to_the_limit_and_says_what_it_left_out() -> None:
    response = hapi.ExecuteHandoffReadResponse(
        entries=[hapi.HandoffReadEntry(ref=f"r{n:04d}", kind="record", text="界" * 1000) for n in range(1000)],
        complete=True,
        package_version="v1",
    )

    for limit in (1024, 16 * 1024, 64 * 1024):
        result = handoff.tool_result(response, limit)
        parsed = json.loads(result)
        assert len(result.encode()) <= limit
        assert parsed["truncated"] is True and parsed["complete"] is False
        whole = [e for e in parsed["entries"] if "text" in e]
        by_ref = [e for e in parsed["entries"] if "text" not in e]
        # Whole entries first, then refs only; everything accounted for.
        assert parsed["entries"] == whole + by_ref
        assert len(parsed["entries"]) + parsed["omittedEntries"] == 1000
        assert [e["ref"] for e in parsed["entries"]] == [f"r{n:04d}" for n in range(len(parsed["entries"]))]

    small = hapi.ExecuteHandoffReadResponse(
        entries=[hapi.HandoffReadEntry(ref="r1", kind="source", text="a")], complete=True, package_version="v1"
    )
    assert json.loads(handoff.tool_result(small, 1024)) == {
        "entries": [{"ref": "r1", "kind": "source", "text": "a"}],
        "complete": True,
        "nextCursor": "",
        "warning": "",
        "packageVersion": "v1",
    }
