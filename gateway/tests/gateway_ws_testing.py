"""Helpers for the gateway's WebSocket tests: a real uvicorn server, a WebSocket client, transcript calls."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import transcript_testing
from deadline_testing import deadline
from gateway_testing import SERVICE_TOKEN, gateway_settings
from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from continuum.transcript.v1 import transcript_service_pb2, transcript_service_pb2_grpc
from continuum_gateway.__main__ import GatewayServer, uvicorn_config
from continuum_gateway.app import create_app
from continuum_gateway.auth import bearer_subprotocol
from continuum_gateway.follow import FOLLOW_SUBPROTOCOL
from continuum_gateway.follow_hub import STATE_KEY as HUBS_KEY
from continuum_gateway.follow_hub import Hubs
from continuum_gateway.upstream import STATE_KEY, Upstreams
from continuum_runtime.auth import call_metadata


@dataclass
class LiveGateway:
    """A gateway served by uvicorn on a real socket."""

    port: int
    lifespan_state: Callable[[], dict[str, Any]]
    stop: Callable[[], Awaitable[None]]

    @property
    def upstreams(self) -> Upstreams:
        """The gateway's upstreams (to watch its open Follow streams)."""
        upstreams = self.lifespan_state()[STATE_KEY]
        assert isinstance(upstreams, Upstreams)
        return upstreams

    @property
    def hubs(self) -> Hubs:
        """The gateway's shared Follow streams."""
        hubs = self.lifespan_state()[HUBS_KEY]
        assert isinstance(hubs, Hubs)
        return hubs

    def url(self, session_id: str, query: str = "") -> str:
        """The Follow URL of a session."""
        return f"ws://127.0.0.1:{self.port}/v1/sessions/{session_id}/follow{query}"


