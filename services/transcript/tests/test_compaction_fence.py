"""The compaction fence: edits at or below it are refused, setting it needs the loaded generation,
and the two are race-safe against each other (ARCHITECTURE.md, "Edit versus compaction")."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import grpc
import pytest
from race_testing import until_waiting
from sqlalchemy import text
from transcript_testing import Follower, TranscriptClient, append, assistant, create_session, refused, user

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.channels import open_channel
from continuum_runtime.database import Database
from continuum_runtime.errors import error_details

ALICE = "alice"


async def _live(client: TranscriptClient, session_id: str) -> list[tuple[int, str]]:
    page = await client.stub.ListMessagesAfter(
        api.ListMessagesAfterRequest(session_id=session_id), metadata=client.as_user(ALICE)
    )
    return [(m.message_id, m.content[0].text) for m in page.messages]


async def _session_state(client: TranscriptClient, session_id: str) -> tuple[int, int]:
    """(history_generation, compaction_fence_message_id) as GetSession shows them."""
    got = await client.stub.GetSession(api.GetSessionRequest(session_id=session_id), metadata=client.as_user(ALICE))
    return got.session.history_generation, got.session.compaction_fence_message_id


async def _event_count(client: TranscriptClient) -> int:
    events = await client.stub.ListSessionEvents(api.ListSessionEventsRequest(), metadata=client.system)
    return len(events.events)


def _fence(
    stub: api_grpc.TranscriptServiceStub,
    client: TranscriptClient,
    session_id: str,
    message_id: int,
    generation: int,
    who: str = ALICE,
    expected_fence: int = 0,
) -> Awaitable[api.SetCompactionFenceResponse]:
    request = api.SetCompactionFenceRequest(
        session_id=session_id,
        message_id=message_id,
        expected_history_generation=generation,
        expected_fence_message_id=expected_fence,
    )
    return stub.SetCompactionFence(request, metadata=client.as_user(who))  # type: ignore[no-any-return]


def _edit(
    stub: api_grpc.TranscriptServiceStub, client: TranscriptClient, session_id: str, message_id: int, text: str
) -> Awaitable[api.EditUserMessageResponse]:
    request = api.EditUserMessageRequest(
        session_id=session_id, message_id=message_id, content=[pb.ContentPart(text=text)]
    )
    return stub.EditUserMessage(request, metadata=client.as_user(ALICE))  # type: ignore[no-any-return]


async def test_edits_at_or_below_the_fence_are_refused_and_change_nothing(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, user("u1"), assistant("a1"), user("u2"), assistant("a2"), user("u3"))
    fenced = await _fence(transcript.stub, transcript, sid, ids[2], 1)
    assert (fenced.session_id, fenced.message_id, fenced.history_generation) == (sid, ids[2], 1)
    assert await _session_state(transcript, sid) == (1, ids[2])
    follower = Follower(transcript, sid)
    await follower.until("snapshot_end")
    before = await _live(transcript, sid)

    for message_id in (ids[2], ids[0]):
        details = await refused(
            _edit(transcript.stub, transcript, sid, message_id, "rewritten"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "MESSAGE_ALREADY_COMPACTED",
        )
        assert details.message == (
            f"message {message_id} is already covered by the session summary and can no longer be edited"
        )
        assert details.metadata["compaction_fence_message_id"] == str(ids[2])
    # A stale expected generation does not hide the permanent refusal.
    stale = api.EditUserMessageRequest(
        session_id=sid, message_id=ids[0], content=[pb.ContentPart(text="x")], expected_history_generation=9
    )
    await refused(
        transcript.stub.EditUserMessage(stale, metadata=transcript.as_user(ALICE)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "MESSAGE_ALREADY_COMPACTED",
    )
    # Only USER messages are editable at all, fenced or not.
    await refused(
        _edit(transcript.stub, transcript, sid, ids[1], "x"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "MESSAGE_NOT_EDITABLE",
    )

    assert await _live(transcript, sid) == before
    assert await _session_state(transcript, sid) == (1, ids[2])
    assert await _event_count(transcript) == 0
    # The refused edits did not rewrite the live transcript: the follower is still attached.
    (extra,) = await append(transcript, sid, assistant("a3"))
    frames = await follower.until("batch")
    assert [m.message_id for m in frames[-1].batch.messages] == [extra]

    edited = await _edit(transcript.stub, transcript, sid, ids[4], "u3, reworded")
    assert (edited.history_generation, edited.deleted_message_count) == (2, 1)
    assert await _live(transcript, sid) == [*before[:4], (ids[4], "u3, reworded")]
    assert await _session_state(transcript, sid) == (2, ids[2])
    assert (await follower.until("resync"))[-1].resync.reason == fpb.RESYNC_REASON_REWRITE
    follower.close()


async def test_a_fence_at_a_stale_generation_is_history_rewritten(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, user("u1"), assistant("a1"), user("u2"), assistant("a2"))
    await _edit(transcript.stub, transcript, sid, ids[2], "u2, reworded")
    details = await refused(
        _fence(transcript.stub, transcript, sid, ids[0], 1), grpc.StatusCode.ABORTED, "HISTORY_REWRITTEN"
    )
    assert (details.metadata["expected_history_generation"], details.metadata["history_generation"]) == ("1", "2")
    assert await _session_state(transcript, sid) == (2, 0)

    assert (await _fence(transcript.stub, transcript, sid, ids[1], 2)).message_id == ids[1]
    assert await _session_state(transcript, sid) == (2, ids[1])
    # A compare-and-set: a second compaction that read the old fence cannot move it.
    moved = await refused(
        _fence(transcript.stub, transcript, sid, ids[3], 2), grpc.StatusCode.ABORTED, "COMPACTION_FENCE_MOVED"
    )
    assert (moved.metadata["expected_fence_message_id"], moved.metadata["fence_message_id"]) == ("0", str(ids[1]))
    # And it never moves down.
    await refused(
        _fence(transcript.stub, transcript, sid, ids[0], 2, expected_fence=ids[1]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    await refused(
        _edit(transcript.stub, transcript, sid, ids[0], "u1, reworded"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "MESSAGE_ALREADY_COMPACTED",
    )
    assert await _session_state(transcript, sid) == (2, ids[1])


async def test_the_fence_must_be_a_live_message_of_the_session(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    other = await create_session(transcript, "other")
    ids = await append(transcript, sid, user("u1"), assistant("a1"), user("u2"), assistant("a2"))
    (foreign,) = await append(transcript, other, user("elsewhere"))
    await _fence(transcript.stub, transcript, sid, ids[0], 1)
    await _edit(transcript.stub, transcript, sid, ids[2], "u2, reworded")  # deletes ids[3]
    for message_id in (foreign, ids[3], 999_999_999):
        await refused(
            _fence(transcript.stub, transcript, sid, message_id, 2, expected_fence=ids[0]),
            grpc.StatusCode.NOT_FOUND,
            "MESSAGE_NOT_FOUND",
        )
    assert await _session_state(transcript, sid) == (2, ids[0])


async def test_only_the_owner_may_set_the_fence_of_a_live_session(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    (message_id,) = await append(transcript, sid, user("private"))
    await refused(
        _fence(transcript.stub, transcript, sid, message_id, 1, who="bob"),
        grpc.StatusCode.PERMISSION_DENIED,
        "SESSION_PERMISSION_DENIED",
    )
    await refused(_fence(transcript.stub, transcript, "missing", 1, 1), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
    assert await _session_state(transcript, sid) == (1, 0)
    await transcript.stub.DeleteSession(api.DeleteSessionRequest(session_id=sid), metadata=transcript.as_user(ALICE))
    await refused(
        _fence(transcript.stub, transcript, sid, message_id, 1), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"
    )


async def test_bad_fence_requests_are_invalid_arguments_and_change_nothing(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    (message_id,) = await append(transcript, sid, user("u1"))
    cases = {
        "session_id": ("", message_id, 1),
        "message_id": (sid, -1, 1),
        "expected_history_generation": (sid, message_id, 0),
    }
    cases_more = [
        ("bad id!", message_id, 1, "session_id"),
        (sid, message_id, -3, "expected_history_generation"),
        (sid, 0, 1, "message_id"),  # not above the expected fence
    ]
    calls = [(s, m, g, field) for field, (s, m, g) in cases.items()] + cases_more
    for session_id, fence_id, generation, field in calls:
        details = await refused(
            _fence(transcript.stub, transcript, session_id, fence_id, generation),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
        )
        assert [v.field for v in details.violations] == [field]
    assert await _session_state(transcript, sid) == (1, 0)


# Races, on PostgreSQL: real concurrent clients, each on its own channel.


@asynccontextmanager
async def _second_client(transcript: TranscriptClient) -> AsyncIterator[api_grpc.TranscriptServiceStub]:
    channel = open_channel(f"127.0.0.1:{transcript.service.port}")
    try:
        yield api_grpc.TranscriptServiceStub(channel)
    finally:
        await channel.close()


def _outcome(result: object, reason: str) -> bool:
    """True for a success; the one expected refusal otherwise."""
    if isinstance(result, BaseException):
        assert isinstance(result, grpc.aio.AioRpcError), result
        assert error_details(result).reason == reason, error_details(result)
        return False
    return True


async def _jittered(call: Callable[[], Awaitable[Any]]) -> Any:
    # A gRPC call starts when it is made, so the delay must come before making it.
    await asyncio.sleep(random.uniform(0, 0.004))
    return await call()


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_postgres_edit_and_fence_races_have_exactly_one_winner(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    wins = {"edit": 0, "fence": 0}
    async with _second_client(transcript) as compaction:
        for round_number in range(40):
            ids = await append(transcript, sid, user(f"q{round_number}"), assistant("a"), user("next"), assistant("b"))
            generation, fence_before = await _session_state(transcript, sid)
            edited_id = ids[0]
            # The boundary is the edited message or a later one that the edit would delete.
            boundary = ids[round_number % 3]
            edit: object
            fence: object
            edit, fence = await asyncio.gather(
                _jittered(partial(_edit, transcript.stub, transcript, sid, edited_id, f"q{round_number}, edited")),
                _jittered(
                    partial(_fence, compaction, transcript, sid, boundary, generation, expected_fence=fence_before)
                ),
                return_exceptions=True,
            )
            edit_won = _outcome(edit, "MESSAGE_ALREADY_COMPACTED")
            fence_won = _outcome(fence, "HISTORY_REWRITTEN")
            assert edit_won != fence_won, (round_number, edit, fence)
            live = dict(await _live(transcript, sid))
            new_generation, fence_after = await _session_state(transcript, sid)
            if fence_won:
                wins["fence"] += 1
                assert fence_after == boundary >= edited_id
                assert new_generation == generation
                assert live[edited_id] == f"q{round_number}" and all(i in live for i in ids)
            else:
                wins["edit"] += 1
                assert fence_after == fence_before < edited_id
                assert new_generation == generation + 1
                assert live[edited_id] == f"q{round_number}, edited" and not any(i in live for i in ids[1:])
    assert sum(wins.values()) == 40


async def _queued_behind_a_row_lock(
    database_url: str, session_id: str, first: Callable[[], Awaitable[Any]], second: Callable[[], Awaitable[Any]]
) -> tuple[Any, Any]:
    """Hold the session row lock, queue `first` then `second` behind it, release: PostgreSQL
    grants the row to them in that order, and the second's condition is re-checked after the first."""
    database = Database(database_url, schema="transcript")
    try:
        async with database.transaction() as holder:
            await holder.execute(text("SELECT 1 FROM sessions WHERE session_id = :s FOR UPDATE"), {"s": session_id})
            first_task = asyncio.ensure_future(first())
            await until_waiting(database, 1, "the first statement, behind the session row lock")
            second_task = asyncio.ensure_future(second())
            await until_waiting(database, 2, "the second statement, behind the first")
            assert not first_task.done() and not second_task.done()
        results = await asyncio.gather(first_task, second_task, return_exceptions=True)
    finally:
        await database.dispose()
    return results[0], results[1]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_postgres_fence_committed_first_refuses_the_waiting_edit(
    transcript: TranscriptClient, database_url: str
) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, user("u1"), assistant("a1"), user("u2"))
    async with _second_client(transcript) as compaction:
        fence, edit = await _queued_behind_a_row_lock(
            database_url,
            sid,
            lambda: _fence(compaction, transcript, sid, ids[1], 1),
            lambda: _edit(transcript.stub, transcript, sid, ids[0], "u1, edited"),
        )
    assert isinstance(fence, api.SetCompactionFenceResponse) and fence.message_id == ids[1]
    assert isinstance(edit, grpc.aio.AioRpcError)
    assert error_details(edit).reason == "MESSAGE_ALREADY_COMPACTED"
    assert await _live(transcript, sid) == [(ids[0], "u1"), (ids[1], "a1"), (ids[2], "u2")]
    assert await _session_state(transcript, sid) == (1, ids[1])
    assert await _event_count(transcript) == 0


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_postgres_edit_committed_first_makes_the_waiting_fence_history_rewritten(
    transcript: TranscriptClient, database_url: str
) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, user("u1"), assistant("a1"), user("u2"))
    async with _second_client(transcript) as compaction:
        edit, fence = await _queued_behind_a_row_lock(
            database_url,
            sid,
            lambda: _edit(transcript.stub, transcript, sid, ids[0], "u1, edited"),
            lambda: _fence(compaction, transcript, sid, ids[0], 1),
        )
    assert isinstance(edit, api.EditUserMessageResponse) and edit.history_generation == 2
    assert isinstance(fence, grpc.aio.AioRpcError)
    assert error_details(fence).reason == "HISTORY_REWRITTEN"
    assert await _live(transcript, sid) == [(ids[0], "u1, edited")]
    assert await _session_state(transcript, sid) == (2, 0)
