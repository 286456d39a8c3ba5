"""Nothing a client reads grows with the history: pages and frames have byte budgets, large bodies
travel as stubs with a preview and are loaded by id in bounded pieces, and every live buffer is
bounded in bytes as well as in counts."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import pytest
from transcript_testing import (
    Follower,
    TranscriptClient,
    all_messages,
    append,
    create_session,
    kinds,
    refused,
    running_transcript,
    tool,
    user,
)

from continuum.compaction.events.v1 import events_pb2
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_follow import RecordStore, load_message
from continuum_transcript import bodies

ALICE = "alice"
KIB = 1024
MIB = 1024 * KIB


def _text(message: pb.Message) -> str:
    return "".join(part.text for part in message.content if part.WhichOneof("part") == "text")


def _big(label: str, size: int) -> pb.NewMessage:
    """A USER message of about `size` bytes whose words make a recognisable preview."""
    return user(f"{label} begins here " + "é" * (size // 2))


async def _page(
    client: TranscriptClient, sid: str, page_size: int = 0, direction: int = api.PAGE_DIRECTION_OLDER
) -> api.ListMessagePageResponse:
    request = api.ListMessagePageRequest(session_id=sid, page_size=page_size, direction=direction)  # type: ignore[arg-type]
    response: api.ListMessagePageResponse = await client.stub.ListMessagePage(request, metadata=client.as_user(ALICE))
    return response


def _assert_stub(message: pb.Message, label: str) -> None:
    assert message.body_deferred and message.body_bytes > 64 * KIB
    assert not message.content and not message.tool_calls and not message.metadata.fields
    assert message.preview.startswith(f"{label} begins here é")
    assert len(message.preview) <= bodies.PREVIEW_CHARS


async def test_large_bodies_travel_as_stubs_in_pages_and_load_whole_by_id(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    _, big = await append(transcript, sid, user("small"), _big("huge", 3 * MIB))

    page = await _page(transcript, sid)

    whole, stub = page.messages
    assert (_text(whole), whole.body_deferred, whole.body_bytes > 0) == ("small", False, True)
    _assert_stub(stub, "huge")
    assert stub.message_id == big and stub.role == pb.MESSAGE_ROLE_USER
    # Loaded by id it is whole: in one read, or in bounded pieces.
    got = await transcript.stub.GetMessage(
        api.GetMessageRequest(session_id=sid, message_id=big), metadata=transcript.as_user(ALICE)
    )
    assert _text(got.message) == _big("huge", 3 * MIB).content[0].text
    frames = [
        frame
        async for frame in transcript.stub.StreamMessage(
            api.StreamMessageRequest(session_id=sid, message_id=big), metadata=transcript.as_user(ALICE)
        )
    ]
    assert frames[0].HasField("header") and frames[0].header.content[0].text == ""
    assert all(len(f.chunk.text.encode()) <= bodies.PIECE_BYTES for f in frames[1:])
    assert len(frames) > 2, "a 3 MiB body comes in several pieces"
    loaded = await load_message(transcript.stub, sid, big, transcript.as_user(ALICE))
    assert loaded == got.message
    await refused(
        transcript.stub.GetMessage(
            api.GetMessageRequest(session_id=sid, message_id=big), metadata=transcript.as_user("bob")
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "SESSION_PERMISSION_DENIED",
    )


async def test_a_large_body_with_nul_characters_is_stored_with_a_preview_without_them(
    transcript: TranscriptClient,
) -> None:
    # Tool output may contain NUL; PostgreSQL's text columns refuse it, so a stored preview that kept
    # it failed every flush of the batch and left the append waiting for ever.
    sid = await create_session(transcript)
    text = "exit\x00code 1\x00\x00binary " * 4 * KIB
    (message_id,) = await asyncio.wait_for(append(transcript, sid, user(text)), 30)

    got = await transcript.stub.GetMessage(
        api.GetMessageRequest(session_id=sid, message_id=message_id), metadata=transcript.as_user(ALICE)
    )
    assert _text(got.message) == text
    (stub,) = (await _page(transcript, sid)).messages
    assert stub.body_deferred and stub.preview.startswith("exit code 1 binary exit code 1 binary")


async def test_a_page_inlines_bodies_only_up_to_its_byte_budget(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url, frame_bytes=256 * KIB) as client:
        sid = await create_session(client)
        ids = await append(client, sid, *[user(f"m{n} " + "x" * 40 * KIB) for n in range(12)])

        page = await _page(client, sid, page_size=12)

        assert [m.message_id for m in page.messages] == ids
        whole = [m for m in page.messages if not m.body_deferred]
        # The newest travel whole (the end of the history is what a reader sees first).
        assert [m.message_id for m in whole] == ids[-len(whole) :] and 0 < len(whole) < 12
        assert page.ByteSize() <= 256 * KIB + 12 * bodies.STUB_BYTES
        assert all(m.preview.startswith(f"m{n} x") for n, m in enumerate(page.messages) if m.body_deferred)
        # Paging newer from the start prefers the oldest instead.
        newer = await _page(client, sid, page_size=12, direction=api.PAGE_DIRECTION_NEWER)
        assert not newer.messages[0].body_deferred and newer.messages[-1].body_deferred


async def test_list_messages_after_cuts_by_stored_size_and_keeps_bodies_whole(
    tmp_path: Path, database_url: str
) -> None:
    async with running_transcript(tmp_path, database_url, list_page_bytes=MIB) as client:
        sid = await create_session(client)
        ids = await append(client, sid, *[_big(f"b{n}", 400 * KIB) for n in range(5)])
        first = await client.stub.ListMessagesAfter(
            api.ListMessagesAfterRequest(session_id=sid), metadata=client.as_user(ALICE)
        )
        assert [m.message_id for m in first.messages] == ids[:2] and first.next_page_token
        assert not any(m.body_deferred for m in first.messages)
        everything = await all_messages(client.stub, client.as_user(ALICE), sid)
        assert [m.message_id for m in everything] == ids


async def test_follow_frames_carry_large_bodies_as_stubs(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    await append(transcript, sid, _big("old", 2 * MIB), user("old small"))
    follower = Follower(transcript, sid)
    snapshot = await follower.until("snapshot_end")
    records = snapshot[kinds(snapshot).index("snapshot_records")].snapshot_records
    _assert_stub(records.messages[0], "old")
    assert _text(records.messages[1]) == "old small"

    await append(transcript, sid, _big("live", 15 * MIB), tool("c1", "small result"))
    batch = (await follower.until("batch"))[-1].batch
    _assert_stub(batch.messages[0], "live")
    assert _text(batch.messages[1]) == "small result"
    assert batch.ByteSize() < 64 * KIB
    follower.close()


async def test_a_long_attempt_is_snapshotted_in_bounded_pieces_that_a_store_joins(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ref = fpb.AttemptRef(message_key="m1", attempt=1)
    alice = transcript.as_user(ALICE)
    await transcript.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=ref), metadata=alice)
    chunks = [f"{n:04d}" + "y" * (60 * KIB) for n in range(20)]
    for first in range(0, 20, 5):
        await transcript.stub.AppendChunks(
            api.AppendChunksRequest(
                session_id=sid, attempt=ref, first_chunk_index=first, chunks=chunks[first : first + 5]
            ),
            metadata=alice,
        )
    follower = Follower(transcript, sid)
    frames = await follower.until("snapshot_end")
    pieces = [f.snapshot_prefix for f in frames if f.HasField("snapshot_prefix")]
    assert len(pieces) > 1 and all(len(p.text) <= 256 * KIB for p in pieces)
    assert pieces[0].first_chunk_index == 0
    assert all(a.next_chunk_index == b.first_chunk_index for a, b in itertools.pairwise(pieces))
    store = RecordStore()
    for frame in frames:
        store.apply(frame)
    assert store.prefixes["m1"].text == "".join(chunks) and store.prefixes["m1"].next_chunk_index == 20
    follower.close()


@pytest.mark.parametrize(
    ("field", "request_", "reason"),
    [
        ("chunks[1]", {"chunks": ["ok", "z" * (64 * KIB + 1)]}, "INVALID_ARGUMENT"),
    ],
)
async def test_an_oversized_chunk_is_refused_naming_it(
    transcript: TranscriptClient, field: str, request_: dict[str, object], reason: str
) -> None:
    sid = await create_session(transcript)
    ref = fpb.AttemptRef(message_key="m1", attempt=1)
    alice = transcript.as_user(ALICE)
    await transcript.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=ref), metadata=alice)
    details = await refused(
        transcript.stub.AppendChunks(
            api.AppendChunksRequest(session_id=sid, attempt=ref, first_chunk_index=0, **request_),  # type: ignore[arg-type]
            metadata=alice,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
    )
    assert [v.field for v in details.violations] == [field]


async def test_live_state_is_bounded_attempts_text_prompts_and_extras(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(
        tmp_path, database_url, max_open_attempts=2, max_pending_prompts=2, max_message_bytes=128 * KIB
    ) as client:
        sid = await create_session(client)
        alice = client.as_user(ALICE)

        def ref(key: str) -> fpb.AttemptRef:
            return fpb.AttemptRef(message_key=key, attempt=1)

        for key in ("a", "b"):
            await client.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=ref(key)), metadata=alice)
        await refused(
            client.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=ref("c")), metadata=alice),
            grpc.StatusCode.FAILED_PRECONDITION,
            "TOO_MANY_OPEN_ATTEMPTS",
        )
        chunk = "t" * (60 * KIB)
        await client.stub.AppendChunks(
            api.AppendChunksRequest(session_id=sid, attempt=ref("a"), chunks=[chunk, chunk]), metadata=alice
        )
        await refused(
            client.stub.AppendChunks(
                api.AppendChunksRequest(session_id=sid, attempt=ref("a"), first_chunk_index=2, chunks=[chunk]),
                metadata=alice,
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "ATTEMPT_TOO_LARGE",
        )

        def prompt(prompt_id: str) -> api.BatchOperation:
            return api.BatchOperation(
                prompt_upsert=fpb.PendingPrompt(prompt_id=prompt_id, kind=fpb.PROMPT_KIND_QUESTION)
            )

        await client.stub.PublishBatch(
            api.PublishBatchRequest(session_id=sid, operations=[prompt("p1"), prompt("p2")]), metadata=alice
        )
        await refused(
            client.stub.PublishBatch(
                api.PublishBatchRequest(session_id=sid, operations=[prompt("p3")]), metadata=alice
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "TOO_MANY_PENDING_PROMPTS",
        )
        # Resolving one makes room again.
        await client.stub.PublishBatch(
            api.PublishBatchRequest(
                session_id=sid, operations=[api.BatchOperation(prompt_resolved="p1"), prompt("p3")]
            ),
            metadata=alice,
        )
        # What every follower's frame carries besides messages stays small.
        extras = [api.BatchOperation(event=_large_event()) for _ in range(60)]
        details = await refused(
            client.stub.PublishBatch(api.PublishBatchRequest(session_id=sid, operations=extras), metadata=alice),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
        )
        assert details.violations[0].field.startswith("operations[")


def _large_event() -> fpb.RuntimeEvent:
    manifest = events_pb2.ContextManifest(
        sections=[events_pb2.ContextSection(key=f"system:s{n}", label="l" * 100) for n in range(60)]
    )
    return fpb.RuntimeEvent(context_window=events_pb2.ContextWindow(manifest=manifest))


async def test_a_follower_falling_behind_by_bytes_is_resynced(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url, follow_queue_bytes=MIB) as client:
        sid = await create_session(client)
        slow = Follower(client, sid)
        await slow.until("snapshot_end")
        # Far fewer frames than the frame bound, but more bytes than the byte bound.
        for n in range(120):
            await append(client, sid, user(f"{n} " + "w" * (60 * KIB)))
        frames = await slow.until("resync", seconds=30)
        assert frames[-1].resync.reason == fpb.RESYNC_REASON_OVERFLOW and frames[-1].resync.resumable
        assert len(frames) < 120
        slow.close()