@asynccontextmanager
async def live_gateway(
    data_dir: Path, transcript_port: int, *, send_buffer: int | None = None, **overrides: object
) -> AsyncIterator[LiveGateway]:
    """Serve a gateway for the transcript at `transcript_port` with uvicorn, as `__main__` does.

    `send_buffer` shrinks the kernel send buffer of every accepted connection, so a client that
    stops reading blocks the gateway's sends after a few kilobytes instead of a few megabytes.
    """
    settings = gateway_settings(data_dir, f"127.0.0.1:{transcript_port}", **overrides)
    app = create_app(settings)
    # uvicorn hands the app one lifespan state dict, which Starlette fills in place at start-up.
    state: dict[str, Any] = {}

    async def capture_state(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            nonlocal state
            state = scope["state"]
        await app(scope, receive, send)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:
        # Inherited by accepted sockets on Linux; fixing the size also turns off autotuning.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    listener.bind(("127.0.0.1", 0))
    server = GatewayServer(uvicorn_config(settings, capture_state), data_dir)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        async with deadline(30, "the gateway to start"):
            # Polling: uvicorn offers no event for having started.
            while not server.started:
                assert not task.done(), "the gateway did not start"
                await asyncio.sleep(0.01)
        assert server.port is not None

        async def stop() -> None:
            server.should_exit = True
            await task

        yield LiveGateway(server.port, lambda: state, stop)
    finally:
        await stop()
        listener.close()


HELLO: dict[str, Any] = {"type": "hello", "capabilities": ["transcript-v2"]}


@asynccontextmanager
async def follower(
    gateway: LiveGateway,
    session_id: str,
    token: str,
    hello: dict[str, Any] | None = HELLO,
    **options: Any,
) -> AsyncIterator[ClientConnection]:
    """A browser-like Follow socket (credential as a subprotocol), its hello already sent."""
    subprotocols = [Subprotocol(FOLLOW_SUBPROTOCOL), Subprotocol(bearer_subprotocol(token))]
    options.setdefault("compression", None)
    async with connect(gateway.url(session_id), subprotocols=subprotocols, open_timeout=10, **options) as websocket:
        if hello is not None:
            await websocket.send(json.dumps(hello))
        yield websocket


async def receive_json(websocket: ClientConnection, seconds: float = 10) -> dict[str, Any]:
    """The next message, which must be a JSON text object."""
    async with deadline(seconds, "a message from the gateway"):
        return await _receive(websocket)


async def _receive(websocket: ClientConnection) -> dict[str, Any]:
    text = await websocket.recv()
    assert isinstance(text, str), text
    message = json.loads(text)
    assert isinstance(message, dict), message
    return message


def _types(messages: list[dict[str, Any]]) -> list[str]:
    return [str(message.get("type")) for message in messages]


async def receive_frames(websocket: ClientConnection, kinds: set[str], seconds: float = 10) -> list[dict[str, Any]]:
    """Messages up to and including the first whose type is in `kinds`, heartbeats left out, within
    `seconds` in all: a dropped frame or a missing resync fails here, naming what did arrive."""
    frames: list[dict[str, Any]] = []
    async with deadline(seconds, lambda: f"a message of type {sorted(kinds)}; the gateway sent {_types(frames)}"):
        while True:
            message = await _receive(websocket)
            if message["type"] == "heartbeat":
                continue
            frames.append(message)
            if message["type"] in kinds:
                return frames


async def receive_until_closed(websocket: ClientConnection, seconds: float = 10) -> tuple[list[dict[str, Any]], int]:
    """Every message left (heartbeats included) and the close code the server sent."""
    messages: list[dict[str, Any]] = []
    async with deadline(seconds, lambda: f"the gateway to close the socket; it sent {_types(messages)}"):
        try:
            while True:
                text = await websocket.recv()
                assert isinstance(text, str), text
                messages.append(json.loads(text))
        except ConnectionClosed:
            pass
    assert websocket.close_code is not None
    return messages, websocket.close_code


async def read_direct_until(call: Any, kind: str, seconds: float = 10) -> list[transcript_service_pb2.FollowResponse]:
    """Frames of a direct Follow call up to and including the first of `kind`, heartbeats left out,
    within `seconds` in all."""
    frames: list[transcript_service_pb2.FollowResponse] = []

    def seen() -> list[str | None]:
        return [frame.WhichOneof("frame") for frame in frames]

    async with deadline(seconds, lambda: f"a {kind} frame on the direct Follow stream; it sent {seen()}"):
        while True:
            frame = await call.read()
            assert frame is not grpc.aio.EOF, f"the direct Follow stream ended after {seen()}"
            if frame.WhichOneof("frame") == "heartbeat":
                continue
            frames.append(frame)
            if frame.WhichOneof("frame") == kind:
                return frames


def error_reason(message: dict[str, Any]) -> str:
    """The ErrorInfo reason of an error message."""
    assert message["type"] == "error", message
    (info,) = [d for d in message["error"]["details"] if d["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"]
    return str(info["reason"])


class Transcript:
    """Direct calls to the transcript service, as the agent runtime (the publisher) makes them."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = transcript_service_pb2_grpc.TranscriptServiceStub(self.channel)

    @staticmethod
    def metadata(user: str) -> tuple[tuple[str, str], ...]:
        """Call metadata acting as `user`."""
        return call_metadata(SERVICE_TOKEN, user)

    async def new_session(self, user: str = "alice") -> str:
        """A fresh session of `user`."""
        session_id = f"f-{uuid.uuid4().hex[:12]}"
        request = transcript_service_pb2.CreateSessionRequest(session_id=session_id)
        await self.stub.CreateSession(request, metadata=self.metadata(user))
        return session_id

    async def append(self, session_id: str, *texts: str, user: str = "alice") -> list[int]:
        """Append USER messages; their ids."""
        messages = [transcript_testing.user(t) for t in texts]
        request = transcript_service_pb2.AppendMessagesRequest(session_id=session_id, messages=messages)
        response = await self.stub.AppendMessages(request, metadata=self.metadata(user))
        return list(response.message_ids)

    def follow(self, session_id: str, user: str = "alice") -> Any:
        """A direct Follow stream (a grpc.aio call), to compare the gateway's relay with."""
        request = transcript_service_pb2.FollowRequest(session_id=session_id, capabilities=["transcript-v2"])
        return self.stub.Follow(request, metadata=self.metadata(user))

    async def close(self) -> None:
        """Close the channel."""
        await self.channel.close()
