"""Messages: atomic batches, real increasing ids, reads after a boundary, pages, edits."""

from __future__ import annotations

import math

import grpc
import pytest
from transcript_testing import (
    TranscriptClient,
    all_messages,
    append,
    assistant,
    create_session,
    refused,
    tool,
    user,
)

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api


async def _all_after(client: TranscriptClient, session_id: str, after: int, page_size: int = 0) -> list[pb.Message]:
    return await all_messages(client.stub, client.as_user("alice"), session_id, after=after, page_size=page_size)


async def test_batch_gets_increasing_ids_and_round_trips(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    said = 'done: "é" \\ € 🙂\n\t\u2028'
    sent = [user("run the tests"), assistant("running", "call-1"), tool("call-1", "ok\x00binary"), assistant(said)]
    sent[2].metadata.update({"exitCode": 0})
    response = await transcript.stub.AppendMessages(
        api.AppendMessagesRequest(session_id=sid, messages=sent), metadata=transcript.as_user("alice")
    )
    ids = list(response.message_ids)
    assert ids == sorted(ids) and len(set(ids)) == 4
    stored = await _all_after(transcript, sid, 0)
    # The answered create_time is the one every message of the batch was stored with.
    assert {m.create_time.ToMilliseconds() for m in stored} == {response.create_time.ToMilliseconds()}
    assert [m.message_id for m in stored] == ids
    assert [m.content[0].text for m in stored] == ["run the tests", "running", "ok\x00binary", said]
    assert stored[1].tool_calls[0].tool_call_id == "call-1" and stored[2].tool_call_id == "call-1"
    assert stored[2].metadata["exitCode"] == 0
    assert all(m.status == pb.MESSAGE_STATUS_COMPLETE and not m.deleted for m in stored)


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param("", id="escapes"),
        # The six characters, no NUL: looks like an escaped NUL inside the stored JSON.
        pytest.param(" \\u0000 written out", id="written-escape"),
        pytest.param(" \x00 binary", id="nul"),
    ],
)
async def test_text_and_metadata_that_json_must_escape_round_trip(transcript: TranscriptClient, tail: str) -> None:
    sid = await create_session(transcript)
    said = 'done: "é" \\ € 🙂\n\t\u2028\x01' + tail
    sent = [user(said), assistant("calling", "call-1"), tool("call-1", said)]
    sent[1].tool_calls[0].arguments = said
    sent[2].metadata.update({"quoted": said, "nested": {"list": [1.5, "x", None, True]}})
    ids = await append(transcript, sid, *sent)
    stored = await _all_after(transcript, sid, 0)
    assert [m.message_id for m in stored] == ids
    assert [m.content[0].text for m in stored] == [said, "calling", said]
    assert stored[1].tool_calls[0].tool_call_id == "call-1" and stored[2].tool_call_id == "call-1"
    assert stored[1].tool_calls[0].arguments == said
    assert dict(stored[2].metadata) == dict(sent[2].metadata)


