"""Records of the package: origin identity, content version, recordRef, raw JSON and text projection.

`recordRef` is the full sha256 of the canonical JSON of the origin identity (kind, session id, record
id) and the content version. The version of a message is the sha256 of what it says: role, content,
tool calls, tool call id, status (its stop reason) and its semantic metadata; never when it was copied
and never usage. So the same message read twice (directly, and again through an earlier merge's
package) is one record, and an edited message is another.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from google.protobuf import json_format

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_merge.snapshot.layout import TEXT_PART_BYTES

# Metadata keys that are not what a message says: token usage and the wrapper of an earlier handoff.
NON_SEMANTIC_METADATA = frozenset({"usage", "handoffOrigin"})
# Tool metadata whose display snapshot the text projection leaves out (the raw record keeps it).
EDIT_DIFF_SCHEMA = "edit-diff/v1"
EDIT_DIFF_DISPLAY_KEY = "structuredResult"

MESSAGE = "message"
SESSION = "session"
EXTRACT = "extract"
REFERENCE = "reference"
# Saved but not readable by this merge (seed 000 §4.2): the raw record is kept, nothing of it reaches a
# model, and the merge pauses RECORD_REQUIRES_HANDLING once the snapshot is sealed.
BLOCKED = "blocked"
NEWLINE = b"\n"


def canonical(value: object) -> bytes:
    """The one serialization hashed everywhere: JSON with sorted keys, no spaces, UTF-8."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


# Stands in a value for bytes spliced in later. orjson writes its fragments verbatim and escapes every
# control character inside strings, so a NUL byte in its output can only be this one.
_SPLICE = orjson.Fragment(b"\x00")


def canonical_around(value: object) -> tuple[bytes, bytes]:
    """canonical(value), where `value` holds _SPLICE once, as the bytes before and after it: with a
    value's canonical JSON between them, the same bytes canonical() gives with that value in place."""
    before, splice, after = canonical(value).partition(b"\x00")
    if not splice or b"\x00" in after:
        raise ValueError("the value must hold the splice exactly once")
    return before, after


def sha256_hex(data: bytes) -> str:
    """Lowercase hex sha256."""
    return hashlib.sha256(data).hexdigest()


def record_ref(kind: str, session_id: str, record_id: str, version: str) -> str:
    """The full sha256 of origin identity + content version."""
    return sha256_hex(canonical({"kind": kind, "sessionId": session_id, "recordId": record_id, "version": version}))


@dataclass(frozen=True)
class PreparedRecord:
    """A record ready to be written: its row (without package paths), raw JSON and text projection."""

    record_ref: str
    origin: Mapping[str, str]
    role: str
    created_at: str
    processing_policy: str
    # The raw JSON in consecutive pieces (written one after the other, never joined: a message's
    # content is most of its bytes, and is serialized once for both its version and its raw record).
    raw: tuple[bytes, ...]
    # The text projection in consecutive pieces too: each line and its newline, never joined (a long
    # tool output would otherwise be copied three times more: joined, the last newline added, encoded).
    text: tuple[bytes, ...]


def _struct(value: Any) -> dict[str, Any]:
    converted: dict[str, Any] = json_format.MessageToDict(value)
    return converted


def _content(message: tpb.Message) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for part in message.content:
        kind = part.WhichOneof("part")
        if kind == "attachment":
            attachment = part.attachment
            parts.append({"attachment": {"attachmentId": attachment.attachment_id, "mediaType": attachment.media_type}})
        elif kind == "text":
            parts.append({"text": part.text})
        else:
            parts.append({"unknown": True})
    return parts


def unreadable(message: tpb.Message) -> str:
    """Why this merge cannot read a saved message ("" when it can): a role or status it does not know
    (a newer transcript's), or a content part that is neither text nor an attachment."""
    if message.role not in _ROLES:
        return f"role {message.role} is unknown"
    if message.status not in tpb.MessageStatus.values():
        return f"status {message.status} is unknown"
    if any(part.WhichOneof("part") is None for part in message.content):
        return "a content part is neither text nor an attachment"
    return ""


_ROLES = frozenset(tpb.MessageRole.values()) - {tpb.MESSAGE_ROLE_UNSPECIFIED}


def _enum_name(enum: Any, number: int, prefix: str) -> str:
    """The value's name without its prefix, or its number for a value this build does not know."""
    return enum.Name(number).removeprefix(prefix) if number in enum.values() else str(number)


