"""A merged session's requests through the real services: transcript, merge (a merge run to completion by
the offline provider), handoff-read and compaction, with recording pass-through proxies in front of
handoff-read and merge. Ordinary sessions never reach either; a merged session's BuildContext carries
the reference entry (counted once, never stored) and the HandoffRead tool its allow/deny lists permit."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from compaction_testing import RecordingProxy, ScriptedProvider, compaction_settings
from handoff_testing import FAST, completed_merge, running_handoff_read
from merge_testing import OWNER, MergeStack, refused, running_merge
from transcript_testing import SERVICE_TOKEN, all_messages, append, assistant, tool, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum.merge.v1 import resources_pb2 as mpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction.server import start
from continuum_compaction.settings import CompactionSettings
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.server import GrpcService

TOOL = "HandoffRead"
ENTRY_KEY = "handoff_reference"
# A window whose entry budget (min(2048, 10% of window x 0.8)) holds the whole entry of a small merge.
WIDE = 32_768


@dataclass
class Context:
    """Every service, the completed merge, and the proxies counting what reaches handoff-read and merge."""

    merge: MergeStack
    operation: mpb.MergeOperation
    handoff_read: GrpcService
    handoff_proxy: RecordingProxy
    merge_proxy: RecordingProxy
    compaction: api_grpc.CompactionServiceStub
    compaction_service: GrpcService
    compaction_settings: CompactionSettings

    @property
    def target(self) -> str:
        return self.operation.progress.target_session_id

    async def build(self, session_id: str, run_id: str = "run-1", **fields: object) -> api.BuildContextResponse:
        values: dict[str, object] = {"trigger_point": api.TRIGGER_POINT_REQUEST_START, "context_window_tokens": WIDE}
        values.update(fields)
        request = api.BuildContextRequest(session_id=session_id, run_id=run_id, **values)  # type: ignore[arg-type]
        response: api.BuildContextResponse = await self.compaction.BuildContext(
            request, metadata=call_metadata(SERVICE_TOKEN, OWNER)
        )
        return response

    def calls(self) -> list[str]:
        return [name for name, _ in self.handoff_proxy.calls + self.merge_proxy.calls]


@asynccontextmanager
async def compaction_beside(
    tmp_path: Path, database_url: str, merge: MergeStack, handoff_port: int
) -> AsyncIterator[tuple[api_grpc.CompactionServiceStub, GrpcService, CompactionSettings]]:
    settings = compaction_settings(
        tmp_path,
        database_url,
        merge.transcript.service.port,
        handoff_read_address=f"127.0.0.1:{handoff_port}",
        trigger_ratio=0.8,
        recent_turns=1,
        consume_session_events=False,
    )
    service = await start(settings, ScriptedProvider())
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        yield api_grpc.CompactionServiceStub(channel), service, settings
    finally:
        await channel.close()
        await service.stop(grace=0)


@pytest.fixture
async def context(tmp_path: Path, database_url: str) -> AsyncIterator[Context]:
    handoff_proxy, merge_proxy = RecordingProxy(), RecordingProxy()
    async with running_merge(tmp_path, database_url, overrides=FAST) as merge:
        operation = await completed_merge(merge)
        merge_proxy.target(merge.service.port)
        await merge_proxy.start()
        async with running_handoff_read(tmp_path, merge, merge_address=f"127.0.0.1:{merge_proxy.port}") as (
            _,
            handoff_read,
            _,
        ):
            handoff_proxy.target(handoff_read.port)
            await handoff_proxy.start()
            try:
                async with compaction_beside(tmp_path, database_url, merge, handoff_proxy.port) as (
                    stub,
                    service,
                    settings,
                ):
                    yield Context(merge, operation, handoff_read, handoff_proxy, merge_proxy, stub, service, settings)
            finally:
                await handoff_proxy.stop()
                await merge_proxy.stop()


def section(response: api.BuildContextResponse, key: str) -> events_pb2.ContextSection | None:
    return next((found for found in response.manifest.sections if found.key == key), None)


def entry_index(response: api.BuildContextResponse) -> int:
    """Where the entry sits among the messages (it is the one USER message with id 0)."""
    [index] = [
        n
        for n, message in enumerate(response.messages)
        if message.message_id == 0 and message.role == tpb.MESSAGE_ROLE_USER
    ]
    return index


async def test_an_ordinary_session_is_built_as_before_without_a_call_to_handoff_read_or_merge(
    context: Context,
) -> None:
    await context.merge.new_session("plain", texts=2)
    await append(context.merge.transcript, "plain", assistant("looking", "call-1"), tool("call-1", "found it"))

    first = await context.build("plain")

    assert not first.tool_definitions
    assert section(first, ENTRY_KEY) is None
    assert all(message.message_id > 0 for message in first.messages)
    assert context.calls() == []
    # Handoff-read stopped: the same request answers byte for byte the same, still with no call.
    await context.handoff_read.stop(grace=0)
    second = await context.build("plain")
    assert second.SerializeToString(deterministic=True) == first.SerializeToString(deterministic=True)
    assert context.calls() == []


async def test_a_merged_session_carries_its_entry_once_and_the_tool_its_lists_permit(context: Context) -> None:
    stored = await all_messages(context.merge.transcript.stub, context.merge.user(), context.target)

    response = await context.build(context.target)

    entry = response.messages[entry_index(response)]
    found = section(response, ENTRY_KEY)
    assert found is not None and found.count == 1
    # Counted once: the manifest's total is its sections' sum, the entry among them once.
    assert response.manifest.estimated_total_tokens == sum(s.estimated_tokens for s in response.manifest.sections)
    assert [s.key for s in response.manifest.sections].count(ENTRY_KEY) == 1
    assert found.estimated_tokens <= min(2048, int(WIDE * 0.8 * 0.1))
    assert entry.metadata.fields["handoffReference"].bool_value
    assert "more items not expanded" in entry.content[0].text or "- [" in entry.content[0].text
    # Before the history: the merged session's own messages follow, in order.
    assert [m.message_id for m in response.messages if m.message_id] == [m.message_id for m in stored]
    assert entry_index(response) == 0
    assert [t.name for t in response.tool_definitions] == [TOOL]
    assert {"GetHandoffReference"} == {name for name, _ in context.handoff_proxy.calls}
    assert {"GetHandoffBinding"} == {name for name, _ in context.merge_proxy.calls}
    # Never stored: the transcript holds what it held.
    assert await all_messages(context.merge.transcript.stub, context.merge.user(), context.target) == stored

    denied = await context.build(context.target, run_id="run-2", denied_tools=[TOOL])
    assert not denied.tool_definitions
    assert "not available in this request" in denied.messages[entry_index(denied)].content[0].text
    others_only = await context.build(context.target, run_id="run-3", allowed_tools=["Read"])
    assert not others_only.tool_definitions
    allowed = await context.build(context.target, run_id="run-4", allowed_tools=["Read", TOOL])
    assert [t.name for t in allowed.tool_definitions] == [TOOL]


async def test_a_small_window_gets_a_smaller_entry_and_a_too_small_one_the_capacity_error(context: Context) -> None:
    wide = await context.build(context.target)
    small = await context.build(context.target, run_id="run-2", context_window_tokens=2560)
    budget = int(2560 * 0.8 * 0.1)

    found = section(small, ENTRY_KEY)
    assert found is not None and found.estimated_tokens <= budget
    assert found.estimated_tokens < (section(wide, ENTRY_KEY) or found).estimated_tokens
    assert "more items not expanded" in small.messages[entry_index(small)].content[0].text

    details, _ = await refused(
        context.build(context.target, run_id="run-3", context_window_tokens=1024),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "CONTEXT_CAPACITY_EXCEEDED",
    )
    assert details.domain == "compaction.continuum"
    # The merge stays completed.
    assert (await context.merge.get(context.operation.progress.operation_id)).progress.status == (
        mpb.MERGE_STATUS_COMPLETED
    )


async def test_the_entry_counts_once_toward_the_trigger_and_survives_compactions_and_a_restart(
    context: Context, tmp_path: Path, database_url: str
) -> None:
    for turn in range(3):
        await append(
            context.merge.transcript,
            context.target,
            user(f"turn {turn}: " + "continue the client work " * 200),
            assistant(f"turn {turn} done", f"call-{turn}"),
            tool(f"call-{turn}", "ok " * 300),
        )
    measured = await context.build(context.target, skip_auto_compaction=True)
    entry_tokens = (section(measured, ENTRY_KEY) or events_pb2.ContextSection()).estimated_tokens
    history = sum(s.estimated_tokens for s in measured.manifest.sections if s.key in ("summary", "messages"))
    assert entry_tokens > 0

    # A window whose trigger falls between the history alone and history + entry: the entry is counted.
    counted = math.ceil((history + entry_tokens / 2) / 0.8)
    assert int(counted * 0.8 * 0.1) >= entry_tokens  # the whole entry still fits its budget there
    quiet = math.ceil((history + entry_tokens + 1) / 0.8)
    # Not counted twice: with the trigger just above history + entry (but below history + entry + its
    # budget), nothing compacts.
    assert history + entry_tokens + int(quiet * 0.8 * 0.1) > quiet * 0.8
    untouched = await context.build(context.target, run_id="run-q", context_window_tokens=quiet)
    assert untouched.compaction.outcome == events_pb2.COMPACTION_OUTCOME_NOT_TRIGGERED
    first = await context.build(context.target, run_id="run-c1", context_window_tokens=counted)
    assert first.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED

    # A second compaction after more turns; the entry is rebuilt each time, after the summary.
    for turn in range(3, 6):
        await append(
            context.merge.transcript,
            context.target,
            user(f"turn {turn}: " + "continue the client work " * 200),
            assistant(f"turn {turn} done", f"call-{turn}"),
            tool(f"call-{turn}", "ok " * 300),
        )
    second = await context.build(context.target, run_id="run-c2", context_window_tokens=counted)
    assert second.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
    assert second.compaction.boundary_after > first.compaction.boundary_after
    for response in (first, second):
        assert response.messages[0].role == tpb.MESSAGE_ROLE_SYSTEM  # the summary
        assert entry_index(response) == 1
        assert response.messages[2].role == tpb.MESSAGE_ROLE_USER  # the history starts at a whole turn
        assert [s.key for s in response.manifest.sections].count(ENTRY_KEY) == 1

    # After a restart of compaction, the entry comes back from the binding.
    await context.compaction_service.stop(grace=0)
    async with compaction_beside(tmp_path, database_url, context.merge, context.handoff_proxy.port) as (stub, _, _):
        context.compaction = stub
        restarted = await context.build(context.target, run_id="run-r", context_window_tokens=counted)
    assert restarted.messages[entry_index(restarted)].content[0].text == (
        second.messages[entry_index(second)].content[0].text
    )


async def test_a_merged_session_whose_binding_cannot_be_checked_is_built_without_entry_or_tool(
    context: Context, caplog: pytest.LogCaptureFixture
) -> None:
    await context.handoff_read.stop(grace=0)

    response = await context.build(context.target)

    assert not response.tool_definitions
    assert section(response, ENTRY_KEY) is None
    assert all(message.message_id > 0 for message in response.messages)
    [record] = [r for r in caplog.records if r.getMessage() == "merged session built without its reference entry"]
    assert record.__dict__["reason"] == "UNAVAILABLE"
