"""Request validation: every field checked before anything is written; errors name the field."""

from __future__ import annotations

import math
import re
from typing import Any, NotRequired, TypedDict

from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct, Value

from continuum.transcript.v1 import resources_pb2 as pb
from continuum_transcript.bodies import stored_preview
from continuum_transcript.errors import BadRequest
from continuum_transcript.settings import TranscriptSettings
from continuum_transcript.truncation import RESULT_TRUNCATED, reports_truncation

ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TITLE_CHARS = 1_000
MAX_MODEL_CHARS = 200
MAX_PATH_CHARS = 4_096
MAX_METADATA_BYTES = 64 * 1024
# Objects and arrays nested in metadata: protobuf decodes about 33 levels of a Struct, no more.
MAX_METADATA_DEPTH = 32
_TOO_DEEP = f"must not nest objects and arrays more than {MAX_METADATA_DEPTH} levels deep"
MAX_TOOL_CALL_ID_CHARS = 256
MAX_TOOL_NAME_CHARS = 256
MAX_TOOL_CALLS = 128
MAX_HOLDER_CHARS = 256
MIN_TTL_SECONDS = 1
MAX_TTL_SECONDS = 3_600
# Known enum numbers, computed once: the append path checks every message against them.
MESSAGE_ROLES = frozenset(pb.MessageRole.values()) - {pb.MESSAGE_ROLE_UNSPECIFIED}
MESSAGE_STATUSES = frozenset(pb.MessageStatus.values())
# Refusals list the enum values as requests spell them; UNSPECIFIED status (a complete message) is
# accepted but never needs spelling out.
_ROLE_REFUSAL = f"must be one of {', '.join(pb.MessageRole.Name(role) for role in sorted(MESSAGE_ROLES))}"
_STATUS_REFUSAL = "must be one of " + ", ".join(
    pb.MessageStatus.Name(status) for status in sorted(MESSAGE_STATUSES - {pb.MESSAGE_STATUS_UNSPECIFIED})
)


def session_id(value: str, field: str = "session_id") -> str:
    """A session id: letters, digits, '-' and '_', 1 to 64 characters."""
    if not ID_PATTERN.match(value):
        raise BadRequest(field, "must be 1-64 characters of letters, digits, '-' or '_'")
    return value


def optional_session_id(value: str, field: str) -> str | None:
    """Empty means absent; anything else must be a valid id."""
    return session_id(value, field) if value else None


def text(value: str, field: str, max_chars: int) -> str:
    """Free text without NUL (PostgreSQL text columns refuse it) and within a length limit."""
    if len(value) > max_chars:
        raise BadRequest(field, f"must be at most {max_chars} characters")
    if "\x00" in value:
        raise BadRequest(field, "must not contain NUL characters")
    return value


def metadata(value: Struct, field: str = "metadata") -> dict[str, Any]:
    """A JSON object of at most 64 KiB (serialized) whose numbers are finite (JSON has no NaN)."""
    # The protobuf size bounds the JSON size closely enough and is cheap to read; zero means no fields
    # (reading the map to find out builds a wrapper for it).
    size = value.ByteSize()
    if not size:
        return {}
    if size > MAX_METADATA_BYTES:
        raise BadRequest(field, f"must be at most {MAX_METADATA_BYTES} bytes")
    return _json_object(value, field)


# The JSON form of a Struct is what json_format.MessageToDict gives (numbers as floats, a missing kind
# as null), built directly: MessageToDict's generic dispatch costs ~10 µs per small object, paid by
# every appended message with metadata, and it raises a bare ValueError on NaN or Infinity.
def _json_object(value: Struct, field: str, depth: int = 1) -> dict[str, Any]:
    if depth > MAX_METADATA_DEPTH:
        raise BadRequest(field, _TOO_DEEP)
    fields = value.fields
    # Keys, then lookups: the map's items() goes through the pure-Python Mapping mixin, 2x slower.
    return {key: _json_value(fields[key], field, depth) for key in fields}


def _json_value(value: Value, field: str, depth: int) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise BadRequest(field, "numbers must be finite")
        return number
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return _json_object(value.struct_value, field, depth + 1)
    if kind == "list_value":
        if depth >= MAX_METADATA_DEPTH:
            raise BadRequest(field, _TOO_DEEP)
        return [_json_value(item, field, depth + 1) for item in value.list_value.values]
    return None  # null_value, or no kind set


