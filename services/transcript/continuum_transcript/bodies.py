"""Message bodies and their bounded forms: sizes, previews, stubs, budgets and streamed pieces.

Nothing a client reads may grow with a session's history, so every page and Follow frame that
carries messages has a byte budget as well as a count. A message travels whole only while its body
is small (`Limits.inline_bytes`) and the page or frame still has room (`Limits.budget_bytes`);
every other message travels as a stub: its id, role, status, size, a preview of its text and
`body_deferred`, with content, tool calls and metadata left out. The body of a stub is loaded by id
(StreamMessage in bounded pieces, or GetMessage whole).

A stub needs no body: a message's size, its preview (for bodies above `STORED_PREVIEW_BYTES`) and
its truncation flag are stored beside it when it is written, so stubs and previews are built from
those columns alone and a multi-megabyte body is never read just to be left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api

# Previews are labels, not bodies: a bounded prefix of the text with whitespace collapsed.
PREVIEW_CHARS = 200
# Bodies up to this size are cheap to read: their previews are computed from them when needed.
# Larger bodies have their preview stored when written. The inline limit is never below it.
STORED_PREVIEW_BYTES = 4096
# What a stub costs in a page or frame, at most: ids, role, status and a preview of PREVIEW_CHARS
# characters (up to 4 UTF-8 bytes each). Budgets count every stub at this size.
STUB_BYTES = 128 + 4 * PREVIEW_CHARS
# The largest piece of text one StreamMessage frame carries (UTF-8 bytes).
PIECE_BYTES = 256 * 1024

# NUL separates words like whitespace: tool output may contain it, and PostgreSQL text columns
# (where large bodies' previews are stored) refuse it.
_WORD = re.compile(r"[^\s\x00]+")


@dataclass(frozen=True)
class Limits:
    """When a message travels whole: its body within `inline_bytes`, and the page or frame within
    `budget_bytes` of inlined bodies."""

    inline_bytes: int
    budget_bytes: int


def preview(content: Any) -> str:
    """The first PREVIEW_CHARS characters of the text parts of stored `content`, whitespace collapsed.

    Words are taken lazily, so a multi-megabyte body costs only its first few hundred characters of
    work beyond the JSON decoding itself.
    """
    words: list[str] = []
    size = -1
    for text in _texts(content):
        for match in _WORD.finditer(text):
            words.append(match.group())
            size += len(words[-1]) + 1
            if size > PREVIEW_CHARS:
                return " ".join(words)[: PREVIEW_CHARS - 1].rstrip() + "…"
    return " ".join(words)


def stored_preview(content: Any, body_bytes: int) -> str:
    """What the `preview` column holds: the preview of a body too large to read for one, else ''."""
    return preview(content) if body_bytes > STORED_PREVIEW_BYTES else ""


def _texts(content: Any) -> Iterable[str]:
    if not isinstance(content, list):
        return
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            yield part["text"]


def inline_ids(sizes: Sequence[tuple[int, int]], limits: Limits) -> set[int]:
    """Which of the messages `(message_id, body_bytes)` travel whole, in order of preference.

    A message goes inline when its body is within the inline limit and fits in what is left of the
    budget; the budget also pays for the stubs, so a page of stubs stays within it too.
    """
    remaining = limits.budget_bytes - STUB_BYTES * len(sizes)
    chosen: set[int] = set()
    for message_id, body_bytes in sizes:
        if body_bytes <= limits.inline_bytes and body_bytes <= remaining:
            chosen.add(message_id)
            remaining -= body_bytes
    return chosen


def stub_row(row: Mapping[Any, Any]) -> dict[str, Any]:
    """The light form of a stored row: everything a stub shows, none of the body."""
    return {
        "message_id": row["message_id"],
        "session_id": row["session_id"],
        "role": row["role"],
        "tool_call_id": row["tool_call_id"],
        "status": row["status"],
        "deleted": row["deleted"],
        "create_ms": row["create_ms"],
        "body_bytes": row["body_bytes"],
        "result_truncated": row["result_truncated"],
        "preview": row["preview"] or preview(row.get("content")),
        "body_deferred": True,
    }


def stream_frames(message: pb.Message) -> Iterator[api.StreamMessageResponse]:
    """The header (every text emptied), then each text part and tool call's arguments in pieces."""
    header = pb.Message()
    header.CopyFrom(message)
    for part in header.content:
        if part.WhichOneof("part") == "text":
            part.text = ""
    for call in header.tool_calls:
        call.arguments = ""
    yield api.StreamMessageResponse(header=header)
    for index, part in enumerate(message.content):
        if part.WhichOneof("part") == "text":
            for piece in pieces(part.text):
                yield api.StreamMessageResponse(chunk=api.MessageBodyChunk(content_index=index, text=piece))
    for index, call in enumerate(message.tool_calls):
        for piece in pieces(call.arguments):
            yield api.StreamMessageResponse(chunk=api.MessageBodyChunk(tool_call_index=index, text=piece))


def pieces(text: str, max_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """`text` cut into consecutive pieces of at most `max_bytes` UTF-8 bytes, never inside a character."""
    if text.isascii():
        # Common and cheap: one byte per character, no encoding needed.
        for start in range(0, len(text), max_bytes):
            yield text[start : start + max_bytes]
        return
    encoded = text.encode()
    start = 0
    while start < len(encoded):
        end = min(start + max_bytes, len(encoded))
        # Back off to a character boundary: continuation bytes look like 0b10xxxxxx.
        while end < len(encoded) and encoded[end] & 0xC0 == 0x80:
            end -= 1
        yield encoded[start:end].decode()
        start = end


def utf8_size(text: str) -> int:
    """The UTF-8 size of `text`, without encoding it when it is ASCII (the common case)."""
    return len(text) if text.isascii() else len(text.encode())
