"""Rows to protobuf resources."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy import RowMapping

from continuum.transcript.v1 import resources_pb2 as pb
from continuum_transcript.claims import HeldClaim


def timestamp(epoch_ms: int | None) -> Timestamp | None:
    """A Timestamp from epoch milliseconds (None stays unset)."""
    if epoch_ms is None:
        return None
    stamp = Timestamp()
    stamp.FromMilliseconds(epoch_ms)
    return stamp


def struct(value: dict[str, Any]) -> Struct:
    """A Struct from a JSON object."""
    result = Struct()
    if value:
        json_format.ParseDict(value, result)
    return result


def session(row: RowMapping) -> pb.Session:
    """The Session resource of a row."""
    return pb.Session(
        session_id=row["session_id"],
        owner=row["owner"],
        parent_session_id=row["parent_session_id"] or "",
        root_session_id=row["root_session_id"],
        kind=row["kind"],
        title=row["title"],
        model=row["model"],
        working_directory=row["working_directory"],
        memory_injection_disabled=row["memory_injection_disabled"],
        metadata=struct(row["metadata"]),
        history_generation=row["history_generation"],
        compaction_fence_message_id=row["compaction_fence_message_id"],
        create_time=timestamp(row["create_ms"]),
        update_time=timestamp(row["update_ms"]),
        delete_time=timestamp(row["delete_ms"]),
    )


def content_part(part: dict[str, Any], media_types: dict[str, str], into: pb.ContentPart) -> None:
    """One stored content part, written into `into` (an empty part already inside its message: a part
    built on its own would be copied once more into the message, text and all)."""
    if "attachment" in part:
        attachment_id = part["attachment"]["attachment_id"]
        into.attachment.SetInParent()
        into.attachment.attachment_id = attachment_id
        into.attachment.media_type = media_types.get(attachment_id, "")
    else:
        into.text = part["text"]


def message(
    row: Mapping[Any, Any], media_types: dict[str, str] | None = None, *, into: pb.Message | None = None
) -> pb.Message:
    """The Message resource of a row: whole, or a stub for a light row (see `bodies.stub_row`). Written
    into `into` when given (an empty message already inside a response: its body is not copied again)."""
    message = pb.Message() if into is None else into
    message.message_id = row["message_id"]
    message.session_id = row["session_id"]
    message.role = row["role"]
    message.tool_call_id = row["tool_call_id"]
    message.status = row["status"]
    message.deleted = row["deleted"]
    if row["create_ms"] is not None:
        message.create_time.FromMilliseconds(row["create_ms"])
    message.result_truncated = row["result_truncated"]
    message.body_bytes = row["body_bytes"]
    if row.get("body_deferred"):
        message.body_deferred = True
        message.preview = row["preview"]
        return message
    known = media_types or {}
    for part in row["content"]:
        content_part(part, known, message.content.add())
    message.tool_calls.extend(pb.ToolCall(**call) for call in row["tool_calls"])
    message.metadata.CopyFrom(struct(row["metadata"]))
    return message


def attachment(row: RowMapping) -> pb.Attachment:
    """The Attachment resource of a row."""
    return pb.Attachment(
        attachment_id=row["attachment_id"],
        session_id=row["session_id"],
        media_type=row["media_type"],
        file_name=row["file_name"],
        size_bytes=row["size_bytes"],
        sha256=row["sha256"],
        create_time=timestamp(row["create_ms"]),
    )


def claim(held: HeldClaim) -> pb.Claim:
    """The Claim resource."""
    return pb.Claim(
        claim_id=held.claim_id,
        kind=pb.ClaimKind.ValueType(held.kind),
        holder=held.holder,
        session_ids=held.session_ids,
        root_session_ids=held.root_session_ids,
        expire_time=timestamp(held.expire_ms),
    )


def event(row: RowMapping) -> pb.SessionEvent:
    """The SessionEvent resource of an outbox row."""
    payload = row["payload"]
    return pb.SessionEvent(
        event_id=row["event_id"],
        type=row["event_type"],
        session_id=row["session_id"],
        root_session_id=row["root_session_id"],
        owner=row["owner"],
        deleted_session_ids=payload.get("deleted_session_ids", []),
        edited_message_id=payload.get("edited_message_id", 0),
        history_generation=payload.get("history_generation", 0),
        create_time=timestamp(row["create_ms"]),
    )