async def test_list_after_reads_everything_past_the_boundary_in_pages(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids: list[int] = []
    for start in range(0, 120, 40):
        ids += await append(transcript, sid, *[user(f"m{i}") for i in range(start, start + 40)])
    other = await create_session(transcript, "other")
    await append(transcript, other, user("elsewhere"))
    boundary = ids[49]
    after = await _all_after(transcript, sid, boundary, page_size=7)
    assert [m.message_id for m in after] == ids[50:]
    assert await _all_after(transcript, sid, ids[-1]) == []


async def test_a_five_megabyte_tool_output_is_ordinary(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    big = "x" * (5 * 1024 * 1024)
    ids = await append(transcript, sid, user("cat big.log"), assistant("", "c"), tool("c", big))
    got = await transcript.stub.GetMessage(
        api.GetMessageRequest(session_id=sid, message_id=ids[2]), metadata=transcript.as_user("alice")
    )
    assert len(got.message.content[0].text) == len(big)


async def test_an_unknown_role_or_status_is_refused_with_the_values_a_request_may_spell(
    transcript: TranscriptClient,
) -> None:
    sid = await create_session(transcript)
    unknown_role = pb.NewMessage(role=99, content=[pb.ContentPart(text="?")])  # type: ignore[arg-type]
    unknown_status = pb.NewMessage(role=pb.MESSAGE_ROLE_USER, status=99, content=[pb.ContentPart(text="?")])  # type: ignore[arg-type]
    expected = {
        "messages[0].role": (
            "must be one of MESSAGE_ROLE_USER, MESSAGE_ROLE_ASSISTANT, MESSAGE_ROLE_TOOL, MESSAGE_ROLE_SYSTEM"
        ),
        "messages[0].status": "must be one of MESSAGE_STATUS_COMPLETE, MESSAGE_STATUS_INTERRUPTED",
    }
    for bad, (field, description) in zip((unknown_role, unknown_status), expected.items(), strict=True):
        details = await refused(
            transcript.stub.AppendMessages(
                api.AppendMessagesRequest(session_id=sid, messages=[bad]), metadata=transcript.as_user("alice")
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
        )
        assert [(v.field, v.description) for v in details.violations] == [(field, description)]


async def test_malformed_batches_are_refused_whole(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    alice = transcript.as_user("alice")
    oversize = "y" * (transcript.settings.max_message_bytes + 1)
    bad_messages = {
        "messages[1].role": pb.NewMessage(content=[pb.ContentPart(text="no role")]),
        "messages[1].tool_call_id": pb.NewMessage(role=pb.MESSAGE_ROLE_TOOL, content=[pb.ContentPart(text="r")]),
        "messages[1].tool_calls": pb.NewMessage(
            role=pb.MESSAGE_ROLE_USER,
            content=[pb.ContentPart(text="u")],
            tool_calls=[pb.ToolCall(tool_call_id="c", name="n")],
        ),
        "messages[1].content": pb.NewMessage(role=pb.MESSAGE_ROLE_USER),
        "messages[1].content[0]": pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=[pb.ContentPart()]),
        "messages[1]": user(oversize),
        "messages[1].tool_calls[1].tool_call_id": assistant("dup", "c", "c"),
        # JSON has no NaN or Infinity (this was an INTERNAL error).
        "messages[1].metadata": tool("c", "r"),
    }
    bad_messages["messages[1].metadata"].metadata.update({"ok": 1, "nested": {"ratio": [0.5, math.nan]}})
    for field, bad in bad_messages.items():
        details = await refused(
            transcript.stub.AppendMessages(
                api.AppendMessagesRequest(session_id=sid, messages=[user("fine"), bad, user("fine too")]),
                metadata=alice,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
        )
        assert details.violations[0].field == field
    await refused(
        transcript.stub.AppendMessages(api.AppendMessagesRequest(session_id=sid), metadata=alice),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARGUMENT",
    )
    await refused(
        transcript.stub.AppendMessages(
            api.AppendMessagesRequest(
                session_id=sid,
                messages=[
                    user("x"),
                    pb.NewMessage(
                        role=pb.MESSAGE_ROLE_USER,
                        content=[pb.ContentPart(attachment=pb.AttachmentReference(attachment_id="nope"))],
                    ),
                ],
            ),
            metadata=alice,
        ),
        grpc.StatusCode.NOT_FOUND,
        "ATTACHMENT_NOT_FOUND",
    )
    assert await _all_after(transcript, sid, 0) == []


async def test_pages_around_an_anchor(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, *[user(f"m{i}") for i in range(100)])
    alice = transcript.as_user("alice")
    latest = await transcript.stub.ListMessagePage(api.ListMessagePageRequest(session_id=sid), metadata=alice)
    assert [m.message_id for m in latest.messages] == ids[-32:]
    assert latest.has_older and not latest.has_newer
    older = await transcript.stub.ListMessagePage(
        api.ListMessagePageRequest(session_id=sid, anchor_message_id=ids[-32]), metadata=alice
    )
    assert [m.message_id for m in older.messages] == ids[-64:-32] and older.has_older and older.has_newer
    newer = await transcript.stub.ListMessagePage(
        api.ListMessagePageRequest(
            session_id=sid, anchor_message_id=ids[10], direction=api.PAGE_DIRECTION_NEWER, page_size=5
        ),
        metadata=alice,
    )
    assert [m.message_id for m in newer.messages] == ids[11:16] and newer.has_older and newer.has_newer
    first = await transcript.stub.ListMessagePage(
        api.ListMessagePageRequest(session_id=sid, anchor_message_id=ids[3]), metadata=alice
    )
    assert [m.message_id for m in first.messages] == ids[:3] and not first.has_older


async def test_edit_rewrites_history_in_one_transaction(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    alice = transcript.as_user("alice")
    ids = await append(transcript, sid, user("first"), assistant("a1"), user("second"), assistant("a2"))
    edited = await transcript.stub.EditUserMessage(
        api.EditUserMessageRequest(
            session_id=sid,
            message_id=ids[0],
            content=[pb.ContentPart(text="first, reworded")],
            expected_history_generation=1,
        ),
        metadata=alice,
    )
    assert edited.history_generation == 2 and edited.deleted_message_count == 3 and edited.event_id > 0
    assert edited.message.content[0].text == "first, reworded"
    assert [m.message_id for m in await _all_after(transcript, sid, 0)] == [ids[0]]
    removed = await transcript.stub.GetMessage(api.GetMessageRequest(session_id=sid, message_id=ids[1]), metadata=alice)
    assert removed.message.deleted
    events = await transcript.stub.ListSessionEvents(api.ListSessionEventsRequest(), metadata=transcript.system)
    (event,) = events.events
    assert event.type == pb.SESSION_EVENT_TYPE_HISTORY_REWRITTEN
    assert (event.edited_message_id, event.history_generation) == (ids[0], 2)


async def test_edit_refusals_change_nothing(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    alice = transcript.as_user("alice")
    ids = await append(transcript, sid, user("q"), assistant("a"), user("q2"))

    def edit(message_id: int, generation: int = 0, part: pb.ContentPart | None = None) -> object:
        return transcript.stub.EditUserMessage(
            api.EditUserMessageRequest(
                session_id=sid,
                message_id=message_id,
                content=[part or pb.ContentPart(text="new")],
                expected_history_generation=generation,
            ),
            metadata=alice,
        )

    await refused(edit(ids[1]), grpc.StatusCode.FAILED_PRECONDITION, "MESSAGE_NOT_EDITABLE")  # type: ignore[arg-type]
    await refused(edit(ids[0], generation=7), grpc.StatusCode.ABORTED, "HISTORY_GENERATION_MISMATCH")  # type: ignore[arg-type]
    await refused(edit(999_999), grpc.StatusCode.NOT_FOUND, "MESSAGE_NOT_FOUND")  # type: ignore[arg-type]
    # New content may refer only to attachments uploaded to this session, as appended content may.
    elsewhere = pb.ContentPart(attachment=pb.AttachmentReference(attachment_id="nope"))
    await refused(edit(ids[0], part=elsewhere), grpc.StatusCode.NOT_FOUND, "ATTACHMENT_NOT_FOUND")  # type: ignore[arg-type]
    stored = await _all_after(transcript, sid, 0)
    assert [m.content[0].text for m in stored] == ["q", "a", "q2"]
    session = await transcript.stub.GetSession(api.GetSessionRequest(session_id=sid), metadata=alice)
    assert session.session.history_generation == 1
    events = await transcript.stub.ListSessionEvents(api.ListSessionEventsRequest(), metadata=transcript.system)
    assert list(events.events) == []


async def test_get_message_of_another_session_is_not_found(transcript: TranscriptClient) -> None:
    first = await create_session(transcript, "one")
    second = await create_session(transcript, "two")
    (message_id,) = await append(transcript, first, user("hello"))
    await refused(
        transcript.stub.GetMessage(
            api.GetMessageRequest(session_id=second, message_id=message_id), metadata=transcript.as_user("alice")
        ),
        grpc.StatusCode.NOT_FOUND,
        "MESSAGE_NOT_FOUND",
    )


async def test_pages_end_early_past_the_soft_byte_limit_and_lose_nothing(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, *[five_mib_user(i) for i in range(5)])
    first = await transcript.stub.ListMessagesAfter(
        api.ListMessagesAfterRequest(session_id=sid), metadata=transcript.as_user("alice")
    )
    assert 0 < len(first.messages) < 5 and first.next_page_token
    assert [m.message_id for m in await _all_after(transcript, sid, 0)] == ids


def five_mib_user(index: int) -> pb.NewMessage:
    """A 5 MiB USER message: five of them exceed one page's soft byte limit."""
    return user(f"{index}" + "z" * (5 * 1024 * 1024))


async def test_other_bad_message_requests_are_refused(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    alice = transcript.as_user("alice")
    (message_id,) = await append(transcript, sid, user("q"))
    calls = [
        transcript.stub.ListMessagePage(
            api.ListMessagePageRequest(session_id=sid, direction=7),  # type: ignore[arg-type]
            metadata=alice,
        ),
        transcript.stub.GetMessage(api.GetMessageRequest(session_id=sid, message_id=-1), metadata=alice),
        transcript.stub.ListMessagesAfter(
            api.ListMessagesAfterRequest(session_id=sid, after_message_id=-5), metadata=alice
        ),
        transcript.stub.EditUserMessage(
            api.EditUserMessageRequest(session_id=sid, message_id=message_id), metadata=alice
        ),
    ]
    for call in calls:
        await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    stored = await _all_after(transcript, sid, 0)
    assert [m.content[0].text for m in stored] == ["q"]
