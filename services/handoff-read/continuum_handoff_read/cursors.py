"""HandoffRead cursors: where the next page of a list, search or read resumes, authenticated.

A cursor is one of continuum_runtime's page tokens (HMAC-SHA256 under the service's key over the
bound parameters and the position): it is bound to the package version, the action, the ref, the
query, the filters and the limit of the call that issued it, and carries the manifest and file
offsets to resume from. A forged or altered offset, another package's cursor, or a cursor reused with
any other parameter fails the MAC and is refused as HANDOFF_CURSOR_INVALID; nothing is read for it.
"""

from __future__ import annotations

from typing import Literal

from continuum_handoff_read.arguments import Arguments
from continuum_handoff_read.errors import CursorInvalid
from continuum_runtime.paging import Cursor, PageTokenInvalid, PageTokens


class CursorRefused(CursorInvalid, PageTokenInvalid):
    """HANDOFF_CURSOR_INVALID raised by the shared page-token code (which names the field)."""

    reason = "HANDOFF_CURSOR_INVALID"


class Position(Cursor):
    """Where a page resumes. `phase` names the stream (list: sources, sections, attachments, records,
    items; search: records, items; read: a file); `row` is the byte offset of a manifest line, `at`
    a byte offset in the row's file (or an item index), `skip` how many matches of the buffer starting
    at `at` were already returned, `previous` the offset of the row before `row` (-1: none), whose tail
    a search carries over into `row`, and `record` the offset of the records.jsonl line of `row`'s
    record (a search narrowed to a source walks both manifests together)."""

    phase: Literal["sources", "sections", "attachments", "records", "items", "file"]
    row: int = 0
    at: int = 0
    skip: int = 0
    previous: int = -1
    record: int = 0


class Cursors:
    """Issues and opens the cursors of one package version under the service's key."""

    def __init__(self, key: bytes, package_version: str) -> None:
        self._tokens = PageTokens(key, Position, CursorRefused)
        self._package_version = package_version

    def issue(self, arguments: Arguments, position: Position) -> str:
        """The cursor resuming `arguments`' call at `position`."""
        return self._tokens.issue(position, arguments.bound(self._package_version))

    def open(self, arguments: Arguments) -> Position | None:
        """The position in `arguments.cursor` (None without one); HANDOFF_CURSOR_INVALID unless this
        service issued it for exactly these parameters of this package version."""
        position = self._tokens.open(arguments.cursor, arguments.bound(self._package_version), field="cursor")
        if (
            position is not None
            and min(position.row, position.at, position.skip, position.previous + 1, position.record) < 0
        ):
            raise CursorRefused("cursor", "holds a negative offset")
        return position
