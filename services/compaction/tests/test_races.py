"""Races between compactions, writers and editors, with real concurrent clients on PostgreSQL."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from compaction_testing import ScriptedProvider, Stack, running_stack
from deadline_testing import eventually
from race_testing import until_waiting
from sqlalchemy import text
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


@postgres_only
@pytest.mark.parametrize("existing_record", [False, True], ids=["first_insert", "update"])
async def test_the_record_compare_and_set_decides_when_a_crashed_compaction_left_the_fence_postgres(
    tmp_path: Path, database_url: str, existing_record: bool
) -> None:
    """A compaction that moved transcript's fence and crashed before storing its record leaves the fence
    at the boundary the next compactions choose: they skip the fence, so only the record's own
    compare-and-set is left to pick one winner."""
    async with running_stack(tmp_path, database_url) as stack:
        await stack.new_session("s1")
        ids = await _turns(stack, 4)
        fence_before = 0
        if existing_record:
            await stack.put_record("s1", ids[1], "first summary")
            await _set_fence(stack, ids[1], fence_before)
            fence_before = ids[1]
        # The crashed compaction: the fence sits where the next summary will end, no record says so.
        boundary = ids[-2]
        await _set_fence(stack, boundary, fence_before)

        # Hold compaction's event table: the first compaction's record write takes effect but cannot
        # commit (its event goes in the same transaction), so the second one's compare-and-set on the
        # record queues behind it and is decided by the first one's committed row.
        async with stack.database.transaction() as holder:
            await holder.execute(text("LOCK TABLE compaction_events IN EXCLUSIVE MODE"))
            first = asyncio.create_task(stack.build("s1", run_id="run-first"))
            await until_waiting(stack.database, 1, "the first compaction's event, behind the table lock")
            second = asyncio.create_task(stack.build("s1", run_id="run-second"))
            await until_waiting(stack.database, 2, "the second compaction's record write, behind the first")
            assert not first.done() and not second.done()
        won, lost = await asyncio.gather(first, second)

        assert won.compaction.outcome == events_pb2.COMPACTION_OUTCOME_COMPACTED, won.compaction
        assert lost.compaction.outcome == events_pb2.COMPACTION_OUTCOME_CONFLICT, lost.compaction
        assert won.boundary_message_id == boundary
        # The loser reloaded the winner's record and called the model no second time.
        assert len(stack.provider.calls) == 2
        assert lost.boundary_message_id == boundary
        assert lost.messages[0].content[0].text == won.messages[0].content[0].text
        assert [m.message_id for m in lost.messages if m.message_id] == [ids[-1]]
        rows = await stack.record_rows("s1")
        assert len(rows) == 1 and rows[0][0] == boundary
        # The stored record is the winner's, with the bookkeeping added once to what was there (the
        # staged record counted nothing), not the loser's as well.
        stored = (await stack.summary("s1")).summary
        assert stored.compact_count == (2 if existing_record else 1)
        assert (stored.input_tokens, stored.output_tokens, stored.model) == (10, 5, stack.provider.model)
        assert stored.update_time.ToMilliseconds() > 0
        if existing_record:
            assert stored.create_time.ToMilliseconds() == 0  # as staged: an update keeps it
        else:
            assert stored.create_time == stored.update_time
        session = await stack.transcript.stub.GetSession(tapi.GetSessionRequest(session_id="s1"), metadata=stack.user())
        assert session.session.compaction_fence_message_id == boundary
        events = await stack.stub.ListCompactionEvents(
            api.ListCompactionEventsRequest(session_id="s1"), metadata=stack.user()
        )
        assert {(e.run_id, e.outcome) for e in events.events} == {
            ("run-first", events_pb2.COMPACTION_OUTCOME_COMPACTED),
            ("run-second", events_pb2.COMPACTION_OUTCOME_CONFLICT),
        }


async def _set_fence(stack: Stack, message_id: int, expected_fence: int) -> None:
    request = tapi.SetCompactionFenceRequest(
        session_id="s1",
        message_id=message_id,
        expected_history_generation=1,
        expected_fence_message_id=expected_fence,
    )
    await stack.transcript.stub.SetCompactionFence(request, metadata=stack.user())
