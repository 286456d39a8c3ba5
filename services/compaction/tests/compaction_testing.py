"""A real transcript and a real compaction service on port 0, and a scripted model provider.

The provider is an in-memory fake with the provider contract: it records every call, can fail chosen
calls, and can hold calls at a gate so tests can race two compactions or write messages meanwhile.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pydantic import SecretStr
from sqlalchemy import text
from transcript_testing import SERVICE_TOKEN, Follower, TranscriptClient, running_transcript

from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.compaction.v1 import compaction_service_pb2_grpc as api_grpc
from continuum.transcript.v1 import follow_pb2 as fpb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_compaction.server import start
from continuum_compaction.settings import CompactionSettings
from continuum_compaction.summarizer import CLOSING
from continuum_runtime.auth import call_metadata
from continuum_runtime.channels import open_channel
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.provider import ChatMessage, Completion, ProviderInputTooLarge, ProviderUnavailable, Usage
from continuum_runtime.server import GrpcService

OWNER = "alice"
# The text of a scripted provider bug, which must never reach a log line.
CRASH_TEXT = "PRIVATE-crash-text"
MESSAGE_REF = re.compile(r"\(#(\d+)\)")


def summarized_ids(call: Sequence[ChatMessage]) -> list[int]:
    """The message ids a summarization prompt carried (rendered as `(#id)`)."""
    return [int(found) for message in call for found in MESSAGE_REF.findall(message.content)]


@dataclass
class ScriptedProvider:
    """Answers with `summary: ids ...`; fails the calls whose 0-based index is in `fail_calls`."""

    fail_calls: set[int] = field(default_factory=set)
    # Calls (0-based) that raise a programming error, as a provider with a bug would.
    crash_calls: set[int] = field(default_factory=set)
    gate: asyncio.Event | None = None
    reply: Callable[[Sequence[ChatMessage]], str] | None = None
    # Prompts longer than this are refused as too large (HTTP 413 from a real server).
    max_prompt_chars: int | None = None
    calls: list[list[ChatMessage]] = field(default_factory=list)
    waiting: int = 0
    name: str = "scripted"
    model: str = "scripted-1"

    async def complete(self, messages: Sequence[ChatMessage], *, max_output_tokens: int | None = None) -> Completion:
        index = len(self.calls)
        self.calls.append(list(messages))
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
        if index in self.fail_calls:
            raise ProviderUnavailable("scripted failure")
        if index in self.crash_calls:
            raise TypeError(f"{CRASH_TEXT}: a bug in the provider")
        if self.max_prompt_chars is not None and sum(len(m.content) for m in messages) > self.max_prompt_chars:
            raise ProviderInputTooLarge("scripted: prompt too large")
        body = self.reply(messages) if self.reply else f"summary of {summarized_ids(messages)}"
        return Completion(text=body, model=self.model, usage=Usage(10, 5), finish_reason="stop")

    async def aclose(self) -> None:
        return None

    def summarize_calls(self) -> list[list[ChatMessage]]:
        """Calls that were first attempts (not corrective retries)."""
        return [call for call in self.calls if call[-1].content == CLOSING]


def compaction_database_url(database_url: str) -> str:
    """Compaction's own database: another SQLite file, or the same PostgreSQL database (own schema)."""
    if database_url.startswith("sqlite"):
        return database_url.replace("test.db", "compaction.db")
    return database_url


@dataclass
class Stack:
    """Both services and clients acting for `OWNER`."""

    transcript: TranscriptClient
    stub: api_grpc.CompactionServiceStub
    service: GrpcService
    settings: CompactionSettings
    provider: ScriptedProvider
    database: Database

    def user(self, name: str = OWNER) -> tuple[tuple[str, str], ...]:
        """Call metadata acting for `name`."""
        return call_metadata(SERVICE_TOKEN, name)

    async def new_session(self, session_id: str, owner: str = OWNER) -> None:
        """Create a chat session."""
        await self.transcript.stub.CreateSession(
            tapi.CreateSessionRequest(session_id=session_id, kind=tpb.SESSION_KIND_CHAT, title="t"),
            metadata=self.user(owner),
        )

    async def append(self, session_id: str, *messages: tpb.NewMessage) -> list[int]:
        """Append messages in one batch; returns their real ids."""
        response = await self.transcript.stub.AppendMessages(
            tapi.AppendMessagesRequest(session_id=session_id, messages=list(messages)), metadata=self.user()
        )
        return list(response.message_ids)

    async def build(self, session_id: str, run_id: str = "run-1", **fields: object) -> api.BuildContextResponse:
        """BuildContext at request start unless `trigger_point` is given."""
        values: dict[str, object] = {"trigger_point": api.TRIGGER_POINT_REQUEST_START}
        values.update(fields)
        request = api.BuildContextRequest(session_id=session_id, run_id=run_id, **values)  # type: ignore[arg-type]
        response: api.BuildContextResponse = await self.stub.BuildContext(request, metadata=self.user())
        return response

    async def summary(self, session_id: str) -> api.GetCompactionSummaryResponse:
        """The current summary (empty answer when none)."""
        response: api.GetCompactionSummaryResponse = await self.stub.GetCompactionSummary(
            api.GetCompactionSummaryRequest(session_id=session_id), metadata=self.user()
        )
        return response

    async def record_rows(self, session_id: str) -> list[tuple[object, ...]]:
        """The raw compaction record rows of a session, read straight from compaction's tables."""
        async with self.database.connection() as connection:
            result = await connection.execute(
                text("SELECT last_compacted_msg_id, summary_text FROM session_compactions WHERE session_id = :s"),
                {"s": session_id},
            )
            return [tuple(row) for row in result]

    async def put_record(self, session_id: str, boundary: int, summary: str) -> None:
        """Store a record directly (to stage an invalid boundary)."""
        async with self.database.transaction() as connection:
            await connection.execute(
                text(
                    "INSERT INTO session_compactions (session_id, summary_text, last_compacted_msg_id, compact_count,"
                    " input_tokens, output_tokens, compact_model, create_ms, update_ms)"
                    " VALUES (:s, :t, :b, 1, 0, 0, 'staged', 0, 0)"
                ),
                {"s": session_id, "t": summary, "b": boundary},
            )


