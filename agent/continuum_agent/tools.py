"""Read-only tools over a session's working directory: list, read, literal search.

Every path is relative to the working directory and stays beneath it: absolute paths and `..` parts
are refused, and a path whose real location (symlinks resolved) leaves the directory is refused too,
so a symlink cannot lead a tool out. A result is a JSON object; one cut short says `"truncated": true`
(transcript flags such TOOL messages). Failures are results too (`{"error": ...}`), for the model.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

LIST_DIRECTORY = "list_directory"
READ_FILE = "read_file"
SEARCH_TEXT = "search_text"

# Entries one listing returns; files one search opens; matches it reports; bytes of a file it reads.
MAX_ENTRIES = 500
MAX_SEARCHED_FILES = 2000
MAX_MATCHES = 100
MAX_SEARCHED_FILE_BYTES = 1024 * 1024
MAX_QUERY_CHARS = 1000
MAX_LINE_CHARS = 300

# OpenAI-style function definitions, as the model sees them.
DEFINITIONS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": LIST_DIRECTORY,
            "description": "List the entries of a directory of the working directory.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Relative path; '.' by default."}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": READ_FILE,
            "description": "Read a UTF-8 text file of the working directory.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Relative path of the file."}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": SEARCH_TEXT,
            "description": "Find lines containing a literal string in the files beneath a directory.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "The literal text to find."},
                    "path": {"type": "string", "description": "Relative directory; '.' by default."},
                },
                "required": ["query"],
            },
        },
    },
]


class ToolRefused(Exception):
    """The call cannot be served (bad arguments, a path outside the directory, not found)."""


@dataclass(frozen=True)
class Workspace:
    """The real path of a session's working directory, and the cap on a result's size."""

    root: Path
    max_result_bytes: int

    @classmethod
    def of(cls, working_directory: str, max_result_bytes: int) -> Workspace | None:
        """The workspace of a session, or None when it names no existing directory."""
        if not working_directory:
            return None
        root = Path(working_directory)
        if not root.is_absolute():
            return None
        try:
            real = root.resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        return cls(real, max_result_bytes) if real.is_dir() else None

    def resolve(self, relative: str) -> Path:
        """The real path of `relative`, refused unless it lies beneath the root."""
        if not isinstance(relative, str) or "\x00" in relative:
            raise ToolRefused("path must be a string")
        parts = PurePosixPath(relative or ".")
        if parts.is_absolute() or relative.startswith("\\"):
            raise ToolRefused("path must be relative to the working directory")
        if ".." in parts.parts:
            raise ToolRefused("path must not contain '..'")
        try:
            real = (self.root / parts).resolve(strict=True)
        except FileNotFoundError:
            raise ToolRefused(f"{relative}: no such file or directory") from None
        except (OSError, RuntimeError):
            raise ToolRefused(f"{relative}: cannot be resolved") from None
        if real != self.root and not real.is_relative_to(self.root):
            raise ToolRefused(f"{relative}: leads outside the working directory")
        return real

    def relative(self, path: Path) -> str:
        """`path` as the model names it."""
        return path.relative_to(self.root).as_posix() or "."


def run_tool(workspace: Workspace | None, name: str, arguments: str) -> str:
    """The JSON result of one tool call (blocking: run it in a worker thread)."""
    try:
        if workspace is None:
            raise ToolRefused("the session has no working directory")
        try:
            parsed = json.loads(arguments or "{}")
        except ValueError:
            raise ToolRefused("arguments are not JSON") from None
        if not isinstance(parsed, dict):
            raise ToolRefused("arguments must be a JSON object")
        tool = _TOOLS.get(name)
        if tool is None:
            raise ToolRefused(f"unknown tool {name[:64]!r}")
        result = tool(workspace, parsed)
    except ToolRefused as refused:
        result = {"error": str(refused)}
    return json.dumps(result, ensure_ascii=False)


def _string_argument(arguments: dict[str, Any], key: str, default: str | None = None) -> str:
    value = arguments.get(key, default)
    if not isinstance(value, str):
        raise ToolRefused(f"{key} must be a string")
    return value


def _encoded_size(item: dict[str, Any]) -> int:
    """The bytes `item` adds to a result's JSON (with its separator): lists stop at the result's byte cap,
    not only at their count, so long or non-ASCII names and lines still fit and say they were cut."""
    return len(json.dumps(item, ensure_ascii=False).encode()) + 2


def _list_directory(workspace: Workspace, arguments: dict[str, Any]) -> dict[str, Any]:
    directory = workspace.resolve(_string_argument(arguments, "path", "."))
    if not directory.is_dir():
        raise ToolRefused("path is not a directory")
    entries: list[dict[str, Any]] = []
    truncated = False
    used = 0
    with os.scandir(directory) as scanned:
        # The first MAX_ENTRIES names (plus one, to know there are more), without holding every entry
        # of a huge directory.
        for entry in heapq.nsmallest(MAX_ENTRIES + 1, scanned, key=lambda e: e.name):
            if len(entries) == MAX_ENTRIES:
                truncated = True
                break
            kind = "symlink" if entry.is_symlink() else "directory" if entry.is_dir() else "file"
            item: dict[str, Any] = {"name": entry.name, "type": kind}
            if kind == "file":
                item["size"] = entry.stat(follow_symlinks=False).st_size
            used += _encoded_size(item)
            if used > workspace.max_result_bytes:
                truncated = True
                break
            entries.append(item)
    return {"path": workspace.relative(directory), "entries": entries, "truncated": truncated}


def _read_file(workspace: Workspace, arguments: dict[str, Any]) -> dict[str, Any]:
    path = workspace.resolve(_string_argument(arguments, "path"))
    if not path.is_file():
        raise ToolRefused("path is not a regular file")
    with path.open("rb") as handle:
        data = handle.read(workspace.max_result_bytes + 1)
    truncated = len(data) > workspace.max_result_bytes
    text = data[: workspace.max_result_bytes].decode("utf-8", errors="replace")
    return {"path": workspace.relative(path), "text": text, "truncated": truncated}


def _files_beneath(workspace: Workspace, directory: Path) -> Iterator[Path]:
    for current, directories, files in os.walk(directory, followlinks=False):
        directories.sort()
        for name in sorted(files):
            candidate = Path(current) / name
            if candidate.is_symlink():
                # A symlinked file is searched only where its target lies beneath the root.
                try:
                    target = candidate.resolve(strict=True)
                except (OSError, RuntimeError):
                    continue
                if not target.is_relative_to(workspace.root) or not target.is_file():
                    continue
            yield candidate


def _search_text(workspace: Workspace, arguments: dict[str, Any]) -> dict[str, Any]:
    query = _string_argument(arguments, "query")
    if not query or len(query) > MAX_QUERY_CHARS:
        raise ToolRefused(f"query must be 1 to {MAX_QUERY_CHARS} characters")
    directory = workspace.resolve(_string_argument(arguments, "path", "."))
    if not directory.is_dir():
        raise ToolRefused("path is not a directory")
    matches: list[dict[str, Any]] = []
    searched = 0
    truncated = False
    used = 0
    for path in _files_beneath(workspace, directory):
        if searched == MAX_SEARCHED_FILES or len(matches) == MAX_MATCHES:
            truncated = True
            break
        searched += 1
        try:
            with path.open("rb") as handle:
                data = handle.read(MAX_SEARCHED_FILE_BYTES)
        except OSError:
            continue
        if b"\x00" in data[:8192]:
            continue
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if query in line:
                match = {"path": workspace.relative(path), "line": number, "text": line[:MAX_LINE_CHARS]}
                used += _encoded_size(match)
                if used > workspace.max_result_bytes:
                    return {"query": query, "matches": matches, "searchedFiles": searched, "truncated": True}
                matches.append(match)
                if len(matches) == MAX_MATCHES:
                    break
    return {"query": query, "matches": matches, "searchedFiles": searched, "truncated": truncated}


_TOOLS: dict[str, Callable[[Workspace, dict[str, Any]], dict[str, Any]]] = {
    LIST_DIRECTORY: _list_directory,
    READ_FILE: _read_file,
    SEARCH_TEXT: _search_text,
}
