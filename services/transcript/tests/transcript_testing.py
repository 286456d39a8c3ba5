"""Builders and a client shared by the transcript tests (importable as `transcript_testing`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from deadline_testing import deadline
from process_testing import serve_module
from pydantic import SecretStr

from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.clock import Clock
from continuum_runtime.errors import ErrorDetails, error_details
from continuum_runtime.server import GrpcService
from continuum_transcript.server import start
from continuum_transcript.settings import TranscriptSettings

SERVICE_TOKEN = "test-service-token"


@dataclass
class TranscriptClient:
    """A stub plus the metadata each acting user presents."""

    stub: api_grpc.TranscriptServiceStub
    channel: grpc.aio.Channel
    service: GrpcService
    settings: TranscriptSettings

    def as_user(self, user: str) -> tuple[tuple[str, str], ...]:
        """Call metadata acting for `user`."""
        return call_metadata(SERVICE_TOKEN, user)

    @property
    def system(self) -> tuple[tuple[str, str], ...]:
        """Call metadata of a backend acting for no user."""
        return call_metadata(SERVICE_TOKEN)


def transcript_settings(tmp_path: Path, database_url: str, **overrides: object) -> TranscriptSettings:
    """Settings of a test server: port 0, a temporary data dir, the given database."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "data",
        "database_url": database_url,
        "port": 0,
        "service_token": SecretStr(SERVICE_TOKEN),
        "events_poll_seconds": 0.2,
    }
    values.update(overrides)
    return TranscriptSettings(**values)  # type: ignore[arg-type]


def user(text: str) -> pb.NewMessage:
    """A USER message with one text part."""
    return pb.NewMessage(role=pb.MESSAGE_ROLE_USER, content=[pb.ContentPart(text=text)])


def assistant(text: str, *tool_call_ids: str, arguments: str = "{}") -> pb.NewMessage:
    """An ASSISTANT message, optionally issuing tool calls (each with `arguments`)."""
    calls = [pb.ToolCall(tool_call_id=c, name="shell", arguments=arguments) for c in tool_call_ids]
    return pb.NewMessage(role=pb.MESSAGE_ROLE_ASSISTANT, content=[pb.ContentPart(text=text)], tool_calls=calls)


def tool(tool_call_id: str, text: str) -> pb.NewMessage:
    """A TOOL result."""
    return pb.NewMessage(role=pb.MESSAGE_ROLE_TOOL, tool_call_id=tool_call_id, content=[pb.ContentPart(text=text)])


async def create_session(client: TranscriptClient, session_id: str = "s", owner: str = "alice") -> str:
    """Create a session of `owner` with a chosen id; the id."""
    await client.stub.CreateSession(api.CreateSessionRequest(session_id=session_id), metadata=client.as_user(owner))
    return session_id


async def append(
    client: TranscriptClient, session_id: str, *messages: pb.NewMessage, owner: str = "alice"
) -> list[int]:
    """Append one batch as `owner`; the new messages' ids."""
    response = await client.stub.AppendMessages(
        api.AppendMessagesRequest(session_id=session_id, messages=list(messages)), metadata=client.as_user(owner)
    )
    assert response.create_time.ToMilliseconds() > 0
    return list(response.message_ids)


async def all_messages(
    stub: api_grpc.TranscriptServiceStub,
    metadata: tuple[tuple[str, str], ...],
    session_id: str,
    *,
    after: int = 0,
    page_size: int = 0,
) -> list[pb.Message]:
    """Every live message after `after`, read page by page with ListMessagesAfter."""
    found: list[pb.Message] = []
    token = ""
    while True:
        page = await stub.ListMessagesAfter(
            api.ListMessagesAfterRequest(
                session_id=session_id, after_message_id=after, page_size=page_size, page_token=token
            ),
            metadata=metadata,
        )
        found.extend(page.messages)
        token = page.next_page_token
        if not token:
            return found