def non_negative(value: int, field: str) -> int:
    """Sizes, cursors and ids given by callers are never negative."""
    if value < 0:
        raise BadRequest(field, "must not be negative")
    return value


def positive(value: int, field: str) -> int:
    """A required number that starts at 1 (a generation): zero means the caller left it out."""
    if value < 1:
        raise BadRequest(field, "is required and must be at least 1")
    return value


def session_kind(value: int, field: str = "kind") -> int:
    """Unspecified means CHAT; unknown numbers are refused."""
    if value == pb.SESSION_KIND_UNSPECIFIED:
        return int(pb.SESSION_KIND_CHAT)
    if value not in pb.SessionKind.values():
        raise BadRequest(field, "is not a known session kind")
    return value


def claim_kind(value: int, field: str = "kind") -> int:
    """The kind must be stated: run, merge or compaction."""
    if value == pb.CLAIM_KIND_UNSPECIFIED or value not in pb.ClaimKind.values():
        raise BadRequest(field, "must be CLAIM_KIND_RUN, CLAIM_KIND_MERGE or CLAIM_KIND_COMPACTION")
    return value


def ttl_ms(value: Duration, field: str = "ttl") -> int:
    """A lease length between 1 s and 1 h."""
    seconds = value.seconds + value.nanos / 1e9
    if not MIN_TTL_SECONDS <= seconds <= MAX_TTL_SECONDS:
        raise BadRequest(field, f"must be between {MIN_TTL_SECONDS} s and {MAX_TTL_SECONDS} s")
    return int(seconds * 1000)


def holder(value: str, field: str = "holder") -> str:
    """Who holds a claim, for diagnostics; required."""
    if not value:
        raise BadRequest(field, "must name the claim's holder")
    return text(value, field, MAX_HOLDER_CHARS)


class MessageRow(TypedDict):
    """A validated message as the row to insert (JSON-shaped content, tool calls and metadata), with
    what stubs show instead of the body: its size, its stored preview and its truncation flag.

    The publisher that accepts it fills in the rest in place, and it becomes the stored row: one
    dict per message from the request to the database, with nothing copied on the way."""

    role: int
    content: list[dict[str, Any]]
    tool_calls: list[dict[str, str]]
    tool_call_id: str
    metadata: dict[str, Any]
    status: int
    body_bytes: int
    preview: str
    result_truncated: bool
    # Set by the publisher when it accepts the message.
    message_id: NotRequired[int]
    session_id: NotRequired[str]
    deleted: NotRequired[bool]
    create_ms: NotRequired[int]
    commit_seq: NotRequired[int]


def message_row(
    role: int,
    content: list[dict[str, Any]],
    tool_calls: list[dict[str, str]],
    tool_call_id: str,
    metadata: dict[str, Any],
    status: int,
    body_bytes: int,
) -> MessageRow:
    """A message row of valid values, its preview and truncation flag computed."""
    return {
        "role": role,
        "content": content,
        "tool_calls": tool_calls,
        "tool_call_id": tool_call_id,
        "metadata": metadata,
        "status": status,
        "body_bytes": body_bytes,
        "preview": stored_preview(content, body_bytes),
        "result_truncated": role == pb.MESSAGE_ROLE_TOOL and metadata.get(RESULT_TRUNCATED) is True,
    }


def attachment_ids(content: list[dict[str, Any]]) -> list[str]:
    """The attachments stored content parts refer to, in order."""
    return [part["attachment"]["attachment_id"] for part in content if "attachment" in part]


def content_parts(parts: Any, field: str) -> list[dict[str, Any]]:
    """Text parts and attachment references; a part must set one of them."""
    result: list[dict[str, Any]] = []
    for index, part in enumerate(parts[:]):
        which = part.WhichOneof("part")
        if which == "text":
            result.append({"text": part.text})
        elif which == "attachment":
            attachment_id = part.attachment.attachment_id
            if not ID_PATTERN.match(attachment_id):
                raise BadRequest(f"{field}[{index}].attachment.attachment_id", "is not a valid attachment id")
            result.append({"attachment": {"attachment_id": attachment_id}})
        else:
            raise BadRequest(f"{field}[{index}]", "must set text or attachment")
    return result


def new_message(message: pb.NewMessage, field: str, settings: TranscriptSettings, size: int) -> MessageRow:
    """Check one message (`size` serialized bytes), named `field` in errors, against the role rules and limits."""
    try:
        return _message_row(message, settings, size)
    except BadRequest as error:
        raise error.within(field) from None


