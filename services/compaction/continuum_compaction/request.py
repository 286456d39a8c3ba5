"""The final request object of one model call, and the context manifest produced from it.

The manifest is computed from exactly what is returned (after normalization and injections), never
reconstructed afterwards; the section texts joined are the system prompt byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import json_format

from continuum.compaction.events.v1 import events_pb2
from continuum.compaction.v1 import compaction_service_pb2 as api
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum_compaction.handoff import ENTRY_KEY, ENTRY_LABEL, HandoffEntry
from continuum_compaction.history import LoadedHistory
from continuum_compaction.summarizer import summary_message_text
from continuum_runtime.provider import estimate_message_tokens, estimate_tokens

MEMORY_KEY = "memory"
MEMORY_LABEL = "Long-term memory"
MEMORY_HEADING = "## Long-term memory"


@dataclass(frozen=True)
class ModelRequest:
    """What the runtime sends: the system prompt, the history, and the manifest describing them."""

    system_prompt: str
    messages: list[tpb.Message]
    manifest: events_pb2.ContextManifest


def memory_section_text(entries: Sequence[api.MemoryEntry], after_other_sections: bool) -> str:
    """The memory section appended after the runtime's sections."""
    lead = "\n\n" if after_other_sections else ""
    bullets = "\n".join(f"- {entry.text.strip()}" for entry in entries)
    return f"{lead}{MEMORY_HEADING}\n{bullets}\n"


def build_request(
    session_id: str,
    sections: Sequence[api.PromptSection],
    memory: Sequence[api.MemoryEntry],
    summary: str,
    history: LoadedHistory,
    window_tokens: int,
    manifest_max_bytes: int,
    omitted_messages: int = 0,
    entry: HandoffEntry | None = None,
) -> ModelRequest:
    """Assemble the request, then describe it. `memory` is empty when injection is off;
    `omitted_messages` counts the messages after the boundary that `history` leaves out; `entry` is a
    merged session's reference entry, placed after the summary and before the history."""
    texts = [section.text for section in sections]
    stats = [
        events_pb2.ContextSection(
            key=f"system:{section.key}", label=section.label, estimated_tokens=estimate_tokens(section.text)
        )
        for section in sections
    ]
    if memory:
        text = memory_section_text(memory, after_other_sections=bool(texts))
        texts.append(text)
        stats.append(
            events_pb2.ContextSection(
                key=MEMORY_KEY, label=MEMORY_LABEL, estimated_tokens=estimate_tokens(text), count=len(memory)
            )
        )
    messages: list[tpb.Message] = []
    if summary:
        summary_text = summary_message_text(summary)
        messages.append(
            tpb.Message(
                message_id=0,
                session_id=session_id,
                role=tpb.MESSAGE_ROLE_SYSTEM,
                content=[tpb.ContentPart(text=summary_text)],
                status=tpb.MESSAGE_STATUS_COMPLETE,
            )
        )
        stats.append(
            events_pb2.ContextSection(
                key="summary",
                label="Session summary",
                estimated_tokens=estimate_message_tokens("system", summary_text),
                count=1,
            )
        )
    if entry is not None:
        # Before the first message after the boundary: the history starts at a whole turn and its view
        # keeps no tool result apart from its call, so no call is separated from its result here.
        messages.append(entry.message(session_id))
        stats.append(
            events_pb2.ContextSection(key=ENTRY_KEY, label=ENTRY_LABEL, estimated_tokens=entry.tokens, count=1)
        )
    messages.extend(loaded.message for loaded in history.view)
    stats.append(
        events_pb2.ContextSection(
            key="messages", label="Messages", estimated_tokens=history.tokens, count=len(history.view)
        )
    )
    manifest = events_pb2.ContextManifest(
        sections=stats,
        memory_ids=[entry.memory_id for entry in memory],
        effective_window_tokens=window_tokens,
        estimated_total_tokens=sum(stat.estimated_tokens for stat in stats),
        tokens_are_estimates=True,
        omitted_message_count=omitted_messages,
        clipped_message_count=sum(1 for loaded in history.view if loaded.message_id in history.clipped_ids),
    )
    return ModelRequest("".join(texts), messages, bounded(manifest, manifest_max_bytes))


def manifest_json(manifest: events_pb2.ContextManifest) -> str:
    """The manifest as published in `context_window` events (and measured against the size bound)."""
    return json_format.MessageToJson(manifest, indent=None)


# Labels are display text: shortened to this, then dropped, when even without memory ids the
# manifest is too large (32 labels of 80 CJK characters escape to far more than 8 KB).
SHORT_LABEL_CHARS = 16


def _size(manifest: events_pb2.ContextManifest) -> int:
    return len(manifest_json(manifest).encode())


def bounded(manifest: events_pb2.ContextManifest, max_bytes: int) -> events_pb2.ContextManifest:
    """Fit the serialized manifest in `max_bytes`: drop memory ids from the end first, then shorten
    the section labels, then drop them. Keys and figures always stay."""
    if _size(manifest) <= max_bytes:
        return manifest
    trimmed = events_pb2.ContextManifest()
    trimmed.CopyFrom(manifest)
    trimmed.trimmed = True
    while trimmed.memory_ids and _size(trimmed) > max_bytes:
        trimmed.memory_ids.pop()
    for length in (SHORT_LABEL_CHARS, 0):
        if _size(trimmed) <= max_bytes:
            break
        for section in trimmed.sections:
            section.label = section.label[:length]
    return trimmed
