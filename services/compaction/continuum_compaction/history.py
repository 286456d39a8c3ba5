"""Loaded messages as compaction sees them: real id, role, tool links and an estimated token cost.

Transcript's messages are wrapped once at load; the wrapper satisfies the model view's `HistoryMessage`
protocol so the normalizer can put them in model order without re-reading anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class LoadedHistory:
    """The messages after one boundary, in model order, plus the ids the normalizer dropped.

    Dropped ids are tool results whose call lies before the boundary (already summarized) or
    duplicates; they are never sent, so a boundary may pass over them.
    """

    boundary: int
    view: tuple[LoadedMessage, ...]
    dropped_ids: frozenset[int]

    @property
    def tokens(self) -> int:
        """Estimated tokens of every message in the view."""
        return sum(message.tokens for message in self.view)


def load_history(boundary: int, messages: Iterable[tpb.Message]) -> LoadedHistory:
    """Normalize the messages loaded after `boundary` (query first, then reorder; seed 001 §7.3)."""
    view = build_model_view(LoadedMessage.of(message) for message in messages)
    dropped = frozenset(view.report.orphan_ids) | frozenset(view.report.duplicate_ids)
    return LoadedHistory(boundary, tuple(view.messages), dropped)
