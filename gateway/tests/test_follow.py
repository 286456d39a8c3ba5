"""The Follow WebSocket against a real transcript service, through a real uvicorn server."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import transcript_testing
from deadline_testing import deadline, eventually
from gateway_testing import ALICE_TOKEN, BOB_TOKEN
from gateway_ws_testing import (
    HELLO,
    LiveGateway,
    Transcript,
    error_reason,
    follower,
    live_gateway,
    read_direct_until,
    receive_frames,
    receive_json,
    receive_until_closed,
)
from google.protobuf import json_format
from websockets.asyncio.client import connect
from websockets.typing import Subprotocol

from continuum.transcript.v1 import follow_pb2, resources_pb2, transcript_service_pb2
from continuum_gateway.auth import bearer_subprotocol
from continuum_gateway.follow import FOLLOW_SUBPROTOCOL
from continuum_gateway.follow_hub import Hub
from continuum_runtime.server import GrpcService

FOLLOW_LOGGER = "continuum.gateway.follow"


@pytest.fixture(scope="module")
async def live(transcript: GrpcService, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveGateway]:
    """A gateway served by uvicorn, pinging every 0.2 s."""
    async with live_gateway(
        tmp_path_factory.mktemp("live"), transcript.port, ws_ping_interval_seconds=0.2, ws_ping_timeout_seconds=5.0
    ) as gateway:
        yield gateway


async def _small_window_socket(port: int) -> socket.socket:
    """A socket connected to the gateway with a 4 KiB receive buffer, for a browser that stops reading."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    return client


def _as_relayed(frame: transcript_service_pb2.FollowResponse) -> dict[str, Any]:
    """What the gateway must send for `frame`: the oneof's JSON name as type, then proto JSON."""
    kind = frame.WhichOneof("frame")
    assert kind is not None
    name = frame.DESCRIPTOR.fields_by_name[kind].json_name
    return {"type": name, **json_format.MessageToDict(frame, always_print_fields_with_no_presence=True)}


