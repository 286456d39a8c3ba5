"""Structured-item requests: the format in which a service asks for schema-v2 items instead of prose.

A request is structured when its first message is a system message whose first line is
``continuum-items/v2 {json}`` (`structured_header`), and its last message is a user message holding a
JSON object ``{"inputs": [...]}``. The header names the mode, the legal sections and statuses, and
`hints`: which section and status the offline provider gives each kind of line it recognises. The
service that sends the request owns those names; this module only carries them.

- mode ``extract``: each input is ``{"alias", "role", "text"}``, a piece of the original history;
  ``"context": true`` marks one shown only for continuity (already extracted by an earlier request).
- mode ``condense``: each input is ``{"alias", "section", "status", "content"}``, an item of a lower layer.

The answer is ``{"schemaVersion": 2, "items": [{"section", "status", "content", "evidence": [alias, …]}]}``.
The sending service validates it; `OfflineProvider` answers such requests deterministically here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

from .base import ChatMessage

__all__ = ["HINT_KINDS", "ITEMS_PROTOCOL", "StructuredRequest", "parse_structured_request", "structured_header"]

ITEMS_PROTOCOL = "continuum-items/v2"
# What the offline provider can tell apart in a line, in the order it checks them (first match wins);
# "request" is the first line of a user-written input, "other" everything else.
HINT_KINDS = ("error", "command", "file", "note", "request", "other")

Mode = Literal["extract", "condense"]


@dataclass(frozen=True)
class StructuredRequest:
    """A parsed structured request: its header and its inputs (as the sender wrote them)."""

    mode: Mode
    sections: tuple[str, ...]
    statuses: tuple[str, ...]
    # kind (one of HINT_KINDS) -> (section, status)
    hints: Mapping[str, tuple[str, str]]
    inputs: tuple[Mapping[str, Any], ...]


def structured_header(
    mode: Mode, *, sections: Sequence[str], statuses: Sequence[str], hints: Mapping[str, tuple[str, str]]
) -> str:
    """The first line of a structured request's system message. Every kind in HINT_KINDS needs a hint."""
    missing = [kind for kind in HINT_KINDS if kind not in hints]
    if missing:
        raise ValueError(f"structured header lacks hints for {', '.join(missing)}")
    for section, status in hints.values():
        if section not in sections or status not in statuses:
            raise ValueError("a hint names a section or status the header does not list")
    header = {
        "mode": mode,
        "sections": list(sections),
        "statuses": list(statuses),
        "hints": {kind: list(hints[kind]) for kind in HINT_KINDS},
    }
    return f"{ITEMS_PROTOCOL} {json.dumps(header, separators=(',', ':'))}"


def parse_structured_request(messages: Sequence[ChatMessage]) -> StructuredRequest | None:
    """The structured request `messages` make, or None when they are an ordinary (prose) request.

    Raises ValueError when the header is there but the request is malformed: a sender bug, not prose.
    """
    if not messages or messages[0].role != "system":
        return None
    first_line = messages[0].content.split("\n", 1)[0]
    if not first_line.startswith(ITEMS_PROTOCOL + " "):
        return None
    try:
        header = json.loads(first_line.removeprefix(ITEMS_PROTOCOL + " "))
        payload = json.loads(messages[-1].content) if messages[-1].role == "user" else None
    except ValueError as exc:
        raise ValueError("structured request is not valid JSON") from exc
    if not isinstance(header, dict) or not isinstance(payload, dict):
        raise ValueError("structured request lacks its header or its inputs")
    mode, sections, statuses, hints = (header.get(key) for key in ("mode", "sections", "statuses", "hints"))
    inputs = payload.get("inputs")
    if mode not in ("extract", "condense") or not _strings(sections) or not _strings(statuses):
        raise ValueError("structured request header is malformed")
    if not isinstance(hints, dict):
        raise ValueError("structured request header lacks its hints")
    if not isinstance(inputs, list) or not all(isinstance(i, dict) and isinstance(i.get("alias"), str) for i in inputs):
        raise ValueError("structured request inputs are malformed")
    parsed_hints: dict[str, tuple[str, str]] = {}
    for kind in HINT_KINDS:
        pair = hints.get(kind)
        if not (_strings(pair) and len(pair) == 2 and pair[0] in sections and pair[1] in statuses):
            raise ValueError(f"structured request hint for {kind} is malformed")
        parsed_hints[kind] = (pair[0], pair[1])
    return StructuredRequest(
        mode=mode,
        sections=tuple(sections),
        statuses=tuple(statuses),
        hints=parsed_hints,
        inputs=tuple(inputs),
    )


def _strings(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and bool(value) and all(isinstance(item, str) for item in value)
