"""A HandoffRead answer and the page that builds it within the output budget.

The budget is on the wrapped text the model reads, the JSON of ``{entries, complete, next_cursor,
warning}``: at most 16 KiB of UTF-8 per call (seed 000 §7.2), escapes included. Text handed out is
cut on UTF-8 code point boundaries, never inside a character.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OUTPUT_BYTES = 16 * 1024
# Kept free on every page for the envelope, the cursor (page tokens are at most 1024 characters) and
# the warning.
MAX_WARNING_BYTES = 512
_ENVELOPE_RESERVE = 160 + 1024 + MAX_WARNING_BYTES


@dataclass(frozen=True)
class Entry:
    """One entry: the ref to read it by, what kind of thing it names, and its readable text."""

    ref: str
    kind: str
    text: str


@dataclass(frozen=True)
class AssetImage:
    """An image asset's original bytes (checked against its sha256), for the runtime's image budget."""

    media_type: str
    data: bytes


@dataclass(frozen=True)
class ToolResult:
    """One call's answer. `complete` is True only when every candidate was listed, scanned or read."""

    entries: tuple[Entry, ...]
    complete: bool
    next_cursor: str = ""
    warning: str = ""
    image: AssetImage | None = field(default=None, repr=False)

    def wrapped(self) -> str:
        """The text the model reads: the answer as JSON (the image travels beside it)."""
        return json.dumps(
            {
                "entries": [{"ref": e.ref, "kind": e.kind, "text": e.text} for e in self.entries],
                "complete": self.complete,
                "next_cursor": self.next_cursor,
                "warning": self.warning,
            },
            ensure_ascii=False,
        )


def encoded_size(entry: Entry) -> int:
    """The bytes an entry adds to the wrapped text (with its separating comma)."""
    return len(json.dumps({"ref": entry.ref, "kind": entry.kind, "text": entry.text}, ensure_ascii=False).encode()) + 2


def utf8_start(data: bytes, index: int) -> int:
    """`index` moved forward past continuation bytes: the start of a code point."""
    while 0 < index < len(data) and data[index] & 0xC0 == 0x80:
        index += 1
    return index


def utf8_end(data: bytes, index: int) -> int:
    """`index` moved back over continuation bytes, so data[:index] ends on a whole code point."""
    while 0 < index < len(data) and data[index] & 0xC0 == 0x80:
        index -= 1
    return index


class Page:
    """Entries collected up to `limit` entries and the output budget."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: list[Entry] = []
        self._room = OUTPUT_BYTES - _ENVELOPE_RESERVE

    @property
    def room(self) -> int:
        """Bytes of wrapped text still free for entries."""
        return self._room

    def add(self, entry: Entry) -> bool:
        """Add `entry` if it fits; whether it did."""
        size = encoded_size(entry)
        if len(self.entries) >= self.limit or size > self._room:
            return False
        self.entries.append(entry)
        self._room -= size
        return True

    def add_text(self, ref: str, kind: str, data: bytes, start: int) -> int:
        """Add an entry holding as much of data[start:] as fits (cut on a code point boundary); the
        offset where the rest begins (== start when nothing fit)."""
        overhead = encoded_size(Entry(ref, kind, ""))
        end = utf8_end(data, min(len(data), start + self._room - overhead))
        while end > start:
            entry = Entry(ref, kind, data[start:end].decode("utf-8", errors="replace"))
            excess = encoded_size(entry) - self._room
            if excess <= 0 and self.add(entry):
                return end
            # Escapes made the text longer than its bytes: shrink by at least the excess.
            end = utf8_end(data, end - max(excess, 1))
        return start

    def result(self, complete: bool, next_cursor: str = "", warning: str = "") -> ToolResult:
        """The answer of this page."""
        shown = warning.encode()[:MAX_WARNING_BYTES].decode(errors="ignore")
        return ToolResult(tuple(self.entries), complete, next_cursor, shown)