def prepare_message(message: tpb.Message, root_session_id: str) -> PreparedRecord:
    """A transcript message as a record: identity (session, message id) and version from its content.
    A message this merge cannot read is kept whole in its raw record and marked BLOCKED."""
    role = _enum_name(tpb.MessageRole, message.role, "MESSAGE_ROLE_")
    status = _enum_name(tpb.MessageStatus, message.status, "MESSAGE_STATUS_")
    metadata = _struct(message.metadata)
    content = _content(message)
    tool_calls = [
        {"toolCallId": call.tool_call_id, "name": call.name, "arguments": call.arguments} for call in message.tool_calls
    ]
    semantic = {key: value for key, value in metadata.items() if key not in NON_SEMANTIC_METADATA}
    # The content (nearly all of a message's bytes) is serialized once; the version hashes it between
    # the rest of what the message says, and the raw record is written around it, neither copying it.
    content_json = canonical(content)
    said = {
        "role": role,
        "content": _SPLICE,
        "toolCalls": tool_calls,
        "toolCallId": message.tool_call_id,
        "status": status,
        "metadata": semantic,
    }
    before, after = canonical_around(said)
    digest = hashlib.sha256(before)
    digest.update(content_json)
    digest.update(after)
    version = digest.hexdigest()
    record_id = str(message.message_id)
    ref = record_ref(MESSAGE, message.session_id, record_id, version)
    origin = {"kind": MESSAGE, "sessionId": message.session_id, "recordId": record_id, "version": version}
    created_at = message.create_time.ToJsonString() if message.HasField("create_time") else ""
    raw = {
        "recordRef": ref,
        "origin": origin,
        "rootSessionId": root_session_id,
        "createdAt": created_at,
        "message": {**said, "metadata": metadata, "resultTruncated": message.result_truncated},
    }
    why = unreadable(message)
    if why:
        raw["unreadable"] = why
    before, after = canonical_around(raw)
    pieces = (before, content_json, after)
    if why:
        text = f"[{role} message {message.message_id} of session {message.session_id}, not readable: {why}]\n"
        return PreparedRecord(ref, origin, role, created_at, BLOCKED, pieces, (text.encode(),))
    text_pieces = _message_text(message.message_id, message.session_id, role, status, content, tool_calls, metadata)
    return PreparedRecord(ref, origin, role, created_at, EXTRACT, pieces, text_pieces)


def _message_text(
    message_id: int,
    session_id: str,
    role: str,
    status: str,
    content: list[dict[str, Any]],
    tool_calls: list[dict[str, str]],
    metadata: dict[str, Any],
) -> tuple[bytes, ...]:
    lines = [
        f"[{role} message {message_id} of session {session_id}{', interrupted' if status == 'INTERRUPTED' else ''}]"
    ]
    for part in content:
        if "attachment" in part:
            attachment = part["attachment"]
            lines.append(f"[attachment {attachment['attachmentId']} {attachment['mediaType']}]")
        else:
            lines.append(part["text"])
    for call in tool_calls:
        lines.append(f"[tool call {call['toolCallId']} {call['name']}]")
        lines.append(call["arguments"])
    shown = projected_metadata(metadata)
    if shown:
        lines.append("[metadata] " + canonical(shown).decode())
    # Every line followed by its newline: the bytes of "\n".join(lines) + "\n".
    return tuple(piece for line in lines for piece in (line.encode(), NEWLINE))


def projected_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata as the text projection shows it: an `edit-diff/v1` tool result without its
    `structuredResult` display snapshot; everything else as stored."""
    if metadata.get("schema") == EDIT_DIFF_SCHEMA:
        return {key: value for key, value in metadata.items() if key != EDIT_DIFF_DISPLAY_KEY}
    return dict(metadata)


def prepare_session(session: tpb.Session, last_message_id: int) -> PreparedRecord:
    """A session of a source tree at the cut as a reference record: where it sits, what it was called,
    and the cut (its last message and history generation), which is part of its version: the same
    session cut later is another record."""
    kind = tpb.SessionKind.Name(session.kind).removeprefix("SESSION_KIND_")
    described = {
        "cut": {"lastMessageId": last_message_id, "historyGeneration": session.history_generation},
        "kind": kind,
        "parentSessionId": session.parent_session_id,
        "rootSessionId": session.root_session_id,
        "title": session.title,
        "model": session.model,
        "workingDirectory": session.working_directory,
        "metadata": _struct(session.metadata),
    }
    version = sha256_hex(canonical(described))
    ref = record_ref(SESSION, session.session_id, session.session_id, version)
    origin = {"kind": SESSION, "sessionId": session.session_id, "recordId": session.session_id, "version": version}
    created_at = session.create_time.ToJsonString() if session.HasField("create_time") else ""
    raw = {"recordRef": ref, "origin": origin, "createdAt": created_at, "session": described}
    text = (
        f"[session {session.session_id} ({kind}) of tree {session.root_session_id}"
        f"{', parent ' + session.parent_session_id if session.parent_session_id else ''}]\n"
        f"title: {session.title}\nmodel: {session.model}\nworking directory: {session.working_directory}\n"
        f"copied up to message {last_message_id}\n"
    )
    return PreparedRecord(ref, origin, "reference", created_at, REFERENCE, (canonical(raw),), (text.encode(),))


def utf8_parts(pieces: Sequence[bytes], limit: int = TEXT_PART_BYTES) -> list[list[memoryview]]:
    """The bytes of `pieces` one after the other (each piece valid UTF-8 by itself) in consecutive parts
    of at most `limit` bytes, each ending on a code point boundary (a cut never lands before a
    continuation byte; a piece's first byte never is one). Empty text is one empty part. Each part is
    views of the pieces: nothing is copied."""
    parts: list[list[memoryview]] = []
    part: list[memoryview] = []
    room = limit
    for piece in pieces:
        view = memoryview(piece)
        while len(view) > room:
            end = room
            while view[end] & 0xC0 == 0x80:
                end -= 1
            if end:
                part.append(view[:end])
            parts.append(part)
            part, room, view = [], limit, view[end:]
        if view:
            part.append(view)
            room -= len(view)
    if part or not parts:
        parts.append(part)
    return parts
