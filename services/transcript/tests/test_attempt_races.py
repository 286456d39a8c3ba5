"""A cancel that must wait for message ids, with chunks arriving meanwhile (PostgreSQL, real clients).

`CancelAttempt` holds the publisher's accept lock and, when its reserved id block is used up,
reserves more from the database before it reads what was shown. `AppendChunks` takes no such lock,
so chunks can arrive during that reservation. What the publisher guarantees: the attempt stays
open until the cancel takes it, so those chunks are accepted, shown, and stored in the interrupted
message; a chunk after the cancel is refused. Followers never see text the stored message lacks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

import grpc
import pytest
from race_testing import until_waiting
from sqlalchemy import text
from transcript_testing import (
    Follower,
    TranscriptClient,
    append,
    create_session,
    kinds,
    refused,
    running_transcript,
    user,
)

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.database import Database

ALICE = "alice"


def _chunks(
    client: TranscriptClient, sid: str, ref: fpb.AttemptRef, first: int, *texts: str
) -> Awaitable[api.AppendChunksResponse]:
    request = api.AppendChunksRequest(session_id=sid, attempt=ref, first_chunk_index=first, chunks=list(texts))
    return client.stub.AppendChunks(request, metadata=client.as_user(ALICE))  # type: ignore[no-any-return]


@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
async def test_chunks_during_a_cancels_id_reservation_are_stored_in_the_interrupted_message_postgres(
    tmp_path: Path, database_url: str
) -> None:
    # A block of one id: every accepted message uses up the block, so the cancel must reserve.
    async with running_transcript(tmp_path, database_url, publisher_id_block=1) as transcript:
        sid = await create_session(transcript)
        await append(transcript, sid, user("explain"))
        ref = fpb.AttemptRef(message_key="m1", attempt=1)
        await transcript.stub.OpenAttempt(
            api.OpenAttemptRequest(session_id=sid, attempt=ref), metadata=transcript.as_user(ALICE)
        )
        await _chunks(transcript, sid, ref, 0, "shown ", "before")
        follower = Follower(transcript, sid)
        await follower.until("snapshot_end")

        database = Database(database_url, schema="transcript")
        try:
            async with database.transaction() as holder:
                # ALTER SEQUENCE locks the message id sequence until this transaction ends (and
                # changes nothing: it is rolled back); nextval() waits for that lock.
                sequence = await holder.scalar(text("SELECT pg_get_serial_sequence('messages', 'message_id')"))
                await holder.execute(text(f"ALTER SEQUENCE {sequence} CACHE 1"))
                cancel = asyncio.ensure_future(
                    transcript.stub.CancelAttempt(
                        api.CancelAttemptRequest(session_id=sid, attempt=ref, wait_durable=True),
                        metadata=transcript.as_user(ALICE),
                    )
                )
                await until_waiting(database, 1, "the cancel's id reservation, behind the sequence lock")
                during = await _chunks(transcript, sid, ref, 2, " and", " during")
                assert not cancel.done()
                await holder.rollback()
        finally:
            await database.dispose()
        cancelled = await cancel

        assert during.next_chunk_index == 4
        stored = await transcript.stub.GetMessage(
            api.GetMessageRequest(session_id=sid, message_id=cancelled.message_id),
            metadata=transcript.as_user(ALICE),
        )
        assert stored.message.status == pb.MESSAGE_STATUS_INTERRUPTED
        assert stored.message.content[0].text == "shown before and during"
        # Followers saw exactly the stored text, then the message that replaced it.
        frames = await follower.until("settlement")
        assert kinds(frames) == ["chunk", "chunk", "batch", "settlement"]
        assert [f.chunk.text for f in frames[:2]] == [" and", " during"]
        assert frames[2].batch.messages[0].content[0].text == "shown before and during"
        assert frames[2].batch.settles == ref
        assert frames[3].settlement.outcome == fpb.SETTLEMENT_OUTCOME_INTERRUPTED
        # After the cancel the attempt is over: a late chunk is refused, not lost silently.
        await refused(
            _chunks(transcript, sid, ref, 4, " late"), grpc.StatusCode.FAILED_PRECONDITION, "ATTEMPT_CONFLICT"
        )
        follower.close()
