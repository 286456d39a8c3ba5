"""One message read whole over HTTP without ever holding its body whole.

    GET /v1/sessions/{session_id}/messages/{message_id}    StreamMessage

A message body can be megabytes (pages and Follow frames carry such a message as a stub with
``bodyDeferred: true``). The gateway reads it from transcript's StreamMessage in pieces of bounded
size and writes the JSON response as the pieces arrive: the same ``{"message": Message}`` in proto
JSON that a whole read would produce, but no larger in memory than one piece at a time.

Failures before the first byte (no such message, another user's session, transcript down) are
ordinary AIP-193 responses. A failure after the response started can only cut it short: the body
is then not valid JSON, which a client notices.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from continuum.transcript.v1 import resources_pb2, transcript_service_pb2
from continuum_gateway.auth import acting_user
from continuum_gateway.protojson import to_json
from continuum_gateway.routing import bind
from continuum_gateway.upstream import upstreams_of


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _escaped(text: str) -> bytes:
    """`text` as the inside of a JSON string."""
    return _dumps(text)[1:-1].encode()


class _Pieces:
    """The body pieces of one StreamMessage call, read one ahead."""

    def __init__(self, reading: Any) -> None:
        self._reading = reading
        self._next: transcript_service_pb2.StreamMessageResponse | None = None

    async def start(self) -> None:
        """Read the first piece (or the end)."""
        self._next = await self._reading.read()

    async def texts(self, target: str, index: int) -> AsyncIterator[bytes]:
        """The escaped pieces of content[index] (`target` "content_index") or of tool call `index`."""
        while self._next is not None and self._next.chunk.WhichOneof("target") == target:
            if getattr(self._next.chunk, target) != index:
                return
            yield _escaped(self._next.chunk.text)
            self._next = await self._reading.read()

    def done(self) -> bool:
        """Whether every piece was used (anything else means the stream did not match its header)."""
        return self._next is None


async def message_json(header: resources_pb2.Message, reading: Any) -> AsyncIterator[bytes]:
    """``{"message": ...}`` of the message whose header (texts emptied) and pieces `reading` streams."""
    fields = to_json(header)
    content = fields.pop("content", [])
    calls = fields.pop("toolCalls", [])
    pieces = _Pieces(reading)
    await pieces.start()
    yield _dumps({"message": fields})[:-2].encode() + b',"content":['
    for index, part in enumerate(content):
        if index:
            yield b","
        if "text" not in part:
            yield _dumps(part).encode()
            continue
        yield b'{"text":"'
        async for text in pieces.texts("content_index", index):
            yield text
        yield b'"}'
    yield b'],"toolCalls":['
    for index, call in enumerate(calls):
        if index:
            yield b","
        call.pop("arguments", None)
        yield _dumps(call)[:-1].encode() + b',"arguments":"'
        async for text in pieces.texts("tool_call_index", index):
            yield text
        yield b'"}'
    if not pieces.done():
        raise RuntimeError("StreamMessage sent pieces its header does not have")
    yield b"]}}"


async def get_message(request: Request) -> Response:
    """One message by id, deleted or not, streamed as it is read."""
    ids = await bind(request, transcript_service_pb2.GetMessageRequest())
    upstreams = upstreams_of(request)
    stream_request = transcript_service_pb2.StreamMessageRequest(session_id=ids.session_id, message_id=ids.message_id)
    call = contextlib.AsyncExitStack()
    reading = await call.enter_async_context(
        upstreams.stream_transcript(upstreams.transcript.StreamMessage, stream_request, user=acting_user(request))
    )
    try:
        # Refusals arrive before the header: they become ordinary error responses.
        first = await reading.read()
        if first is None or first.WhichOneof("frame") != "header":
            raise RuntimeError("StreamMessage did not begin with the message header")
    except BaseException:
        await call.aclose()
        raise

    async def body() -> AsyncIterator[bytes]:
        async with call:
            async for piece in message_json(first.header, reading):
                yield piece

    return StreamingResponse(body(), media_type="application/json")
