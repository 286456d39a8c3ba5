"""The reference agent's long-term memory: a Markdown file in the session's working directory.

`MEMORY.md` (the name is `AGENT_MEMORY_FILE`) at the top of the working directory holds one entry per
bullet: a line starting with "- " or "* ", plus the indented lines under it. Everything else (headings,
prose) is ignored. An entry's id is a hash of its text (`mem-` and 16 hex digits of its SHA-256), so it
stays the same while the text does, whatever moves around it; an entry repeated word for word counts
once. The agent reads the file once per turn and hands the entries to every BuildContext of the turn;
compaction injects them unless the session's memory switch is off (from the next run on).

Bounded: at most `max_file_bytes` of the file are read (a longer file is cut at the last whole line),
an entry longer than `max_entry_bytes` is left out, and entries are taken in file order until
`max_entries` or `max_total_bytes` would be passed. The file is resolved like a tool's path: a symlink
that leads out of the working directory is not followed. A missing or unreadable file means no memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from continuum.compaction.v1 import compaction_service_pb2 as capi
from continuum_agent.tools import ToolRefused, Workspace

BULLETS = ("- ", "* ")


@dataclass(frozen=True)
class MemoryLimits:
    """How much memory one turn carries."""

    file_name: str
    max_file_bytes: int
    max_entries: int
    max_entry_bytes: int
    max_total_bytes: int


def memory_id(text: str) -> str:
    """The stable id of an entry: a hash of its text."""
    return "mem-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def parse(text: str) -> list[str]:
    """The entries of a memory file's text, in file order, whitespace inside each collapsed."""
    entries: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith(BULLETS):
            current = [stripped[2:].strip()]
            entries.append(current)
        elif current is not None and stripped and line[:1].isspace():
            current.append(stripped)
        else:
            current = None
    return [joined for joined in (" ".join(" ".join(parts).split()) for parts in entries) if joined]


def select(entries: list[str], limits: MemoryLimits) -> list[capi.MemoryEntry]:
    """The entries one request carries: unique, each and all together within the limits."""
    chosen: list[capi.MemoryEntry] = []
    seen: set[str] = set()
    total = 0
    for text in entries:
        size = len(text.encode())
        key = memory_id(text)
        if size > limits.max_entry_bytes or key in seen:
            continue
        if len(chosen) == limits.max_entries or total + size > limits.max_total_bytes:
            break
        seen.add(key)
        total += size
        chosen.append(capi.MemoryEntry(memory_id=key, text=text))
    return chosen


def load(workspace: Workspace | None, limits: MemoryLimits) -> list[capi.MemoryEntry]:
    """The memory entries of a session's working directory (none without a readable memory file)."""
    if workspace is None:
        return []
    try:
        path = workspace.resolve(limits.file_name)
        if not path.is_file():
            return []
        with path.open("rb") as file:
            raw = file.read(limits.max_file_bytes + 1)
    except (ToolRefused, OSError):
        return []
    if len(raw) > limits.max_file_bytes:
        # Cut at the last whole line: a bullet cut in half would be another entry with another id.
        raw = raw[: limits.max_file_bytes].rpartition(b"\n")[0]
    return select(parse(raw.decode("utf-8", errors="replace")), limits)
