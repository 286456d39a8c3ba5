"""A session with more than 200 MiB of history (ten 15 MB tool results and 100,000 small messages)
can be followed over gRPC and WebSocket, paged both ways, outlined and built into context, while the
transcript process's peak resident memory stays under 300 MiB and no frame, page or response grows
with the history.

Transcript runs as its own process so its memory is its own; compaction and the gateway run here.
The peak is measured from after the history is written: appending a 15 MB message costs memory in
proportion to that message (bounded by the batch limit), reading must cost nothing in proportion
to the history.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from compaction_testing import compaction_settings
from gateway_testing import ALICE_TOKEN
from gateway_ws_testing import follower, live_gateway, receive_frames
from process_testing import serve_module
from pydantic import SecretStr

from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum.compaction.v1 import compaction_service_pb2_grpc as capi_grpc
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_compaction.server import start as start_compaction
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.process_memory import peak_rss_bytes, reset_peak_rss

SERVICE_TOKEN = "gateway-test-service-token"  # the one the gateway test helpers present
USER = "alice"  # ALICE_TOKEN's user in the gateway test helpers
MIB = 1024 * 1024
HUGE_MESSAGES = 10
HUGE_BYTES = 15 * MIB
SMALL_MESSAGES = 100_000
SMALL_BYTES = 700
BATCH = 1000
PEAK_RSS_LIMIT = 300 * MIB
# What any one frame, page or response may weigh, whatever the history (generous: a page of 200
# stubs and its budget of inlined bodies, a BuildContext answer of its configured size).
FRAME_LIMIT = 2 * MIB
CONTEXT_LIMIT = 32 * MIB


@dataclass
class Running:
    """The transcript process and clients of it and of compaction."""

    pid: int
    port: int
    transcript: api_grpc.TranscriptServiceStub
    compaction: capi_grpc.CompactionServiceStub
    metadata: tuple[tuple[str, str], ...]


@asynccontextmanager
async def running(tmp_path: Path, database_url: str) -> AsyncIterator[Running]:
    env = {
        "TRANSCRIPT_DATA_DIR": str(tmp_path / "transcript"),
        "TRANSCRIPT_DATABASE_URL": database_url,
        "TRANSCRIPT_PORT": "0",
        "TRANSCRIPT_SERVICE_TOKEN": SERVICE_TOKEN,
    }
    process, port = await serve_module("continuum_transcript", "transcript", tmp_path / "transcript", env)
    settings = compaction_settings(
        tmp_path,
        database_url,
        port,
        service_token=SecretStr(SERVICE_TOKEN),
        context_window_tokens=128_000,
        trigger_ratio=0.8,
        consume_session_events=False,
    )
    compaction = await start_compaction(settings)
    transcript_channel = open_channel(f"127.0.0.1:{port}")
    compaction_channel = open_channel(f"127.0.0.1:{compaction.port}")
    try:
        yield Running(
            process.pid,
            port,
            api_grpc.TranscriptServiceStub(transcript_channel),
            capi_grpc.CompactionServiceStub(compaction_channel),
            call_metadata(SERVICE_TOKEN, USER),
        )
    finally:
        await transcript_channel.close()
        await compaction_channel.close()
        await compaction.stop(grace=0)
        process.kill()
        await process.wait()


def _text(role: pb.MessageRole.ValueType, text: str, **fields: object) -> pb.NewMessage:
    return pb.NewMessage(role=role, content=[pb.ContentPart(text=text)], **fields)  # type: ignore[arg-type]


async def _write_history(live: Running, session_id: str) -> int:
    """Ten turns, each with a 15 MB tool result, then small messages in turns of ten; how many."""
    written = 0
    for turn in range(HUGE_MESSAGES):
        call = pb.ToolCall(tool_call_id=f"read-{turn}", name="read_file", arguments='{"path": "dump.log"}')
        batch = [
            _text(pb.MESSAGE_ROLE_USER, f"turn {turn}: read the log"),
            _text(pb.MESSAGE_ROLE_ASSISTANT, "reading it", tool_calls=[call]),
            _text(pb.MESSAGE_ROLE_TOOL, f"log {turn} " + "L" * HUGE_BYTES, tool_call_id=f"read-{turn}"),
        ]
        for message in batch:  # one 15 MB message per request, as a runtime would send it
            await live.transcript.AppendMessages(
                api.AppendMessagesRequest(session_id=session_id, messages=[message]), metadata=live.metadata
            )
        written += len(batch)
    for start in range(0, SMALL_MESSAGES, BATCH):
        batch = [
            _text(pb.MESSAGE_ROLE_USER if n % 10 == 0 else pb.MESSAGE_ROLE_ASSISTANT, f"{n} " + "s" * SMALL_BYTES)
            for n in range(start, start + BATCH)
        ]
        await live.transcript.AppendMessages(
            api.AppendMessagesRequest(session_id=session_id, messages=batch), metadata=live.metadata
        )
        written += len(batch)
    return written


async def _follow_grpc(live: Running, session_id: str) -> list[api.FollowResponse]:
    call = live.transcript.Follow(
        api.FollowRequest(session_id=session_id, capabilities=["transcript-v2"]), metadata=live.metadata
    )
    frames = []
    try:
        async for frame in call:
            frames.append(frame)
            if frame.HasField("snapshot_end"):
                return frames
    finally:
        call.cancel()
    raise AssertionError("the Follow stream ended before its snapshot did")


async def _page_all(live: Running, session_id: str, direction: int) -> list[int]:
    """Every message id, paging in `direction` from the matching end; every page within the limit."""
    ids: list[int] = []
    anchor = 0
    while True:
        page = await live.transcript.ListMessagePage(
            api.ListMessagePageRequest(
                session_id=session_id,
                anchor_message_id=anchor,
                direction=direction,  # type: ignore[arg-type]
                page_size=200,
            ),
            metadata=live.metadata,
        )
        assert page.ByteSize() < FRAME_LIMIT
        newer = direction == api.PAGE_DIRECTION_NEWER
        ids = ids + [m.message_id for m in page.messages] if newer else [m.message_id for m in page.messages] + ids
        if not (page.has_newer if newer else page.has_older):
            return ids
        anchor = page.messages[-1].message_id if newer else page.messages[0].message_id


async def _outline_all(live: Running, session_id: str) -> int:
    turns, start = 0, 1
    pin: dict[str, int] = {}
    while True:
        page = await live.transcript.GetHistoryOutline(
            api.GetHistoryOutlineRequest(
                session_id=session_id, capabilities=["history-outline-v1"], start_turn=start, limit=1000, **pin
            ),
            metadata=live.metadata,
        )
        assert page.status == api.PIN_STATUS_OK and page.ByteSize() < FRAME_LIMIT
        turns += len(page.entries)
        if page.done:
            assert turns == page.total_turns
            return turns
        start = page.next_turn
        pin = {"stream_generation": page.stream_generation, "snapshot_sequence": page.snapshot_sequence}


@pytest.mark.timeout(900)
async def test_a_session_over_200_mib_is_read_in_bounded_memory_and_bounded_pieces(
    tmp_path: Path, database_url: str
) -> None:
    async with running(tmp_path, database_url) as live:
        session_id = "large"
        await live.transcript.CreateSession(api.CreateSessionRequest(session_id=session_id), metadata=live.metadata)
        total = await _write_history(live, session_id)
        assert HUGE_MESSAGES * HUGE_BYTES + SMALL_MESSAGES * SMALL_BYTES > 200 * MIB
        reset_peak_rss(live.pid)

        # Followed over gRPC: a bounded snapshot of the latest page, the rest reachable by cursor.
        snapshot = await _follow_grpc(live, session_id)
        assert max(frame.ByteSize() for frame in snapshot) < FRAME_LIMIT
        records = next(frame.snapshot_records for frame in snapshot if frame.HasField("snapshot_records"))
        assert records.has_older and len(records.messages) == 32

        # Followed over WebSocket through the gateway: frames as small.
        async with (
            live_gateway(tmp_path / "gateway", live.port) as gateway,
            follower(gateway, session_id, ALICE_TOKEN) as websocket,
        ):
            frames = await receive_frames(websocket, {"snapshotEnd"}, seconds=60)
        assert max(len(json.dumps(frame)) for frame in frames) < FRAME_LIMIT

        # Paged both ways: every message exactly once, in order, no page over the limit.
        older = await _page_all(live, session_id, api.PAGE_DIRECTION_OLDER)
        newer = await _page_all(live, session_id, api.PAGE_DIRECTION_NEWER)
        assert older == newer == sorted(set(older)) and len(older) == total

        # The 15 MB results travel as stubs in pages and load whole by id.
        first_page = await live.transcript.ListMessagePage(
            api.ListMessagePageRequest(session_id=session_id, direction=api.PAGE_DIRECTION_NEWER, page_size=3),
            metadata=live.metadata,
        )
        huge = first_page.messages[2]
        assert huge.body_deferred and huge.preview.startswith("log 0 LLL") and huge.body_bytes > HUGE_BYTES

        # Outlined: every turn, in bounded pages.
        assert await _outline_all(live, session_id) == HUGE_MESSAGES + SMALL_MESSAGES // 10

        # Built into context: the answer is bounded, huge results clipped, the oldest turns left out.
        built = await live.compaction.BuildContext(
            capi.BuildContextRequest(
                session_id=session_id, run_id="run-1", trigger_point=capi.TRIGGER_POINT_REQUEST_START
            ),
            metadata=live.metadata,
        )
        assert built.ByteSize() < CONTEXT_LIMIT + MIB
        assert built.manifest.omitted_message_count > 0
        texts = [message.content[0].text.split(" ", 1)[0] for message in built.messages[-10:]]
        assert texts == [str(n) for n in range(SMALL_MESSAGES - 10, SMALL_MESSAGES)], "the current turn is whole"

        peak = peak_rss_bytes(live.pid)
        assert peak < PEAK_RSS_LIMIT, f"transcript peaked at {peak / MIB:.0f} MiB while reading"


async def test_a_body_over_the_callers_message_limit_still_streams_in_pieces(tmp_path: Path, database_url: str) -> None:
    """GetMessage of a body over the caller's channel limit fails in the caller's channel (gRPC's own
    RESOURCE_EXHAUSTED), while StreamMessage reads it in pieces that fit."""
    async with running(tmp_path, database_url) as live:
        await live.transcript.CreateSession(api.CreateSessionRequest(session_id="s"), metadata=live.metadata)
        (big,) = (
            await live.transcript.AppendMessages(
                api.AppendMessagesRequest(session_id="s", messages=[_text(pb.MESSAGE_ROLE_USER, "q" * (5 * MIB))]),
                metadata=live.metadata,
            )
        ).message_ids
        small_channel = open_channel(f"127.0.0.1:{live.port}", max_message_bytes=MIB)
        try:
            stub = api_grpc.TranscriptServiceStub(small_channel)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.GetMessage(api.GetMessageRequest(session_id="s", message_id=big), metadata=live.metadata)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            pieces = [
                frame
                async for frame in stub.StreamMessage(
                    api.StreamMessageRequest(session_id="s", message_id=big), metadata=live.metadata
                )
            ]
            assert sum(len(frame.chunk.text) for frame in pieces) == 5 * MIB
        finally:
            await small_channel.close()
