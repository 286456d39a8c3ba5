"""The Follow stream: handshake, then a snapshot (or a resume), then suffix frames until a resync.

The subscription is registered and the cut captured in one step, before any snapshot is read;
reading the page from disk and writing to the transport happen outside the publisher.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import select

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_runtime.cancellation import finish_before_stopping
from continuum_runtime.database import Database
from continuum_runtime.wire_names import TRANSCRIPT_V2
from continuum_transcript import bodies
from continuum_transcript import messages as messages_store
from continuum_transcript.errors import UpgradeRequired
from continuum_transcript.publisher import Cut, SessionPublisher
from continuum_transcript.tables import messages

SNAPSHOT_PAGE = 32


def require_protocol(capabilities: list[str]) -> None:
    """An old peer gets an explicit upgrade error, never a legacy fallback."""
    if TRANSCRIPT_V2 not in capabilities:
        raise UpgradeRequired(
            f"this server speaks {TRANSCRIPT_V2} only; upgrade the client", metadata={"required": TRANSCRIPT_V2}
        )


def frame_seq(frame: api.FollowResponse) -> int:
    """The business sequence a replayable frame belongs to."""
    kind = frame.WhichOneof("frame")
    if kind == "batch":
        return frame.batch.seq
    if kind == "watermark":
        return frame.watermark.seq
    return frame.settlement.seq


def can_resume(request: api.FollowRequest, cut: Cut) -> bool:
    """Whether the client's cursor lies inside the replay window of the current stream generation."""
    if not request.HasField("resume"):
        return False
    cursor = request.resume
    return cursor.stream_generation == cut.stream_generation and cut.replay_first_seq - 1 <= cursor.seq <= cut.seq


async def stream(
    publisher: SessionPublisher,
    database: Database,
    request: api.FollowRequest,
    heartbeat_seconds: float,
    limits: bodies.Limits,
) -> AsyncIterator[api.FollowResponse]:
    """Every frame one follower receives, in order."""
    subscription, cut = publisher.subscribe()
    stream_generation = cut.stream_generation
    try:
        handshake = fpb.HandshakeFrame(
            protocol=TRANSCRIPT_V2,
            commit_seq=publisher.commit_seq,
            durable_seq=publisher.durable_seq,
            replay_first_seq=cut.replay_first_seq,
        )
        if can_resume(request, cut):
            handshake.mode = fpb.FOLLOW_MODE_RESUME
            yield api.FollowResponse(stream_generation=stream_generation, handshake=handshake)
            for prefix in cut.prefix_frames():
                yield api.FollowResponse(stream_generation=stream_generation, snapshot_prefix=prefix)
            for frame in cut.replay:
                if frame_seq(frame) > request.resume.seq:
                    yield frame
        else:
            handshake.mode = fpb.FOLLOW_MODE_BASELINE
            yield api.FollowResponse(stream_generation=stream_generation, handshake=handshake)
            async for frame in _snapshot(publisher, database, cut, limits):
                yield frame
        while True:
            item = await subscription.next(heartbeat_seconds)
            if item is None:
                # A rewrite may have ended this stream while the wait timed out: its resync is queued,
                # and a heartbeat now would already carry the next stream generation.
                if not subscription.ended:
                    yield publisher.heartbeat(stream_generation)
                continue
            event_no, frame = item
            if event_no and event_no <= cut.event_no:
                continue
            yield frame
            if frame.WhichOneof("frame") == "resync":
                return
    finally:
        publisher.unsubscribe(subscription)


async def _snapshot(
    publisher: SessionPublisher, database: Database, cut: Cut, limits: bodies.Limits
) -> AsyncIterator[api.FollowResponse]:
    stream_generation = cut.stream_generation
    if cut.seq > publisher.durable_seq:
        # The cut is ahead of disk: flush first, so the page and the history cursors are canonical.
        await publisher.flush_until(cut.seq)
    begin = fpb.SnapshotBeginFrame(seq=cut.seq, durable_seq=publisher.durable_seq)
    yield api.FollowResponse(stream_generation=stream_generation, snapshot_begin=begin)
    page, has_older = await finish_before_stopping(
        read_page_at(database, publisher.session_id, cut.seq, SNAPSHOT_PAGE, limits)
    )
    history = fpb.HistoryCursor(
        stream_generation=stream_generation,
        snapshot_sequence=cut.seq,
        before_message_id=page[0].message_id if page else 0,
    )
    records = fpb.SnapshotRecordsFrame(messages=page, has_older=has_older, history=history)
    yield api.FollowResponse(stream_generation=stream_generation, snapshot_records=records)
    runtime = fpb.SnapshotRuntimeFrame(runtime_state=cut.runtime_state, prompts=cut.prompts)
    yield api.FollowResponse(stream_generation=stream_generation, snapshot_runtime=runtime)
    for prefix in cut.prefix_frames():
        yield api.FollowResponse(stream_generation=stream_generation, snapshot_prefix=prefix)
    yield api.FollowResponse(stream_generation=stream_generation, snapshot_end=fpb.SnapshotEndFrame(seq=cut.seq))


async def read_page_at(
    database: Database, session_id: str, seq: int, size: int, limits: bodies.Limits
) -> tuple[list[pb.Message], bool]:
    """The last `size` live messages committed at or before `seq`, ascending, whether older ones
    exist, the newest travelling whole while they fit `limits` and the rest as stubs."""
    query = (
        select(*messages_store.LIGHT)
        .where(messages.c.session_id == session_id, messages.c.deleted.is_(False), messages.c.commit_seq <= seq)
        .order_by(*messages_store.NEWEST_FIRST)
        .limit(size + 1)
    )
    async with database.connection() as connection:
        rows = list((await connection.execute(query)).mappings())
        has_older = len(rows) > size
        page = await messages_store.bounded(connection, list(reversed(rows[:size])), limits, newest_first=True)
    return page, has_older