def compaction_settings(
    tmp_path: Path, database_url: str, transcript_port: int, **overrides: object
) -> CompactionSettings:
    """Settings of a test server: small thresholds so a handful of messages can trigger."""
    values: dict[str, object] = {
        "data_dir": tmp_path / "compaction",
        "database_url": compaction_database_url(database_url),
        "port": 0,
        "service_token": SecretStr(SERVICE_TOKEN),
        "transcript_address": f"127.0.0.1:{transcript_port}",
        "context_window_tokens": 1024,
        "trigger_ratio": 0.01,
        "min_compact_message_count": 1,
        "min_new_message_count": 1,
        "recent_turns": 0,
        "events_retry_seconds": 0.2,
    }
    values.update(overrides)
    return CompactionSettings(**values)  # type: ignore[arg-type]


@asynccontextmanager
async def running_stack(
    tmp_path: Path,
    database_url: str,
    scripted: ScriptedProvider | None = None,
    transcript_overrides: dict[str, object] | None = None,
    configured_provider: bool = False,
    proxy: RecordingProxy | None = None,
    clock: Clock | None = None,
    **overrides: object,
) -> AsyncIterator[Stack]:
    """Transcript and compaction started over `database_url`, with a client for each.

    Compaction calls the scripted provider unless `configured_provider` asks for the one its settings
    name (the built-in offline provider by default). With `proxy`, compaction reaches transcript
    through it (started here, pointed at transcript). With `clock`, both services run on it.
    """
    async with running_transcript(tmp_path, database_url, clock, **(transcript_overrides or {})) as transcript:
        transcript_port = transcript.service.port
        if proxy is not None:
            proxy.target(transcript_port)
            await proxy.start()
            transcript_port = proxy.port
        settings = compaction_settings(tmp_path, database_url, transcript_port, **overrides)
        scripted = scripted or ScriptedProvider()
        service = await start(settings, None if configured_provider else scripted, clock)
        channel = open_channel(f"127.0.0.1:{service.port}")
        database = Database(settings.resolved_database_url("compaction"), schema="compaction")
        try:
            yield Stack(transcript, api_grpc.CompactionServiceStub(channel), service, settings, scripted, database)
        finally:
            await database.dispose()
            await channel.close()
            await service.stop(grace=0)
            if proxy is not None:
                await proxy.stop()


async def runtime_events(follower: Follower, count: int) -> list[fpb.RuntimeEvent]:
    """The next `count` runtime events a Follow stream shows."""
    events: list[fpb.RuntimeEvent] = []
    while len(events) < count:
        frame = await follower.next()
        if frame.WhichOneof("frame") == "batch":
            events += frame.batch.events
    return events


def status_code(error: grpc.aio.AioRpcError) -> grpc.StatusCode:
    """The code of a failed call (typed)."""
    code: grpc.StatusCode = error.code()
    return code


class RecordingProxy:
    """A gRPC pass-through in front of transcript that records every unary call compaction makes.

    It forwards raw bytes for any method, so it keeps transcript's whole contract (codes, details,
    trailers) while a test reads which calls were made with which requests.
    """

    def __init__(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._server = grpc.aio.server()
        self.calls: list[tuple[str, bytes]] = []
        # Methods (by short name) answered UNAVAILABLE instead of forwarded, to stage an outage.
        self.unavailable: set[str] = set()
        self.port = 0

    def target(self, port: int) -> None:
        """Forward to transcript on `port`."""
        self._channel = open_channel(f"127.0.0.1:{port}")

    async def start(self) -> None:
        """Listen on a free loopback port."""
        proxy = self

        class Forward(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                method: str = details.method
                if method.endswith("WatchSessionEvents") or method.endswith("Follow"):
                    return None
                return grpc.unary_unary_rpc_method_handler(proxy._forwarder(method))

        self._server.add_generic_rpc_handlers((Forward(),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def _forwarder(self, method: str) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]:
        assert self._channel is not None
        upstream = self._channel.unary_unary(method)

        async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            name = method.rsplit("/", 1)[-1]
            self.calls.append((name, request))
            if name in self.unavailable:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "staged outage")
            metadata = tuple((key, value) for key, value in context.invocation_metadata() or ())
            try:
                response: bytes = await upstream(request, metadata=metadata)
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))
            return response

        return forward

    def list_after_bounds(self) -> list[int]:
        """`after_message_id` of every ListMessagesAfter call, in order."""
        return [
            tapi.ListMessagesAfterRequest.FromString(body).after_message_id
            for name, body in self.calls
            if name == "ListMessagesAfter"
        ]

    async def stop(self) -> None:
        """Stop forwarding."""
        await self._server.stop(0)
        if self._channel is not None:
            await self._channel.close()