async def refused(call: Awaitable[object], code: grpc.StatusCode, reason: str) -> ErrorDetails:
    """Await `call`, expect it to fail with `code` and ErrorInfo `reason`; return the details."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    details = error_details(caught.value)
    assert (details.code, details.reason) == (code, reason), details
    return details


class Follower:
    """A raw Follow stream read frame by frame (heartbeats skipped unless asked for)."""

    def __init__(self, client: TranscriptClient, session_id: str, *, resume: tuple[int, int] | None = None) -> None:
        request = api.FollowRequest(session_id=session_id, capabilities=["transcript-v2"])
        if resume is not None:
            request.resume.CopyFrom(fpb.FollowCursor(stream_generation=resume[0], seq=resume[1]))
        self.call = client.stub.Follow(request, metadata=client.as_user("alice"))
        self.frames: list[Any] = []

    async def next(self, *, heartbeats: bool = False, seconds: float = 10.0) -> Any:
        """The next frame, within `seconds` (heartbeats arriving meanwhile do not extend it)."""
        async with deadline(seconds, "the next Follow frame (heartbeats only arrived)"):
            return await self._read(heartbeats)

    async def until(self, kind: str, *, seconds: float = 10.0) -> list[Any]:
        """Frames up to and including the first of `kind`, within `seconds` in all: a dropped frame or a
        missing resync fails here, naming what did arrive."""
        seen: list[Any] = []
        async with deadline(seconds, lambda: f"a {kind} frame; the Follow stream sent {kinds(seen)}"):
            while True:
                frame = await self._read(heartbeats=False)
                seen.append(frame)
                if frame.WhichOneof("frame") == kind:
                    return seen

    async def _read(self, heartbeats: bool) -> Any:
        while True:
            frame = await self.call.read()
            assert frame is not grpc.aio.EOF, f"the stream ended after {kinds(self.frames)}"
            if heartbeats or frame.WhichOneof("frame") != "heartbeat":
                self.frames.append(frame)
                return frame

    def close(self) -> None:
        """Disconnect (never a cancel of anything the runtime does)."""
        self.call.cancel()


def kinds(frames: list[Any]) -> list[str]:
    """The oneof names of `frames`."""
    return [frame.WhichOneof("frame") for frame in frames]


@asynccontextmanager
async def running_transcript(
    tmp_path: Path, database_url: str, clock: Clock | None = None, **overrides: object
) -> AsyncIterator[TranscriptClient]:
    """A started transcript service (with `overrides` on its settings, on `clock` when given) and a
    connected client."""
    settings = transcript_settings(tmp_path, database_url, **overrides)
    service = await start(settings, clock)
    channel = open_channel(f"127.0.0.1:{service.port}")
    try:
        yield TranscriptClient(api_grpc.TranscriptServiceStub(channel), channel, service, settings)
    finally:
        await channel.close()
        await service.stop(grace=0)


class TcpProxy:
    """A loopback TCP proxy that can cut a service off (e.g. the database) and bring it back."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self.up = True
        self.port = 0

    async def start(self) -> None:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._links.update({writer, upstream_writer})
        await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._links.discard(writer)
            writer.close()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until `restore()`."""
        self.up = False
        for writer in list(self._links):
            writer.transport.abort()
        self._links.clear()

    def restore(self) -> None:
        """Accept connections again."""
        self.up = True

    async def close(self) -> None:
        """Stop listening and drop everything."""
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def serve_in_subprocess(data_dir: Path, database_url: str) -> tuple[asyncio.subprocess.Process, int]:
    """`python -m continuum_transcript serve` as its own process (so it can be killed); its port."""
    env = {
        "TRANSCRIPT_DATA_DIR": str(data_dir),
        "TRANSCRIPT_DATABASE_URL": database_url,
        "TRANSCRIPT_PORT": "0",
        "TRANSCRIPT_SERVICE_TOKEN": SERVICE_TOKEN,
    }
    return await serve_module("continuum_transcript", "transcript", data_dir, env)