async def test_baseline_snapshot_arrives_as_json_frames_in_order(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    ids = await transcript_client.append(session_id, "first", "second")
    async with follower(live, session_id, ALICE_TOKEN) as websocket:
        assert websocket.subprotocol == FOLLOW_SUBPROTOCOL
        frames = await receive_frames(websocket, {"snapshotEnd"})
    assert [f["type"] for f in frames] == [
        "handshake",
        "snapshotBegin",
        "snapshotRecords",
        "snapshotRuntime",
        "snapshotEnd",
    ]
    stream_generation = frames[0]["streamGeneration"]
    assert isinstance(stream_generation, str)  # int64 in proto JSON
    assert stream_generation.isdigit()
    for frame in frames:
        assert set(frame) == {"type", "streamGeneration", frame["type"]}, frame
        assert frame["streamGeneration"] == stream_generation
    handshake = frames[0]["handshake"]
    assert (handshake["protocol"], handshake["mode"]) == ("transcript-v2", "FOLLOW_MODE_BASELINE")
    records = frames[2]["snapshotRecords"]
    assert [m["messageId"] for m in records["messages"]] == [str(i) for i in ids]
    assert [m["content"][0]["text"] for m in records["messages"]] == ["first", "second"]
    assert records["hasOlder"] is False
    assert (
        records["history"]["snapshotSequence"] == frames[1]["snapshotBegin"]["seq"] == frames[4]["snapshotEnd"]["seq"]
    )


async def test_published_frames_are_relayed_one_to_one(
    live: LiveGateway, transcript_client: Transcript, caplog: pytest.LogCaptureFixture
) -> None:
    session_id = await transcript_client.new_session()
    await transcript_client.append(session_id, "question")
    direct = transcript_client.follow(session_id)
    caplog.set_level(logging.DEBUG, "continuum.gateway")
    try:
        async with follower(live, session_id, ALICE_TOKEN) as websocket:
            await receive_frames(websocket, {"snapshotEnd"})
            await read_direct_until(direct, "snapshot_end")

            stub, metadata = transcript_client.stub, transcript_client.metadata("alice")
            await transcript_client.append(session_id, "follow-up")
            attempt = follow_pb2.AttemptRef(message_key="answer-1", attempt=1)
            await stub.OpenAttempt(
                transcript_service_pb2.OpenAttemptRequest(session_id=session_id, attempt=attempt), metadata=metadata
            )
            await stub.AppendChunks(
                transcript_service_pb2.AppendChunksRequest(
                    session_id=session_id, attempt=attempt, first_chunk_index=0, chunks=["Hel", "lo"]
                ),
                metadata=metadata,
            )
            answer = transcript_testing.assistant("Hello")
            await stub.CommitAttempt(
                transcript_service_pb2.CommitAttemptRequest(
                    session_id=session_id, attempt=attempt, message=answer, wait_durable=True
                ),
                metadata=metadata,
            )

            expected = [_as_relayed(frame) for frame in await read_direct_until(direct, "settlement")]
            relayed = await receive_frames(websocket, {"settlement"})
    finally:
        direct.cancel()
    assert relayed == expected
    assert [f["type"] for f in relayed] == ["batch", "attemptOpened", "chunk", "chunk", "batch", "settlement"]
    assert [f["chunk"]["text"] for f in relayed if f["type"] == "chunk"] == ["Hel", "lo"]
    assert relayed[0]["batch"]["messages"][0]["content"][0]["text"] == "follow-up"
    # The gateway logged the stream, never its content.
    await eventually(lambda: any(r.message == "follow closed" for r in caplog.records))
    assert not any(text in caplog.text for text in ("question", "follow-up", "Hel", ALICE_TOKEN))


async def test_resume_cursor_from_the_hello_reaches_transcript(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    await transcript_client.append(session_id, "one")
    async with follower(live, session_id, ALICE_TOKEN) as websocket:
        end = (await receive_frames(websocket, {"snapshotEnd"}))[-1]
    await transcript_client.append(session_id, "two")
    hello = {**HELLO, "resume": {"streamGeneration": end["streamGeneration"], "seq": end["snapshotEnd"]["seq"]}}
    async with follower(live, session_id, ALICE_TOKEN, hello=hello) as websocket:
        frames = await receive_frames(websocket, {"batch"})
    assert [f["type"] for f in frames] == ["handshake", "batch"]
    assert frames[0]["handshake"]["mode"] == "FOLLOW_MODE_RESUME"
    assert frames[1]["batch"]["messages"][0]["content"][0]["text"] == "two"


async def test_upstream_resync_is_relayed_then_the_socket_closes_normally(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    (message_id,) = await transcript_client.append(session_id, "original")
    async with follower(live, session_id, ALICE_TOKEN) as websocket:
        baseline = await receive_frames(websocket, {"snapshotEnd"})
        edit = transcript_service_pb2.EditUserMessageRequest(
            session_id=session_id, message_id=message_id, content=[resources_pb2.ContentPart(text="edited")]
        )
        await transcript_client.stub.EditUserMessage(edit, metadata=transcript_client.metadata("alice"))
        rest, code = await receive_until_closed(websocket)
    rest = [m for m in rest if m["type"] != "heartbeat"]
    assert [m["type"] for m in rest] == ["resync"]
    assert rest[0]["resync"] == {"reason": "RESYNC_REASON_REWRITE", "resumable": False}
    assert code == 1000
    # The browser re-follows and gets the new stream generation's baseline.
    async with follower(live, session_id, ALICE_TOKEN) as websocket:
        again = await receive_frames(websocket, {"snapshotEnd"})
    assert int(again[0]["streamGeneration"]) > int(baseline[0]["streamGeneration"])
    assert again[2]["snapshotRecords"]["messages"][0]["content"][0]["text"] == "edited"


@pytest.mark.parametrize(
    "hello",
    [
        {"type": "hello", "capabilities": ["transcript-v1"]},
        {"type": "hello"},
        {"type": "hello", "capabilities": []},
    ],
    ids=["older-protocol", "no-capabilities", "empty-capabilities"],
)
async def test_a_hello_without_transcript_v2_is_told_to_upgrade(
    live: LiveGateway, transcript_client: Transcript, hello: dict[str, Any]
) -> None:
    session_id = await transcript_client.new_session()
    before = live.upstreams.open_follows
    async with follower(live, session_id, ALICE_TOKEN, hello=hello) as websocket:
        messages, code = await receive_until_closed(websocket)
    assert len(messages) == 1
    error = messages[0]["error"]
    assert (error["code"], error["status"]) == (426, "FAILED_PRECONDITION")
    assert error_reason(messages[0]) == "UPGRADE_REQUIRED"
    assert error["details"][0]["metadata"] == {"required": "transcript-v2"}
    assert code == 4426
    # No legacy fallback, and no upstream call at all.
    assert live.upstreams.open_follows == before


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ("not json", "hello"),
        ('["hello"]', "type"),
        ('{"type": "subscribe", "capabilities": ["transcript-v2"]}', "type"),
        ('{"type": "hello", "capabilities": ["transcript-v2"], "token": "x"}', "token"),
        ('{"type": "hello", "capabilities": "transcript-v2"}', "capabilities"),
        ('{"type": "hello", "capabilities": ["transcript-v2", 7]}', "capabilities"),
        ('{"type": "hello", "capabilities": ["transcript-v2"], "resume": {"seq": "x"}}', "resume.seq"),
        (
            '{"type": "hello", "capabilities": ["transcript-v2"], "resume": {"streamGeneration": "abc"}}',
            "resume.streamGeneration",
        ),
        ('{"type": "hello", "capabilities": ["transcript-v2"], "resume": {"epoch": "1"}}', "resume.epoch"),
        ('{"type": "hello", "capabilities": ["transcript-v2"], "resume": 3}', "resume"),
        (
            '{"type": "hello", "capabilities": ["transcript-v2"], "resume": {"streamGeneration": "-1", "seq": "0"}}',
            "resume.streamGeneration",
        ),
        (
            '{"type": "hello", "capabilities": ["transcript-v2"], "resume": {"streamGeneration": "1", "seq": -2}}',
            "resume.seq",
        ),
        (b'{"type": "hello", "capabilities": ["transcript-v2"]}', "hello"),
    ],
    ids=[
        "not-json",
        "not-object",
        "wrong-type",
        "unknown-field",
        "not-list",
        "not-string",
        "bad-cursor",
        "bad-stream-generation",
        "unknown-resume-field",
        "bad-resume",
        "negative-stream-generation",
        "negative-seq",
        "binary",
    ],
)
async def test_a_malformed_hello_is_invalid_argument(
    live: LiveGateway, transcript_client: Transcript, raw: str | bytes, field: str
) -> None:
    session_id = await transcript_client.new_session()
    async with follower(live, session_id, ALICE_TOKEN, hello=None) as websocket:
        await websocket.send(raw)
        messages, code = await receive_until_closed(websocket)
    (message,) = messages
    assert (message["error"]["code"], message["error"]["status"]) == (400, "INVALID_ARGUMENT")
    assert error_reason(message) == "INVALID_HELLO"
    (violations,) = [d for d in message["error"]["details"] if "fieldViolations" in d]
    assert violations["fieldViolations"][0]["field"] == field
    # The refusal speaks the API's words, never a Python parser's.
    assert "invalid literal" not in message["error"]["message"]
    assert code == 4400


async def test_a_silent_browser_is_closed_after_the_hello_timeout(
    transcript: GrpcService, transcript_client: Transcript, tmp_path: Path
) -> None:
    session_id = await transcript_client.new_session()
    async with (
        live_gateway(tmp_path, transcript.port, follow_hello_timeout_seconds=0.2) as gateway,
        follower(gateway, session_id, ALICE_TOKEN, hello=None) as websocket,
    ):
        messages, code = await receive_until_closed(websocket)
    assert [error_reason(m) for m in messages] == ["HELLO_TIMEOUT"]
    assert code == 4504


@pytest.mark.parametrize(
    ("user_token", "status", "reason", "code"),
    [
        (BOB_TOKEN, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED", 4403),
        (ALICE_TOKEN, "NOT_FOUND", "SESSION_NOT_FOUND", 4404),
    ],
    ids=["another-users-session", "missing-session"],
)
async def test_upstream_refusals_become_an_error_message_and_close_code(
    live: LiveGateway, transcript_client: Transcript, user_token: str, status: str, reason: str, code: int
) -> None:
    session_id = await transcript_client.new_session("alice")
    if status == "NOT_FOUND":
        session_id += "-missing"
    async with follower(live, session_id, user_token) as websocket:
        messages, close_code = await receive_until_closed(websocket)
    (message,) = messages
    assert message["error"]["status"] == status
    assert message["error"]["code"] == code - 4000
    assert message["error"]["details"][0]["domain"] == "transcript.continuum"
    assert error_reason(message) == reason
    assert close_code == code
    await eventually(lambda: live.upstreams.open_follows == 0)


@pytest.mark.parametrize("bob_by_header", [False, True], ids=["subprotocol-token", "header-token"])
async def test_a_client_sent_acting_user_header_is_ignored(
    live: LiveGateway, transcript_client: Transcript, bob_by_header: bool
) -> None:
    """The acting user comes from the token only: Bob naming Alice in the header the services read
    the user from is still Bob, refused on Alice's session, and sees his own as Bob."""
    alice_session = await transcript_client.new_session("alice")
    bob_session = await transcript_client.new_session("bob")
    claimed = {"x-continuum-user": "alice"}
    if bob_by_header:
        claimed["Authorization"] = f"Bearer {BOB_TOKEN}"
        subprotocols = [Subprotocol(FOLLOW_SUBPROTOCOL)]
    else:
        subprotocols = [Subprotocol(FOLLOW_SUBPROTOCOL), Subprotocol(bearer_subprotocol(BOB_TOKEN))]

    def connecting(session_id: str) -> Any:
        return connect(live.url(session_id), subprotocols=subprotocols, additional_headers=claimed, open_timeout=10)

    async with connecting(alice_session) as websocket:
        await websocket.send(json.dumps(HELLO))
        messages, code = await receive_until_closed(websocket)
    assert [error_reason(m) for m in messages] == ["SESSION_PERMISSION_DENIED"]
    assert code == 4403
    async with connecting(bob_session) as websocket:
        await websocket.send(json.dumps(HELLO))
        assert (await receive_frames(websocket, {"snapshotEnd"}))[0]["type"] == "handshake"
        assert _hub(live, bob_session, "bob") is not None
        assert _hub(live, bob_session, "alice") is None


async def test_an_acting_user_header_is_no_websocket_credential(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session("alice")
    async with connect(
        live.url(session_id),
        subprotocols=[Subprotocol(FOLLOW_SUBPROTOCOL)],
        additional_headers={"x-continuum-user": "alice"},
        open_timeout=10,
    ) as websocket:
        messages, code = await receive_until_closed(websocket)
    assert [error_reason(m) for m in messages] == ["UNAUTHENTICATED"]
    assert code == 4401
    assert live.upstreams.open_follows == 0


@pytest.mark.parametrize(
    ("subprotocols", "headers", "query"),
    [
        ([FOLLOW_SUBPROTOCOL], {}, ""),
        ([FOLLOW_SUBPROTOCOL, bearer_subprotocol("not-a-known-token")], {}, ""),
        ([FOLLOW_SUBPROTOCOL, bearer_subprotocol(ALICE_TOKEN) + "x"], {}, ""),
        ([FOLLOW_SUBPROTOCOL, "continuum.bearer.!!!"], {}, ""),
        ([FOLLOW_SUBPROTOCOL, bearer_subprotocol(ALICE_TOKEN), bearer_subprotocol(BOB_TOKEN)], {}, ""),
        ([FOLLOW_SUBPROTOCOL], {"Authorization": "Bearer not-a-known-token"}, ""),
        ([FOLLOW_SUBPROTOCOL], {}, f"?access_token={ALICE_TOKEN}"),
    ],
    ids=["none", "unknown", "tampered", "malformed", "two-tokens", "unknown-header", "query-parameter"],
)
async def test_a_socket_without_a_known_token_is_refused_with_4401(
    live: LiveGateway,
    transcript_client: Transcript,
    subprotocols: list[str],
    headers: dict[str, str],
    query: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    session_id = await transcript_client.new_session()
    with caplog.at_level(logging.DEBUG, logger="continuum"):
        async with connect(
            live.url(session_id, query),
            subprotocols=[Subprotocol(p) for p in subprotocols],
            additional_headers=headers,
            open_timeout=10,
        ) as websocket:
            # The browser's application subprotocol is still selected, or it would see no error at all.
            assert websocket.subprotocol == FOLLOW_SUBPROTOCOL
            messages, code = await receive_until_closed(websocket)
    (message,) = messages
    assert (message["error"]["code"], message["error"]["status"]) == (401, "UNAUTHENTICATED")
    assert error_reason(message) == "UNAUTHENTICATED"
    assert code == 4401
    assert live.upstreams.open_follows == 0
    assert any(r.message == "request unauthenticated" for r in caplog.records)
    assert ALICE_TOKEN not in caplog.text
    assert bearer_subprotocol(ALICE_TOKEN) not in caplog.text


async def test_non_browser_clients_may_use_the_authorization_header(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    async with connect(
        live.url(session_id), additional_headers={"Authorization": f"Bearer {ALICE_TOKEN}"}, open_timeout=10
    ) as websocket:
        assert websocket.subprotocol is None  # none offered, none selected
        await websocket.send(json.dumps(HELLO))
        assert (await receive_json(websocket))["type"] == "handshake"


async def test_the_subprotocol_credential_is_for_the_follow_route_only(live: LiveGateway) -> None:
    async with connect(
        f"ws://127.0.0.1:{live.port}/v1/sessions",
        subprotocols=[Subprotocol(bearer_subprotocol(ALICE_TOKEN))],
        open_timeout=10,
    ) as websocket:
        messages, code = await receive_until_closed(websocket)
    assert [error_reason(m) for m in messages] == ["UNAUTHENTICATED"]
    assert code == 4401


@pytest.mark.parametrize("abrupt", [False, True], ids=["close-frame", "connection-reset"])
async def test_a_browser_leaving_cancels_the_upstream_stream(
    live: LiveGateway, transcript_client: Transcript, abrupt: bool, caplog: pytest.LogCaptureFixture
) -> None:
    session_id = await transcript_client.new_session()
    await eventually(lambda: live.upstreams.open_follows == 0)
    with caplog.at_level(logging.INFO, logger=FOLLOW_LOGGER):
        async with follower(live, session_id, ALICE_TOKEN) as websocket:
            await receive_frames(websocket, {"snapshotEnd"})
            assert live.upstreams.open_follows == 1
            if abrupt:
                websocket.transport.abort()
        await eventually(lambda: live.upstreams.open_follows == 0)
        await eventually(lambda: any(r.message == "follow closed" for r in caplog.records))
    (closed,) = [r for r in caplog.records if r.message == "follow closed"]
    assert closed.__dict__["outcome"] == "browser_closed"
    assert closed.__dict__["session_id"] == session_id
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The session's publisher is unharmed: the next follower gets a baseline and live frames.
    async with follower(live, session_id, ALICE_TOKEN) as websocket:
        await receive_frames(websocket, {"snapshotEnd"})
        await transcript_client.append(session_id, "still live")
        (batch,) = await receive_frames(websocket, {"batch"})
    assert batch["batch"]["messages"][0]["content"][0]["text"] == "still live"


async def test_stopping_the_gateway_closes_followers_and_their_streams(
    transcript: GrpcService, transcript_client: Transcript, tmp_path: Path
) -> None:
    session_id = await transcript_client.new_session()
    async with live_gateway(tmp_path, transcript.port, shutdown_grace_seconds=5) as gateway:
        upstreams = gateway.upstreams
        async with follower(gateway, session_id, ALICE_TOKEN) as websocket:
            await receive_frames(websocket, {"snapshotEnd"})
            assert upstreams.open_follows == 1
            async with deadline(10, "the gateway to stop with a follower connected"):
                await gateway.stop()
            _, code = await receive_until_closed(websocket)
    assert code == 1012  # service restart
    assert upstreams.open_follows == 0


async def test_the_server_pings_every_socket(
    live: LiveGateway, transcript_client: Transcript, caplog: pytest.LogCaptureFixture
) -> None:
    session_id = await transcript_client.new_session()
    client_logger = logging.getLogger("gateway.tests.websocket")
    with caplog.at_level(logging.DEBUG, logger=client_logger.name):
        async with follower(live, session_id, ALICE_TOKEN, logger=client_logger, ping_interval=None) as websocket:
            await receive_frames(websocket, {"snapshotEnd"})
            await eventually(lambda: sum("< PING" in r.getMessage() for r in caplog.records) >= 2, seconds=5)


@pytest.mark.parametrize(
    "bound",
    [{"follow_buffer_frames": 8}, {"follow_buffer_chars": 64 * 1024}],
    ids=["frames", "characters"],
)
async def test_a_browser_that_stops_reading_gets_an_overflow_resync_and_4429(
    transcript: GrpcService,
    transcript_client: Transcript,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    bound: dict[str, int],
) -> None:
    session_id = await transcript_client.new_session()
    async with live_gateway(
        tmp_path, transcript.port, send_buffer=4096, follow_close_timeout_seconds=30, **bound
    ) as gateway:
        # A browser with a small receive window that stops reading after its first message.
        client = await _small_window_socket(gateway.port)
        with caplog.at_level(logging.INFO, logger=FOLLOW_LOGGER):
            async with follower(gateway, session_id, ALICE_TOKEN, sock=client, max_queue=1) as websocket:
                await eventually(lambda: gateway.upstreams.open_follows == 1)
                published = 0
                while gateway.upstreams.open_follows and published < 400:
                    await transcript_client.append(session_id, f"{published:04d}" + "x" * 16_000)
                    published += 1
                # The gateway gave up on the browser: the upstream stream is gone already.
                assert gateway.upstreams.open_follows == 0, "the gateway never noticed the browser stalled"
                messages, code = await receive_until_closed(websocket, seconds=30)
    assert code == 4429
    assert messages[-1] == {
        "type": "resync",
        "streamGeneration": messages[0]["streamGeneration"],
        "resync": {"reason": "RESYNC_REASON_OVERFLOW", "resumable": True},
    }
    # What did arrive is an unbroken prefix of the stream; the rest was dropped, not reordered.
    assert messages[0]["type"] == "handshake"
    batches = [m["batch"] for m in messages if m["type"] == "batch"]
    assert len(batches) < published
    for previous, batch in itertools.pairwise(batches):
        assert batch["baseSeq"] == previous["seq"]
    (closed,) = [r for r in caplog.records if r.message == "follow closed"]
    assert (closed.__dict__["outcome"], closed.__dict__["close_code"]) == ("overflow", 4429)


# Shared upstream streams (`continuum_gateway.follow_hub`).


def _hub(gateway: LiveGateway, session_id: str, user: str = "alice") -> Hub | None:
    return gateway.hubs.find((user, session_id, ("transcript-v2",)))


def _batch_texts(frames: list[dict[str, Any]]) -> list[str]:
    return [m["content"][0]["text"] for f in frames if f["type"] == "batch" for m in f["batch"]["messages"]]


async def _publish_attempt(transcript_client: Transcript, session_id: str, key: str, chunks: list[str]) -> None:
    stub, metadata = transcript_client.stub, transcript_client.metadata("alice")
    attempt = follow_pb2.AttemptRef(message_key=key, attempt=1)
    await stub.OpenAttempt(
        transcript_service_pb2.OpenAttemptRequest(session_id=session_id, attempt=attempt), metadata=metadata
    )
    await stub.AppendChunks(
        transcript_service_pb2.AppendChunksRequest(
            session_id=session_id, attempt=attempt, first_chunk_index=0, chunks=chunks
        ),
        metadata=metadata,
    )
    answer = transcript_testing.assistant("".join(chunks))
    await stub.CommitAttempt(
        transcript_service_pb2.CommitAttemptRequest(session_id=session_id, attempt=attempt, message=answer),
        metadata=metadata,
    )


def _assert_unbroken(frames: list[dict[str, Any]]) -> None:
    """From the snapshot on, every batch continues the sequence exactly (no gap, no repeat)."""
    kinds = [f["type"] for f in frames]
    seq = int(frames[kinds.index("snapshotEnd")]["snapshotEnd"]["seq"])
    for frame in frames[kinds.index("snapshotEnd") + 1 :]:
        if frame["type"] == "batch":
            assert int(frame["batch"]["baseSeq"]) == seq, frames
            seq = int(frame["batch"]["seq"])


async def test_browsers_of_one_user_share_one_upstream_stream_and_each_gets_its_own_baseline(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    await transcript_client.append(session_id, "one", "two")
    await eventually(lambda: live.upstreams.open_follows == 0)
    direct = transcript_client.follow(session_id)
    try:
        async with follower(live, session_id, ALICE_TOKEN) as first:
            first_frames = await receive_frames(first, {"snapshotEnd"})
            await transcript_client.append(session_id, "three")
            first_frames += await receive_frames(first, {"batch"})
            # A later browser: its own baseline (from its own upstream call) has "three" in it.
            async with follower(live, session_id, ALICE_TOKEN) as second:
                second_frames = await receive_frames(second, {"snapshotEnd"})
                assert second_frames[0]["handshake"]["mode"] == "FOLLOW_MODE_BASELINE"
                records = second_frames[2]["snapshotRecords"]["messages"]
                assert [m["content"][0]["text"] for m in records] == ["one", "two", "three"]
                assert live.upstreams.open_follows == 2  # the hub's, and the second browser's own
                await read_direct_until(direct, "snapshot_end")
                # Its first live frame is a switch point: from there on, one upstream stream for both.
                await transcript_client.append(session_id, "four")
                await eventually(lambda: live.upstreams.open_follows == 1)
                hub = _hub(live, session_id)
                assert hub is not None
                assert len(hub.subscribers) == 2
                await _publish_attempt(transcript_client, session_id, "answer", ["Hel", "lo"])
                await transcript_client.append(session_id, "five")
                relayed: list[dict[str, Any]] = []
                while not relayed or "five" not in _batch_texts(relayed[-1:]):
                    relayed += [_as_relayed(frame) for frame in await read_direct_until(direct, "batch")]
                # From "four" on (the direct stream's own snapshot may be older).
                expected = relayed[[_batch_texts([f]) for f in relayed].index(["four"]) :]
                first_live = await _frames_until_text(first, "five")
                second_live = await _frames_until_text(second, "five")
    finally:
        direct.cancel()
    # Both got exactly what a direct Follow got, in order, once.
    assert first_live == expected
    assert second_live == expected
    assert [f["type"] for f in expected] == ["batch", "attemptOpened", "chunk", "chunk", "batch", "settlement", "batch"]
    _assert_unbroken(first_frames + first_live)
    _assert_unbroken(second_frames + second_live)
    await eventually(lambda: live.upstreams.open_follows == 0)
    assert _hub(live, session_id) is None


async def _frames_until_text(websocket: Any, text: str) -> list[dict[str, Any]]:
    """Messages (heartbeats left out) up to the batch committing `text`."""
    frames: list[dict[str, Any]] = []
    while not frames or text not in _batch_texts(frames[-1:]):
        frames += await receive_frames(websocket, {"batch"})
    return frames


async def _two_sharing(
    gateway: LiveGateway, transcript_client: Transcript, session_id: str, first: Any, second: Any, text: str
) -> None:
    """Both browsers past their baselines, switched onto one hub by the live batch `text`."""
    await receive_frames(first, {"snapshotEnd"})
    await receive_frames(second, {"snapshotEnd"})
    await transcript_client.append(session_id, text)
    for websocket in (first, second):
        assert _batch_texts(await receive_frames(websocket, {"batch"})) == [text]
    await eventually(lambda: gateway.upstreams.open_follows == 1)
    hub = _hub(gateway, session_id)
    assert hub is not None
    assert len(hub.subscribers) == 2


async def test_a_browser_leaving_a_shared_stream_leaves_the_others_live_and_the_last_ends_it(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    await eventually(lambda: live.upstreams.open_follows == 0)
    async with follower(live, session_id, ALICE_TOKEN) as staying:
        async with follower(live, session_id, ALICE_TOKEN) as leaving:
            await _two_sharing(live, transcript_client, session_id, staying, leaving, "shared")
        # The first browser (whose hello opened the shared stream) is the one still here: no matter.
        await eventually(lambda: len(hub.subscribers) == 1 if (hub := _hub(live, session_id)) else False)
        assert live.upstreams.open_follows == 1
        await transcript_client.append(session_id, "after")
        assert _batch_texts(await receive_frames(staying, {"batch"})) == ["after"]
    await eventually(lambda: live.upstreams.open_follows == 0)
    assert _hub(live, session_id) is None


async def test_the_browser_that_opened_the_shared_stream_may_leave_first(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    await eventually(lambda: live.upstreams.open_follows == 0)
    async with (
        follower(live, session_id, ALICE_TOKEN) as opener,
        follower(live, session_id, ALICE_TOKEN) as staying,
    ):
        await _two_sharing(live, transcript_client, session_id, opener, staying, "shared")
        await opener.close()
        await eventually(lambda: len(hub.subscribers) == 1 if (hub := _hub(live, session_id)) else False)
        await transcript_client.append(session_id, "after")
        assert _batch_texts(await receive_frames(staying, {"batch"})) == ["after"]
        assert live.upstreams.open_follows == 1
    await eventually(lambda: live.upstreams.open_follows == 0)


async def test_a_rewrite_reaches_every_browser_on_a_shared_stream(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    (message_id,) = await transcript_client.append(session_id, "original")
    async with follower(live, session_id, ALICE_TOKEN) as first, follower(live, session_id, ALICE_TOKEN) as second:
        await _two_sharing(live, transcript_client, session_id, first, second, "shared")
        edit = transcript_service_pb2.EditUserMessageRequest(
            session_id=session_id, message_id=message_id, content=[resources_pb2.ContentPart(text="edited")]
        )
        await transcript_client.stub.EditUserMessage(edit, metadata=transcript_client.metadata("alice"))
        for websocket in (first, second):
            rest, code = await receive_until_closed(websocket)
            rest = [m for m in rest if m["type"] != "heartbeat"]
            assert [m["type"] for m in rest] == ["resync"]
            assert rest[0]["resync"] == {"reason": "RESYNC_REASON_REWRITE", "resumable": False}
            assert code == 1000
    await eventually(lambda: live.upstreams.open_follows == 0)
    assert _hub(live, session_id) is None


async def test_another_users_browser_is_refused_while_the_owner_follows(
    live: LiveGateway, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session("alice")
    async with follower(live, session_id, ALICE_TOKEN) as owner:
        await receive_frames(owner, {"snapshotEnd"})
        async with follower(live, session_id, BOB_TOKEN) as intruder:
            messages, code = await receive_until_closed(intruder)
        assert [error_reason(m) for m in messages] == ["SESSION_PERMISSION_DENIED"]
        assert code == 4403
        await transcript_client.append(session_id, "private")
        assert _batch_texts(await receive_frames(owner, {"batch"})) == ["private"]
    assert _hub(live, session_id, "bob") is None


async def test_a_stalled_browser_on_a_shared_stream_overflows_alone(
    transcript: GrpcService, transcript_client: Transcript, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    session_id = await transcript_client.new_session()
    async with live_gateway(
        tmp_path, transcript.port, send_buffer=4096, follow_close_timeout_seconds=30, follow_buffer_frames=8
    ) as gateway:
        client = await _small_window_socket(gateway.port)
        with caplog.at_level(logging.INFO, logger=FOLLOW_LOGGER):
            async with (
                follower(gateway, session_id, ALICE_TOKEN) as reader,
                follower(gateway, session_id, ALICE_TOKEN, sock=client, max_queue=1) as stalled,
            ):
                await _two_sharing(gateway, transcript_client, session_id, reader, stalled, "shared")
                hub = _hub(gateway, session_id)
                assert hub is not None
                published: list[str] = []
                received: list[str] = []
                while len(hub.subscribers) == 2 and len(published) < 400:
                    published.append(f"{len(published):04d}" + "x" * 16_000)
                    await transcript_client.append(session_id, published[-1])
                    received += _batch_texts(await receive_frames(reader, {"batch"}))
                assert len(hub.subscribers) == 1, "the gateway never noticed the browser stalled"
                # The reading browser is unharmed: every batch, in order, on the same stream.
                await transcript_client.append(session_id, "still live")
                while "still live" not in received:
                    received += _batch_texts(await receive_frames(reader, {"batch"}))
                assert received == [*published, "still live"]
                assert gateway.upstreams.open_follows == 1
                messages, code = await receive_until_closed(stalled, seconds=30)
    assert code == 4429
    assert messages[-1]["resync"] == {"reason": "RESYNC_REASON_OVERFLOW", "resumable": True}
    # (The reading browser's own line, "browser_closed", may come after the gateway stopped.)
    (closed,) = [
        r for r in caplog.records if r.message == "follow closed" and r.__dict__["outcome"] != "browser_closed"
    ]
    assert (closed.__dict__["outcome"], closed.__dict__["close_code"], closed.__dict__["shared"]) == (
        "overflow",
        4429,
        True,
    )
