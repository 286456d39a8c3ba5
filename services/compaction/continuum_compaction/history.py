"""Loaded messages as compaction sees them: real id, role, tool links and an estimated token cost.

Transcript's messages are wrapped once at load; the wrapper satisfies the model view's `HistoryMessage`
protocol so the normalizer can put them in model order without re-reading anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction.model_view import build_model_view
from continuum_runtime.provider import estimate_message_tokens

ROLE_NAMES = {
    tpb.MESSAGE_ROLE_USER: "user",
    tpb.MESSAGE_ROLE_ASSISTANT: "assistant",
    tpb.MESSAGE_ROLE_TOOL: "tool",
    tpb.MESSAGE_ROLE_SYSTEM: "system",
}


def message_text(message: tpb.Message) -> str:
    """The text a model would read: text parts joined, attachments named by media type, calls listed."""
    parts: list[str] = []
    for part in message.content:
        if part.WhichOneof("part") == "text":
            parts.append(part.text)
        else:
            parts.append(f"[attachment {part.attachment.media_type or 'unknown type'}]")
    parts.extend(f"[tool call {call.name}({call.arguments})]" for call in message.tool_calls)
    return "\n".join(parts)


@dataclass(frozen=True)
class LoadedMessage:
    """One persisted message after the boundary, with what cutting and estimating need."""

    message: tpb.Message
    tokens: int = field(compare=False)

    @classmethod
    def of(cls, message: tpb.Message) -> LoadedMessage:
        """Wrap a transcript message, estimating its tokens once."""
        role = ROLE_NAMES.get(message.role, "user")
        return cls(message, estimate_message_tokens(role, message_text(message)))

    @property
    def message_id(self) -> int:
        return self.message.message_id

    @property
    def role(self) -> str:
        return ROLE_NAMES.get(self.message.role, "user")

    @property
    def tool_call_ids(self) -> Sequence[str]:
        return [call.tool_call_id for call in self.message.tool_calls]

    @property
    def tool_call_id(self) -> str:
        return self.message.tool_call_id


def clip(message: tpb.Message, max_bytes: int) -> tpb.Message:
    """`message` with its texts (content, then tool call arguments) cut to `max_bytes` of UTF-8 in all,
    and a note saying what was left out; the message itself when its texts are within the limit.

    A model cannot read a multi-megabyte tool output in one request anyway; the transcript keeps the
    whole message, and the note names it so the runtime can read it in full if it must.
    """
    if message.ByteSize() <= max_bytes:
        return message  # its texts are smaller still
    clipped = tpb.Message()
    clipped.CopyFrom(message)
    texts: list[tuple[Any, str]] = [(part, "text") for part in clipped.content if part.WhichOneof("part") == "text"]
    texts += [(call, "arguments") for call in clipped.tool_calls]
    remaining, left_out = max_bytes, 0
    for holder, name in texts:
        encoded = getattr(holder, name).encode()
        if len(encoded) > remaining:
            kept = encoded[:remaining].decode(errors="ignore")
            setattr(holder, name, kept)
            left_out += len(encoded) - len(kept.encode())
        remaining = max(0, remaining - len(encoded))
    if not left_out:
        return message  # large in its metadata, not its texts
    note = (
        f"\n[{left_out} more bytes of message {message.message_id} left out of this request; the transcript has it all]"
    )
    if clipped.content and clipped.content[-1].WhichOneof("part") == "text":
        clipped.content[-1].text += note
    else:
        clipped.content.add(text=note)
    return clipped


@dataclass(frozen=True)
class LoadedHistory:
    """The messages after one boundary, in model order, plus the ids the normalizer dropped.

    Dropped ids are tool results whose call lies before the boundary (already summarized) or
    duplicates; they are never sent, so a boundary may pass over them.
    """

    boundary: int
    view: tuple[LoadedMessage, ...]
    dropped_ids: frozenset[int]
    # Messages whose text was clipped to the per-message limit when loaded (see `clip`).
    clipped_ids: frozenset[int] = frozenset()

    @property
    def tokens(self) -> int:
        """Estimated tokens of every message in the view."""
        return sum(message.tokens for message in self.view)


def load_history(
    boundary: int, messages: Iterable[tpb.Message], clipped_ids: frozenset[int] = frozenset()
) -> LoadedHistory:
    """Normalize the messages loaded after `boundary` (query first, then reorder; seed 001 §7.3).
    `clipped_ids` names those that were clipped (see `clip`) as they were loaded."""
    view = build_model_view(LoadedMessage.of(message) for message in messages)
    dropped = frozenset(view.report.orphan_ids) | frozenset(view.report.duplicate_ids)
    return LoadedHistory(boundary, tuple(view.messages), dropped, clipped_ids)
