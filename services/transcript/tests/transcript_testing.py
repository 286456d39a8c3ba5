"""Builders and a client shared by the transcript tests (importable as `transcript_testing`)."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from pydantic import SecretStr

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2_grpc as api_grpc
from continuum_runtime.auth import call_metadata
from continuum_runtime.errors import ErrorDetails, error_details
from continuum_runtime.server import GrpcService
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


def assistant(text: str, *tool_call_ids: str) -> pb.NewMessage:
    """An ASSISTANT message, optionally issuing tool calls."""
    calls = [pb.ToolCall(tool_call_id=c, name="shell", arguments="{}") for c in tool_call_ids]
    return pb.NewMessage(role=pb.MESSAGE_ROLE_ASSISTANT, content=[pb.ContentPart(text=text)], tool_calls=calls)


def tool(tool_call_id: str, text: str) -> pb.NewMessage:
    """A TOOL result."""
    return pb.NewMessage(role=pb.MESSAGE_ROLE_TOOL, tool_call_id=tool_call_id, content=[pb.ContentPart(text=text)])


async def refused(call: Awaitable[object], code: grpc.StatusCode, reason: str) -> ErrorDetails:
    """Await `call`, expect it to fail with `code` and ErrorInfo `reason`; return the details."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    details = error_details(caught.value)
    assert (details.code, details.reason) == (code, reason), details
    return details
