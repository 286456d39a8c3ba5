"""Nothing a browser reads grows with the history: stubs in WebSocket frames and pages, and one
message read whole over HTTP as a stream of bounded pieces."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from gateway_testing import ALICE_TOKEN, BOB_TOKEN, assert_error, bearer
from gateway_ws_testing import Transcript, follower, live_gateway, receive_frames

from continuum_runtime.server import GrpcService

ALICE = bearer(ALICE_TOKEN)
MIB = 1024 * 1024


@pytest.fixture(scope="module")
async def gateway(
    transcript: GrpcService, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway served by uvicorn on a real socket: responses stream as they would to a browser."""
    async with (
        live_gateway(tmp_path_factory.mktemp("http"), transcript.port) as served,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{served.port}", timeout=60) as client,
    ):
        yield client


async def test_a_large_message_is_a_stub_in_pages_and_streams_whole_by_id(
    gateway: httpx.AsyncClient, transcript_client: Transcript
) -> None:
    session_id = await transcript_client.new_session()
    body = 'ünïcode and "quotes"\n' + "z" * (15 * MIB)
    small, big = await transcript_client.append(session_id, "small", body)

    page = await gateway.get(f"/v1/sessions/{session_id}/messages:page", headers=ALICE)
    assert page.status_code == 200 and len(page.content) < 64 * 1024
    messages = page.json()["messages"]
    assert messages[0]["content"] == [{"text": "small"}] and messages[0]["bodyDeferred"] is False
    stub = messages[1]
    assert stub["bodyDeferred"] is True and stub["content"] == [] and int(stub["bodyBytes"]) > 15 * MIB
    assert stub["preview"].startswith('ünïcode and "quotes" zzz')

    chunks = 0
    received = bytearray()
    async with gateway.stream("GET", f"/v1/sessions/{session_id}/messages/{big}", headers=ALICE) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "application/json"
        async for piece in response.aiter_raw():
            chunks += 1
            received += piece
    assert chunks > 10, "the body arrived as it was read, not in one piece"
    whole = json.loads(received)["message"]
    assert whole["messageId"] == str(big) and whole["content"] == [{"text": body}]
    assert whole["bodyDeferred"] is False and whole["toolCalls"] == []
    # A small message reads the same way, and refusals are ordinary error responses.
    assert (await gateway.get(f"/v1/sessions/{session_id}/messages/{small}", headers=ALICE)).json()["message"][
        "content"
    ] == [{"text": "small"}]
    missing = await gateway.get(f"/v1/sessions/{session_id}/messages/999999999", headers=ALICE)
    assert_error(missing, 404, "NOT_FOUND", "MESSAGE_NOT_FOUND")
    foreign = await gateway.get(f"/v1/sessions/{session_id}/messages/{big}", headers=bearer(BOB_TOKEN))
    assert_error(foreign, 403, "PERMISSION_DENIED", "SESSION_PERMISSION_DENIED")


async def test_websocket_frames_stay_small_whatever_the_messages_weigh(
    transcript: GrpcService, transcript_client: Transcript, tmp_path_factory: pytest.TempPathFactory
) -> None:
    session_id = await transcript_client.new_session()
    await transcript_client.append(session_id, "a" * (15 * MIB), "b" * (15 * MIB), "c" * (15 * MIB))
    async with (
        live_gateway(tmp_path_factory.mktemp("bounded"), transcript.port) as gateway,
        follower(gateway, session_id, ALICE_TOKEN) as websocket,
    ):
        snapshot = await receive_frames(websocket, {"snapshotEnd"})
        await transcript_client.append(session_id, "d" * (15 * MIB), "e" * (15 * MIB), "small")
        live = await receive_frames(websocket, {"batch"})
    frames = snapshot + live
    assert max(len(json.dumps(frame)) for frame in frames) < 64 * 1024
    records = next(frame for frame in frames if frame["type"] == "snapshotRecords")["snapshotRecords"]
    assert [m["bodyDeferred"] for m in records["messages"]] == [True, True, True]
    batch = live[-1]["batch"]
    assert [m["bodyDeferred"] for m in batch["messages"]] == [True, True, False]
    assert [m["preview"][:3] for m in batch["messages"]] == ["ddd", "eee", ""]
