"""A real transcript server for the Follow client tests, and helpers to publish and compare
(importable as `follow_testing`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import transcript_testing
from deadline_testing import within
from transcript_testing import SERVICE_TOKEN, transcript_settings
from transcript_testing import tool as tool  # re-exported for the client tests
from transcript_testing import user as user

from continuum.compaction.events.v1 import events_pb2
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_follow import Backoff, FollowClient, RecordStore
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.server import GrpcService
from continuum_transcript.server import start
from continuum_transcript.settings import TranscriptSettings

TOKEN = SERVICE_TOKEN
USER = "alice"
FAST = Backoff(initial_seconds=0.02, max_seconds=0.2)


def sqlite_url(tmp_path: Path) -> str:
    """An embedded database in the test's directory."""
    return f"sqlite+aiosqlite:///{tmp_path / 't.db'}"


def settings(tmp_path: Path, database_url: str, **overrides: object) -> TranscriptSettings:
    """A test server: port 0 unless given, quick heartbeats."""
    return transcript_settings(tmp_path, database_url, **{"follow_heartbeat_seconds": 0.2, **overrides})


@dataclass
class Live:
    """A running server and a stub acting for USER."""

    service: GrpcService
    stub: api_grpc.TranscriptServiceStub
    metadata: tuple[tuple[str, str], ...] = call_metadata(TOKEN, USER)

    @property
    def address(self) -> str:
        """Where the server listens."""
        return f"127.0.0.1:{self.service.port}"

    async def session(self) -> str:
        """A new session of USER."""
        response = await self.stub.CreateSession(api.CreateSessionRequest(title="t"), metadata=self.metadata)
        session_id: str = response.session.session_id
        return session_id

    def follower(self, session_id: str, *, backoff: Backoff = FAST, **options: object) -> FollowClient:
        """A Follow client of `session_id` (not started)."""
        return FollowClient(self.stub, session_id, self.metadata, backoff=backoff, **options)  # type: ignore[arg-type]

    async def append(self, session_id: str, *messages: pb.NewMessage) -> list[int]:
        """Append committed messages; their ids."""
        request = api.AppendMessagesRequest(session_id=session_id, messages=messages)
        response = await self.stub.AppendMessages(request, metadata=self.metadata)
        return list(response.message_ids)

    async def publish(self, session_id: str, *operations: api.BatchOperation, terminal: bool = False) -> int:
        """Publish one business batch; its seq."""
        request = api.PublishBatchRequest(session_id=session_id, operations=operations, terminal=terminal)
        response = await self.stub.PublishBatch(request, metadata=self.metadata)
        seq: int = response.seq
        return seq

    async def open(self, session_id: str, key: str, attempt: int = 1) -> None:
        """Open (or retry) a sampling attempt."""
        ref = fpb.AttemptRef(message_key=key, attempt=attempt)
        await self.stub.OpenAttempt(api.OpenAttemptRequest(session_id=session_id, attempt=ref), metadata=self.metadata)

    async def chunks(self, session_id: str, key: str, attempt: int, first: int, *texts: str) -> None:
        """Stream chunks of an open attempt."""
        request = api.AppendChunksRequest(
            session_id=session_id,
            attempt=fpb.AttemptRef(message_key=key, attempt=attempt),
            first_chunk_index=first,
            chunks=texts,
        )
        await self.stub.AppendChunks(request, metadata=self.metadata)

    async def commit(self, session_id: str, key: str, attempt: int, message: pb.NewMessage) -> int:
        """Commit an attempt's message (durable when this returns); its id."""
        request = api.CommitAttemptRequest(
            session_id=session_id,
            attempt=fpb.AttemptRef(message_key=key, attempt=attempt),
            message=message,
            wait_durable=True,
        )
        response = await self.stub.CommitAttempt(request, metadata=self.metadata)
        message_id: int = response.message_id
        return message_id

    async def cancel(self, session_id: str, key: str, attempt: int) -> int:
        """Cancel an attempt (durable when this returns); the interrupted message's id."""
        request = api.CancelAttemptRequest(
            session_id=session_id, attempt=fpb.AttemptRef(message_key=key, attempt=attempt), wait_durable=True
        )
        response = await self.stub.CancelAttempt(request, metadata=self.metadata)
        message_id: int = response.message_id
        return message_id

    async def server_messages(self, session_id: str) -> list[pb.Message]:
        """The live history as the server stores it."""
        request = api.ListMessagesAfterRequest(session_id=session_id, page_size=1000)
        response = await self.stub.ListMessagesAfter(request, metadata=self.metadata)
        return list(response.messages)


@contextlib.asynccontextmanager
async def running(
    tmp_path: Path,
    database_url: str | None = None,
    channel_options: Sequence[tuple[str, int]] = (),
    **overrides: object,
) -> AsyncIterator[Live]:
    """Start a transcript server (SQLite unless `database_url`), yield it with a stub, stop it."""
    service = await start(settings(tmp_path, database_url or sqlite_url(tmp_path), **overrides))
    address = f"127.0.0.1:{service.port}"
    channel = grpc.aio.insecure_channel(address, options=list(channel_options)) if channel_options else None
    channel = channel or open_channel(address)
    try:
        yield Live(service, api_grpc.TranscriptServiceStub(channel))
    finally:
        await channel.close()
        await service.stop(grace=0)


@contextlib.asynccontextmanager
async def following(client: FollowClient) -> AsyncIterator[asyncio.Task[None]]:
    """Run `client` in a task for the block; stop it after (and surface its failure)."""
    task = asyncio.create_task(client.run())
    try:
        yield task
    finally:
        client.stop()
        await within(task, 10, "the Follow client to stop")


def text(message: pb.Message) -> str:
    """A message's text parts."""
    return "".join(part.text for part in message.content)


def texts(store: RecordStore) -> list[str]:
    """The store's committed texts, in order."""
    return [text(m) for m in store.ordered_messages()]


def same_as_server(store: RecordStore, server: list[pb.Message]) -> bool:
    """The store holds exactly the server's latest messages (the snapshot page plus what followed)."""
    mine = store.ordered_messages()
    if not server:
        return not mine
    return bool(mine) and mine == server[-len(mine) :]


def assistant(value: str, *tool_call_ids: str) -> pb.NewMessage:
    """An ASSISTANT message, optionally calling tools (with arguments the renderer shows)."""
    return transcript_testing.assistant(value, *tool_call_ids, arguments='{"cmd": "ls"}')


def op_state(state: fpb.RunState.ValueType, run_id: str = "") -> api.BatchOperation:
    """A batch operation setting the runtime state."""
    return api.BatchOperation(runtime_state=fpb.RuntimeState(state=state, run_id=run_id))


def op_prompt(prompt_id: str) -> api.BatchOperation:
    """A batch operation adding an approval prompt."""
    return api.BatchOperation(prompt_upsert=fpb.PendingPrompt(prompt_id=prompt_id, kind=fpb.PROMPT_KIND_APPROVAL))


def op_resolve(prompt_id: str) -> api.BatchOperation:
    """A batch operation resolving a prompt."""
    return api.BatchOperation(prompt_resolved=prompt_id)


def op_event(tag: int) -> api.BatchOperation:
    """A batch operation carrying a runtime event."""
    marker = events_pb2.CompactionMarker(event_id=tag)
    return api.BatchOperation(event=fpb.RuntimeEvent(compaction_marker=marker))


def op_message(message: pb.NewMessage) -> api.BatchOperation:
    """A batch operation committing a message."""
    return api.BatchOperation(message=message)