# Fields are named relative to the message (".role"): the append path checks every message, and
# building each one's absolute names up front, for errors that almost never happen, cost ~10% of it.
def _message_row(message: pb.NewMessage, settings: TranscriptSettings, size: int) -> MessageRow:
    if size > settings.max_message_bytes:
        raise BadRequest("", f"is {size} bytes; the limit is {settings.max_message_bytes}")
    role = message.role
    if role not in MESSAGE_ROLES:
        raise BadRequest(".role", _ROLE_REFUSAL)
    status = message.status or pb.MESSAGE_STATUS_COMPLETE
    if status not in MESSAGE_STATUSES:
        raise BadRequest(".status", _STATUS_REFUSAL)
    parts = message.content[:]
    # The common shape, one text part, without the general loop.
    if len(parts) == 1 and parts[0].WhichOneof("part") == "text":
        content = [{"text": parts[0].text}]
    else:
        content = content_parts(parts, ".content")
    # Most messages have no tool calls: the check costs a call only when there are some.
    given = message.tool_calls
    tool_calls = _tool_calls(given, role) if given else []
    # Read once: every read of a protobuf string field builds a new str.
    tool_call_id = message.tool_call_id
    if role == pb.MESSAGE_ROLE_TOOL:
        if not tool_call_id:
            raise BadRequest(".tool_call_id", "is required on a TOOL message")
        text(tool_call_id, ".tool_call_id", MAX_TOOL_CALL_ID_CHARS)
    elif tool_call_id:
        raise BadRequest(".tool_call_id", "is only allowed on a TOOL message")
    if not content and not tool_calls and status == pb.MESSAGE_STATUS_COMPLETE:
        raise BadRequest(".content", "must not be empty")
    # Most messages have no metadata: asking is much cheaper than reading the empty Struct.
    given_metadata = metadata(message.metadata, ".metadata") if message.HasField("metadata") else {}
    if role == pb.MESSAGE_ROLE_TOOL and reports_truncation(content):
        # Every stored message passes here once, so the flag is computed at write time only.
        given_metadata = {**given_metadata, RESULT_TRUNCATED: True}
    # The serialized size bounds the body's text, tool calls and metadata, and costs nothing.
    return message_row(role, content, tool_calls, tool_call_id, given_metadata, status, size)


def _tool_calls(given: Any, role: int) -> list[dict[str, str]]:
    if role != pb.MESSAGE_ROLE_ASSISTANT:
        raise BadRequest(".tool_calls", "are only allowed on an ASSISTANT message")
    if len(given) > MAX_TOOL_CALLS:
        raise BadRequest(".tool_calls", f"must be at most {MAX_TOOL_CALLS}")
    seen: set[str] = set()
    calls = []
    for index, call in enumerate(given[:]):
        call_id, name = call.tool_call_id, call.name
        try:
            if not call_id:
                raise BadRequest(".tool_call_id", "is required")
            text(call_id, ".tool_call_id", MAX_TOOL_CALL_ID_CHARS)
            if call_id in seen:
                raise BadRequest(".tool_call_id", "repeats another tool call of this message")
            if not name:
                raise BadRequest(".name", "is required")
            text(name, ".name", MAX_TOOL_NAME_CHARS)
        except BadRequest as error:
            raise error.within(f".tool_calls[{index}]") from None
        seen.add(call_id)
        calls.append({"tool_call_id": call_id, "name": name, "arguments": call.arguments})
    return calls


def append_batch(messages: Any, settings: TranscriptSettings) -> list[MessageRow]:
    """A whole append batch: 1..max messages, within the batch byte limit."""
    if not messages:
        raise BadRequest("messages", "must contain at least one message")
    if len(messages) > settings.max_batch_messages:
        raise BadRequest("messages", f"must contain at most {settings.max_batch_messages} messages")
    # One Python object per message, reused by both passes below (each pass over the repeated
    # field would wrap every message anew).
    messages = messages[:]
    sizes = [message.ByteSize() for message in messages]
    total = sum(sizes)
    if total > settings.max_batch_bytes:
        raise BadRequest("messages", f"total {total} bytes; the limit is {settings.max_batch_bytes}")
    rows = []
    for index, (message, size) in enumerate(zip(messages, sizes, strict=True)):
        try:
            rows.append(_message_row(message, settings, size))
        except BadRequest as error:
            raise error.within(f"messages[{index}]") from None
    return rows
