"""Follow v2 against the real server: snapshot + suffix, sampling attempts, resume, resync, pins."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest
from transcript_testing import (
    Follower,
    TranscriptClient,
    append,
    assistant,
    create_session,
    kinds,
    refused,
    running_transcript,
    user,
)

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api

ALICE = "alice"


def _ref(key: str = "m1", attempt: int = 1) -> fpb.AttemptRef:
    return fpb.AttemptRef(message_key=key, attempt=attempt)


async def _open(client: TranscriptClient, sid: str, ref: fpb.AttemptRef) -> None:
    await client.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=ref), metadata=client.as_user(ALICE))


async def _chunks(client: TranscriptClient, sid: str, ref: fpb.AttemptRef, first: int, *texts: str) -> int:
    response = await client.stub.AppendChunks(
        api.AppendChunksRequest(session_id=sid, attempt=ref, first_chunk_index=first, chunks=list(texts)),
        metadata=client.as_user(ALICE),
    )
    return int(response.next_chunk_index)


async def _publish(client: TranscriptClient, sid: str, *ops: api.BatchOperation, terminal: bool = False) -> int:
    response = await client.stub.PublishBatch(
        api.PublishBatchRequest(session_id=sid, operations=list(ops), terminal=terminal),
        metadata=client.as_user(ALICE),
    )
    return int(response.seq)


async def test_baseline_snapshot_then_chained_suffix(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, *[user(f"m{i}") for i in range(40)])
    follower = Follower(transcript, sid)
    snapshot = await follower.until("snapshot_end")
    assert kinds(snapshot) == [
        "handshake",
        "snapshot_begin",
        "snapshot_records",
        "snapshot_runtime",
        "snapshot_end",
    ]
    handshake, begin, records = snapshot[0].handshake, snapshot[1].snapshot_begin, snapshot[2].snapshot_records
    assert handshake.protocol == "transcript-v2" and handshake.mode == fpb.FOLLOW_MODE_BASELINE
    assert [m.message_id for m in records.messages] == ids[-32:] and records.has_older
    assert records.history.snapshot_sequence == begin.seq == snapshot[-1].snapshot_end.seq
    assert records.history.before_message_id == ids[-32]
    stream_generation = snapshot[0].stream_generation
    assert all(frame.stream_generation == stream_generation for frame in snapshot)

    await append(transcript, sid, user("after"))
    await _publish(transcript, sid)  # invisible: still advances the sequence
    await _publish(transcript, sid, api.BatchOperation(runtime_state=fpb.RuntimeState(state=fpb.RUN_STATE_RUNNING)))
    suffix = [await follower.next() for _ in range(3)]
    assert kinds(suffix) == ["batch", "watermark", "batch"]
    chain = [begin.seq]
    for frame in suffix:
        body = frame.batch if frame.HasField("batch") else frame.watermark
        assert body.base_seq == chain[-1]
        chain.append(body.seq)
    assert suffix[0].batch.messages[0].content[0].text == "after"
    assert suffix[2].batch.runtime_state.state == fpb.RUN_STATE_RUNNING
    beat = await follower.next(heartbeats=True, seconds=10)
    assert beat.WhichOneof("frame") == "heartbeat" and beat.heartbeat.commit_seq == chain[-1]
    follower.close()


async def test_sampling_commit_precedes_settlement_and_snapshot_carries_prefixes(
    transcript: TranscriptClient,
) -> None:
    sid = await create_session(transcript)
    await append(transcript, sid, user("explain"))
    ref = _ref()
    await _open(transcript, sid, ref)
    assert await _chunks(transcript, sid, ref, 0, "Par", "tial") == 2
    late = Follower(transcript, sid)
    snapshot = await late.until("snapshot_end")
    (prefix,) = [f.snapshot_prefix for f in snapshot if f.HasField("snapshot_prefix")]
    assert (prefix.attempt.message_key, prefix.next_chunk_index, prefix.text) == ("m1", 2, "Partial")
    await _chunks(transcript, sid, ref, 2, " answer")
    committed = await transcript.stub.CommitAttempt(
        api.CommitAttemptRequest(session_id=sid, attempt=ref, message=assistant("Partial answer"), wait_durable=True),
        metadata=transcript.as_user(ALICE),
    )
    frames = await late.until("settlement")
    assert kinds(frames) == ["chunk", "batch", "settlement"]
    assert frames[0].chunk.chunk_index == 2
    batch, settlement = frames[1].batch, frames[2].settlement
    assert batch.settles == ref and batch.messages[0].message_id == committed.message_id
    assert batch.messages[0].metadata["messageKey"] == "m1"
    assert settlement.seq == batch.seq == committed.seq
    assert settlement.outcome == fpb.SETTLEMENT_OUTCOME_COMMITTED
    late.close()
    again = Follower(transcript, sid)
    assert "snapshot_prefix" not in kinds(await again.until("snapshot_end"))
    again.close()


async def test_cancel_stores_exactly_the_displayed_output_and_retry_replaces(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    follower = Follower(transcript, sid)
    await follower.until("snapshot_end")
    first = _ref(attempt=1)
    await _open(transcript, sid, first)
    await _chunks(transcript, sid, first, 0, "wrong ", "path")
    retry = _ref(attempt=2)
    await _open(transcript, sid, retry)
    await refused(
        transcript.stub.AppendChunks(
            api.AppendChunksRequest(session_id=sid, attempt=first, first_chunk_index=2, chunks=["x"]),
            metadata=transcript.as_user(ALICE),
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "ATTEMPT_CONFLICT",
    )
    await _chunks(transcript, sid, retry, 0, "Shown ", "so far")
    cancelled = await transcript.stub.CancelAttempt(
        api.CancelAttemptRequest(session_id=sid, attempt=retry, wait_durable=True), metadata=transcript.as_user(ALICE)
    )
    frames = await follower.until("settlement")
    assert kinds(frames) == [
        "attempt_opened",
        "chunk",
        "chunk",
        "attempt_opened",
        "chunk",
        "chunk",
        "batch",
        "settlement",
    ]
    assert frames[-1].settlement.outcome == fpb.SETTLEMENT_OUTCOME_INTERRUPTED
    stored = await transcript.stub.GetMessage(
        api.GetMessageRequest(session_id=sid, message_id=cancelled.message_id), metadata=transcript.as_user(ALICE)
    )
    assert stored.message.status == pb.MESSAGE_STATUS_INTERRUPTED
    assert stored.message.content[0].text == "Shown so far"
    follower.close()


async def test_a_disconnect_is_never_a_cancel(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ref = _ref()
    await _open(transcript, sid, ref)
    follower = Follower(transcript, sid)
    await follower.until("snapshot_end")
    follower.close()
    await asyncio.sleep(0.1)
    await _chunks(transcript, sid, ref, 0, "still going")
    done = await transcript.stub.CommitAttempt(
        api.CommitAttemptRequest(session_id=sid, attempt=ref, message=assistant("still going")),
        metadata=transcript.as_user(ALICE),
    )
    assert done.message_id > 0


async def test_resume_inside_the_window_gets_only_the_suffix(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    await append(transcript, sid, user("one"))
    follower = Follower(transcript, sid)
    snapshot = await follower.until("snapshot_end")
    stream_generation, seq = snapshot[0].stream_generation, snapshot[-1].snapshot_end.seq
    follower.close()
    await append(transcript, sid, user("two"))
    ref = _ref()
    await _open(transcript, sid, ref)
    await _chunks(transcript, sid, ref, 0, "typing")
    resumed = Follower(transcript, sid, resume=(stream_generation, seq))
    frames = [await resumed.next() for _ in range(3)]
    assert kinds(frames) == ["handshake", "snapshot_prefix", "batch"]
    assert frames[0].handshake.mode == fpb.FOLLOW_MODE_RESUME
    assert frames[1].snapshot_prefix.text == "typing"
    assert frames[2].batch.base_seq == seq and frames[2].batch.messages[0].content[0].text == "two"
    resumed.close()
    stale = Follower(transcript, sid, resume=(stream_generation - 1, seq))
    assert (await stale.next()).handshake.mode == fpb.FOLLOW_MODE_BASELINE
    stale.close()
    ahead = Follower(transcript, sid, resume=(stream_generation, seq + 100))
    assert (await ahead.next()).handshake.mode == fpb.FOLLOW_MODE_BASELINE
    ahead.close()


async def test_cursor_older_than_the_replay_window_gets_a_baseline(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url, follow_replay_frames=16) as client:
        sid = await create_session(client)
        follower = Follower(client, sid)
        snapshot = await follower.until("snapshot_end")
        follower.close()
        for index in range(20):
            await append(client, sid, user(f"m{index}"))
        old = Follower(client, sid, resume=(snapshot[0].stream_generation, snapshot[-1].snapshot_end.seq))
        assert (await old.next()).handshake.mode == fpb.FOLLOW_MODE_BASELINE
        old.close()


async def test_a_follower_behind_its_queue_bound_gets_overflow(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url, follow_queue_bound=16, max_chunk_bytes=256 * 1024) as client:
        sid = await create_session(client)
        slow = Follower(client, sid)
        await slow.until("snapshot_end")
        # A steady follower keeps up with the same traffic: judged by throughput, not silence.
        steady = Follower(client, sid)
        await steady.until("snapshot_end")
        ref = _ref()
        await _open(client, sid, ref)
        assert (await steady.next()).HasField("attempt_opened")
        # Large chunks fill the slow reader's transport buffers, so its queue really backs up.
        big = "x" * (256 * 1024)
        for index in range(48):
            await _chunks(client, sid, ref, index, big)
            assert (await steady.next()).chunk.chunk_index == index
        frames = await slow.until("resync", seconds=30)
        assert frames[-1].resync.reason == fpb.RESYNC_REASON_OVERFLOW and frames[-1].resync.resumable
        assert len(frames) < 48, "the backlog was dropped, not delivered"
        await _chunks(client, sid, ref, 48, "more")
        assert (await steady.next()).chunk.chunk_index == 48
        slow.close()
        steady.close()


async def test_rewrite_ends_followers_and_pins_go_stale(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    ids = await append(transcript, sid, user("q1"), assistant("a1"), user("q2"))
    follower = Follower(transcript, sid)
    snapshot = await follower.until("snapshot_end")
    stream_generation, cut = snapshot[0].stream_generation, snapshot[-1].snapshot_end.seq
    await append(transcript, sid, assistant("a2"))
    pinned = await transcript.stub.ListMessagePage(
        api.ListMessagePageRequest(session_id=sid, stream_generation=stream_generation, snapshot_sequence=cut),
        metadata=transcript.as_user(ALICE),
    )
    assert pinned.status == api.PIN_STATUS_OK and [m.message_id for m in pinned.messages] == ids
    await transcript.stub.EditUserMessage(
        api.EditUserMessageRequest(session_id=sid, message_id=ids[2], content=[pb.ContentPart(text="q2!")]),
        metadata=transcript.as_user(ALICE),
    )
    frames = await follower.until("resync")
    assert frames[-1].resync.reason == fpb.RESYNC_REASON_REWRITE and not frames[-1].resync.resumable
    stale = await transcript.stub.ListMessagePage(
        api.ListMessagePageRequest(session_id=sid, stream_generation=stream_generation, snapshot_sequence=cut),
        metadata=transcript.as_user(ALICE),
    )
    assert stale.status == api.PIN_STATUS_STALE and list(stale.messages) == []
    fresh = Follower(transcript, sid, resume=(stream_generation, cut))
    first = await fresh.next()
    assert first.handshake.mode == fpb.FOLLOW_MODE_BASELINE and first.stream_generation > stream_generation
    fresh.close()


async def test_restarted_publisher_is_a_new_generation_with_everything_durable(
    tmp_path: Path, database_url: str
) -> None:
    async with running_transcript(tmp_path, database_url) as client:
        sid = await create_session(client)
        ids = await append(client, sid, user("before restart"))
        follower = Follower(client, sid)
        stream_generation = (await follower.until("snapshot_end"))[0].stream_generation
        follower.close()
    async with running_transcript(tmp_path, database_url) as client:
        follower = Follower(client, sid, resume=(stream_generation, 1))
        frames = await follower.until("snapshot_end")
        assert frames[0].handshake.mode == fpb.FOLLOW_MODE_BASELINE and frames[0].stream_generation > stream_generation
        records = next(f.snapshot_records for f in frames if f.HasField("snapshot_records"))
        assert [m.message_id for m in records.messages] == ids
        more = await append(client, sid, user("after restart"))
        assert more[0] > ids[0]
        follower.close()


async def test_old_peers_and_bad_live_input_are_refused(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    alice = transcript.as_user(ALICE)
    old_peer = transcript.stub.Follow(api.FollowRequest(session_id=sid, capabilities=["transcript-v1"]), metadata=alice)
    await refused(old_peer.read(), grpc.StatusCode.FAILED_PRECONDITION, "UPGRADE_REQUIRED")
    other = transcript.stub.Follow(
        api.FollowRequest(session_id=sid, capabilities=["transcript-v2"]), metadata=transcript.as_user("bob")
    )
    await refused(other.read(), grpc.StatusCode.PERMISSION_DENIED, "SESSION_PERMISSION_DENIED")
    ref = _ref()
    invalid = [
        transcript.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=_ref("bad key!")), metadata=alice),
        transcript.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=_ref(attempt=0)), metadata=alice),
        transcript.stub.AppendChunks(api.AppendChunksRequest(session_id=sid, attempt=ref), metadata=alice),
        transcript.stub.CommitAttempt(
            api.CommitAttemptRequest(session_id=sid, attempt=ref, message=user("not assistant")), metadata=alice
        ),
        transcript.stub.PublishBatch(
            api.PublishBatchRequest(session_id=sid, operations=[api.BatchOperation()]), metadata=alice
        ),
        transcript.stub.PublishBatch(
            api.PublishBatchRequest(session_id=sid, operations=[api.BatchOperation(runtime_state=fpb.RuntimeState())]),
            metadata=alice,
        ),
        transcript.stub.PublishBatch(
            api.PublishBatchRequest(
                session_id=sid,
                operations=[api.BatchOperation(prompt_upsert=fpb.PendingPrompt(prompt_id="p1"))],
            ),
            metadata=alice,
        ),
    ]
    # JSON has no NaN: a state or prompt holding one was an INTERNAL error after taking a sequence.
    running = fpb.RuntimeState(state=fpb.RUN_STATE_RUNNING)
    running.details.update({"progress": math.nan})
    asking = fpb.PendingPrompt(prompt_id="p1", kind=fpb.PROMPT_KIND_QUESTION)
    asking.body.update({"choices": [1, math.inf]})
    for operation in (api.BatchOperation(runtime_state=running), api.BatchOperation(prompt_upsert=asking)):
        invalid.append(
            transcript.stub.PublishBatch(
                api.PublishBatchRequest(session_id=sid, operations=[operation]), metadata=alice
            )
        )
    for call in invalid:
        await refused(call, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    await _open(transcript, sid, ref)
    conflicts = [
        transcript.stub.OpenAttempt(api.OpenAttemptRequest(session_id=sid, attempt=ref), metadata=alice),
        transcript.stub.AppendChunks(
            api.AppendChunksRequest(session_id=sid, attempt=ref, first_chunk_index=3, chunks=["x"]), metadata=alice
        ),
        transcript.stub.CommitAttempt(
            api.CommitAttemptRequest(session_id=sid, attempt=_ref("other"), message=assistant("x")), metadata=alice
        ),
        transcript.stub.CancelAttempt(
            api.CancelAttemptRequest(session_id=sid, attempt=_ref(attempt=5)), metadata=alice
        ),
    ]
    for call in conflicts:
        await refused(call, grpc.StatusCode.FAILED_PRECONDITION, "ATTEMPT_CONFLICT")
    follower = Follower(transcript, sid)
    snapshot = await follower.until("snapshot_end")
    assert snapshot[-1].snapshot_end.seq == 0, "refused calls accepted no batch"
    follower.close()


async def test_prompts_and_runtime_state_survive_a_restart(tmp_path: Path, database_url: str) -> None:
    async with running_transcript(tmp_path, database_url) as client:
        sid = await create_session(client)
        approval = fpb.PendingPrompt(prompt_id="p1", kind=fpb.PROMPT_KIND_APPROVAL)
        approval.body.update({"tool": "shell"})
        await _publish(
            client,
            sid,
            api.BatchOperation(runtime_state=fpb.RuntimeState(state=fpb.RUN_STATE_WAITING, run_id="r1")),
            api.BatchOperation(prompt_upsert=approval),
            api.BatchOperation(prompt_upsert=fpb.PendingPrompt(prompt_id="p2", kind=fpb.PROMPT_KIND_QUESTION)),
            terminal=True,
        )
        await _publish(client, sid, api.BatchOperation(prompt_resolved="p2"), terminal=True)
    async with running_transcript(tmp_path, database_url) as client:
        follower = Follower(client, sid)
        frames = await follower.until("snapshot_end")
        runtime = next(f.snapshot_runtime for f in frames if f.HasField("snapshot_runtime"))
        assert runtime.runtime_state.state == fpb.RUN_STATE_WAITING and runtime.runtime_state.run_id == "r1"
        assert [p.prompt_id for p in runtime.prompts] == ["p1"] and runtime.prompts[0].body["tool"] == "shell"
        follower.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_deleting_a_followed_session_ends_its_followers(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    follower = Follower(transcript, sid)
    await follower.until("snapshot_end")
    await transcript.stub.DeleteSession(api.DeleteSessionRequest(session_id=sid), metadata=transcript.as_user(ALICE))
    assert (await follower.until("resync"))[-1].resync.reason == fpb.RESYNC_REASON_REWRITE
    again = transcript.stub.Follow(
        api.FollowRequest(session_id=sid, capabilities=["transcript-v2"]), metadata=transcript.as_user(ALICE)
    )
    await refused(again.read(), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")


async def test_frames_carry_attachment_media_types_and_unknown_ones_are_refused(transcript: TranscriptClient) -> None:
    sid = await create_session(transcript)
    alice = transcript.as_user(ALICE)
    upload = transcript.stub.UploadAttachment(metadata=alice)
    header = api.UploadAttachmentHeader(session_id=sid, media_type="image/png", file_name="a.png")
    await upload.write(api.UploadAttachmentRequest(header=header))
    await upload.write(api.UploadAttachmentRequest(chunk=b"png bytes"))
    await upload.done_writing()
    attachment_id = (await upload).attachment.attachment_id
    reference = pb.ContentPart(attachment=pb.AttachmentReference(attachment_id=attachment_id))
    follower = Follower(transcript, sid)
    await follower.until("snapshot_end")
    picture = pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=[pb.ContentPart(text="see"), reference])
    await _publish(transcript, sid, api.BatchOperation(message=picture))
    frame = await follower.next()
    assert frame.batch.messages[0].content[1].attachment.media_type == "image/png"
    unknown = pb.NewMessage(
        role=pb.MESSAGE_ROLE_USER,
        content=[pb.ContentPart(attachment=pb.AttachmentReference(attachment_id="missing"))],
    )
    await refused(
        transcript.stub.PublishBatch(
            api.PublishBatchRequest(session_id=sid, operations=[api.BatchOperation(message=unknown)]), metadata=alice
        ),
        grpc.StatusCode.NOT_FOUND,
        "ATTACHMENT_NOT_FOUND",
    )
    follower.close()
    again = Follower(transcript, sid)
    snapshot = await again.until("snapshot_end")
    records = next(f.snapshot_records for f in snapshot if f.HasField("snapshot_records"))
    assert records.messages[-1].content[1].attachment.media_type == "image/png"
    again.close()
