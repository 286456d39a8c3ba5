"""A scripted OpenAI-compatible chat-completions server on loopback (importable as `model_server_testing`).

Tests drive the real HTTP provider against it: every request is recorded, every reply scripted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

MODEL = "test-model-7b"


@dataclass(frozen=True)
class Reply:
    """One scripted response; `delay_seconds` is waited before answering."""

    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    delay_seconds: float = 0.0


@dataclass(frozen=True)
class Received:
    """One request the server read."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def json_reply(payload: object, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status=status, body=json.dumps(payload).encode(), headers=headers)


def completion(
    text: str = "A short summary.", *, finish_reason: str | None = "stop", usage: dict[str, int] | None = None
) -> Reply:
    payload: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": f"{MODEL}-2024",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
    }
    if usage is not None:
        payload["usage"] = usage
    return json_reply(payload)


class FakeModelServer:
    """An HTTP/1.1 server on 127.0.0.1 that answers each request with the next scripted reply.

    It records every request it reads. A request past the end of the script gets a 418, which the
    provider does not retry, so a test that asks more than it scripted fails visibly.
    """

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Received] = []
        self._connections: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        # Connections still waiting (a reply's delay, an idle keep-alive) end now, not at the loop's end.
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while (request := await _read_request(reader)) is not None:
                self.requests.append(request)
                reply = self.replies.popleft() if self.replies else Reply(status=418, body=b"unscripted")
                await asyncio.sleep(reply.delay_seconds)
                writer.write(_encode(reply))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> Received | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None  # the client closed the connection
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Received(method, path, headers, body)


def _encode(reply: Reply) -> bytes:
    lines = [
        f"HTTP/1.1 {reply.status} {HTTPStatus(reply.status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(reply.body)}",
        *(f"{name}: {value}" for name, value in reply.headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + reply.body
