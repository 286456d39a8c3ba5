"""Races between compactions, writers and editors, with real concurrent clients on PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from compaction_testing import ScriptedProvider, Stack, eventually, running_stack
from transcript_testing import assistant, refused, user

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi

postgres_only = pytest.mark.parametrize("database_url", ["postgres"], indirect=True)


async def _turns(stack: Stack, count: int) -> list[int]:
    ids: list[int] = []
    for index in range(count):
        ids += await stack.append("s1", user(f"request {index}"), assistant(f"answer {index}"))
    ids += await stack.append("s1", user("current"))
    return ids


async def _race_two_builds(stack: Stack, gate: asyncio.Event) -> list[api.BuildContextResponse]:
    builds = [asyncio.create_task(stack.build("s1", run_id=f"run-{n}")) for n in range(2)]
    await eventually(lambda: stack.provider.waiting == 2)
    gate.set()
    return list(await asyncio.gather(*builds))


@postgres_only
@pytest.mark.parametrize("existing_record", [False, True], ids=["first_insert", "update"])
async def test_two_compactions_on_the_same_boundary_postgres(
    tmp_path: Path, database_url: str, existing_record: bool
) -> None:
    gate = asyncio.Event()
    async with running_stack(tmp_path, database_url, ScriptedProvider(gate=gate)) as stack:
        await stack.new_session("s1")
        ids = await _turns(stack, 4)
        if existing_record:
            await stack.put_record("s1", ids[1], "first summary")

        results = await _race_two_builds(stack, gate)

        outcomes = sorted(r.compaction.outcome for r in results)
        assert outcomes == [events_pb2.COMPACTION_OUTCOME_COMPACTED, events_pb2.COMPACTION_OUTCOME_CONFLICT]
        # The loser discarded its result, reloaded once and did not call the model again.
        assert len(stack.provider.calls) == 2
        winner = next(r for r in results if r.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED)
        loser = next(r for r in results if r.compaction.outcome == events_pb2.COMPACTION_OUTCOME_CONFLICT)
        rows = await stack.record_rows("s1")
        assert len(rows) == 1 and rows[0][0] == winner.boundary_message_id
        # Only the winner moved transcript's fence: it sits exactly at the stored boundary, so every
        # message after it stays editable.
        session = await stack.transcript.stub.GetSession(tapi.GetSessionRequest(session_id="s1"), metadata=stack.user())
        assert session.session.compaction_fence_message_id == winner.boundary_message_id
        # The loser reloaded whatever was persisted when it lost: the summary it started from, or the
        # winner's when that had committed; either way its context is whole.
        assert loser.boundary_message_id in (ids[1] if existing_record else 0, winner.boundary_message_id)
        assert [m.message_id for m in loser.messages if m.message_id] == [
            i for i in ids if i > loser.boundary_message_id
        ]
        events = await stack.stub.ListCompactionEvents(
            api.ListCompactionEventsRequest(session_id="s1"), metadata=stack.user()
        )
        assert sorted(e.outcome for e in events.events) == outcomes


@postgres_only
async def test_messages_written_during_compaction_appear_after_reload_postgres(
    tmp_path: Path, database_url: str
) -> None:
    gate = asyncio.Event()
    async with running_stack(tmp_path, database_url, ScriptedProvider(gate=gate)) as stack:
        await stack.new_session("s1")
        await _turns(stack, 3)
        build = asyncio.create_task(stack.build("s1"))
        await eventually(lambda: stack.provider.waiting == 1)
        written = await stack.append("s1", assistant("streamed meanwhile"))
        gate.set()

        response = await build

        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED
        assert response.messages[-1].message_id == written[0]


@postgres_only
async def test_an_edit_while_the_model_works_discards_the_summary_postgres(tmp_path: Path, database_url: str) -> None:
    gate = asyncio.Event()
    async with running_stack(tmp_path, database_url, ScriptedProvider(gate=gate)) as stack:
        await stack.new_session("s1")
        ids = await _turns(stack, 3)
        build = asyncio.create_task(stack.build("s1"))
        await eventually(lambda: stack.provider.waiting == 1)
        edit = tapi.EditUserMessageRequest(session_id="s1", message_id=ids[2], content=[tpb.ContentPart(text="new")])
        edited = await stack.transcript.stub.EditUserMessage(edit, metadata=stack.user())
        gate.set()

        response = await build

        assert edited.deleted_message_count > 0
        assert response.compaction.outcome == events_pb2.COMPACTION_OUTCOME_HISTORY_REWRITTEN
        assert await stack.record_rows("s1") == []
        assert [m.message_id for m in response.messages] == ids[:3]


@postgres_only
async def test_an_edit_after_the_summary_is_refused_and_changes_nothing_postgres(
    tmp_path: Path, database_url: str
) -> None:
    async with running_stack(tmp_path, database_url) as stack:
        await stack.new_session("s1")
        ids = await _turns(stack, 3)
        compacted = await stack.build("s1")
        assert compacted.boundary_message_id == ids[-2]
        before = await stack.transcript.stub.ListMessagesAfter(
            tapi.ListMessagesAfterRequest(session_id="s1"), metadata=stack.user()
        )
        edit = tapi.EditUserMessageRequest(session_id="s1", message_id=ids[2], content=[tpb.ContentPart(text="new")])

        error = await refused(
            stack.transcript.stub.EditUserMessage(edit, metadata=stack.user()),
            grpc.StatusCode.FAILED_PRECONDITION,
            "MESSAGE_ALREADY_COMPACTED",
        )

        assert "summary" in error.message
        after = await stack.transcript.stub.ListMessagesAfter(
            tapi.ListMessagesAfterRequest(session_id="s1"), metadata=stack.user()
        )
        assert after == before
        # After the boundary, editing works as before.
        later = tapi.EditUserMessageRequest(session_id="s1", message_id=ids[-1], content=[tpb.ContentPart(text="x")])
        assert (await stack.transcript.stub.EditUserMessage(later, metadata=stack.user())).message.message_id == ids[-1]
