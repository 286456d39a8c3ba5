"""Message bodies in bounded pieces: what StreamMessage sends instead of one message of any size."""

from __future__ import annotations

from collections.abc import Iterator

from continuum.transcript.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as api

# The largest piece of text one StreamMessage frame carries (UTF-8 bytes).
PIECE_BYTES = 256 * 1024


def pieces(text: str, max_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """`text` cut into consecutive pieces of at most `max_bytes` UTF-8 bytes, never inside a character."""
    encoded = text.encode()
    start = 0
    while start < len(encoded):
        end = min(start + max_bytes, len(encoded))
        # Back off to a character boundary: continuation bytes look like 0b10xxxxxx.
        while end < len(encoded) and encoded[end] & 0xC0 == 0x80:
            end -= 1
        yield encoded[start:end].decode()
        start = end


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
