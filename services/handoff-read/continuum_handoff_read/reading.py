"""The read action: a record's text, one text part, a raw record, or a handoff item's readable
projection, paged on UTF-8 boundaries within the output budget.

Refs are the package's own: ``r_<recordRef>`` (the record's text parts read as one text),
``r_<recordRef>:p<n>`` (one part), ``r_<recordRef>:raw`` (the original JSON) and ``it_<id>`` (an item
of the handoff's details). A ref is found by looking for its digest in the manifest (bytes.find over
buffers: no index), so a ref of another package, or a made-up one, is simply not registered here.
Every byte handed out comes from a file checked against its registered sha256.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from continuum_handoff_read.arguments import Arguments
from continuum_handoff_read.cursors import CursorRefused, Cursors, Position
from continuum_handoff_read.errors import BadRequest, RefNotFound
from continuum_handoff_read.files import read_range
from continuum_handoff_read.manifest import DETAILS, FILES, FileRow, Line, Package, detail_row, file_row
from continuum_handoff_read.results import Entry, Page, ToolResult

_RECORD = re.compile(r"r_([0-9a-f]{64})")
_PART = re.compile(r"r_([0-9a-f]{64}):p(0|[1-9][0-9]{0,8})")
_RAW = re.compile(r"r_([0-9a-f]{64}):raw")
_ITEM = re.compile(r"it_[0-9a-f]{32}")
_ASSET = re.compile(r"a_[0-9a-f]{64}")
CONTINUES = "The text continues: call again with next_cursor."


@dataclass(frozen=True)
class _Segment:
    """Bytes of one part placed in a page: its files.jsonl line, the part offset they start at."""

    row: int
    at: int
    data: bytes


def read(package: Package, arguments: Arguments, start: Position | None, cursors: Cursors) -> ToolResult:
    """One page of the thing `arguments.ref` names."""
    ref = arguments.ref
    if start is not None and start.phase != "file":
        raise CursorRefused("cursor", "was not issued by a read")
    page = Page(1)
    if matched := _RECORD.fullmatch(ref):
        position = _record(package, page, ref, matched.group(1), start)
    elif matched := _PART.fullmatch(ref):
        position = _single(
            package, page, ref, "part", _row(package, matched.group(1), lambda row: row.ref == ref), start
        )
    elif matched := _RAW.fullmatch(ref):
        raw = _row(package, matched.group(1), lambda row: row.kind == "raw")
        position = _single(package, page, ref, "raw", raw, start)
    elif _ITEM.fullmatch(ref):
        position = _item(package, page, ref, start)
    elif _ASSET.fullmatch(ref):
        raise BadRequest("ref", "names an attachment: read it with action asset")
    else:
        raise BadRequest("ref", "is not a ref of this package's kinds (r_<ref>, r_<ref>:p<n>, r_<ref>:raw, it_<id>)")
    if position is None:
        return page.result(True)
    return page.result(False, cursors.issue(arguments, position), CONTINUES)


def _group(package: Package, digest: str, start: int | None = None) -> Iterator[tuple[Line, FileRow]]:
    """The files.jsonl rows of record `digest` (all together in the manifest), from `start` when a
    cursor gives it; RefNotFound when the record is not registered here."""
    if start is None:
        first = next(
            (
                line
                for line in package.lines_containing(FILES, digest.encode())
                if file_row(line.data).record_ref == digest
            ),
            None,
        )
        if first is None:
            raise RefNotFound(f"r_{digest} is not registered in this package")
        start = first.offset
    for line in package.lines(FILES, start):
        row = file_row(line.data)
        if row.record_ref != digest:
            return
        yield line, row


def _row(package: Package, digest: str, wanted: Any) -> tuple[Line, FileRow]:
    for line, row in _group(package, digest):
        if wanted(row):
            return line, row
    raise RefNotFound(f"r_{digest} has no such file in this package")


def _single(
    package: Package, page: Page, ref: str, kind: str, located: tuple[Line, FileRow], start: Position | None
) -> Position | None:
    """A page of one registered file (a part or a raw record), from the cursor's offset on."""
    line, row = located
    at = start.at if start is not None else 0
    if at > row.size:
        raise CursorRefused("cursor", "points past the end of its file")
    package.files.verify(row.path, row.size, row.sha256, package.deadline)
    with package.files.open(row.path, row.size) as descriptor:
        data = read_range(descriptor, at, min(row.size - at, page.room))
    end = at + page.add_text(ref, kind, data, 0)
    return None if end >= row.size else Position(phase="file", row=line.offset, at=end)


def _record(package: Package, page: Page, ref: str, digest: str, start: Position | None) -> Position | None:
    """A page of a record's text parts read as one text (merge cuts them on code point boundaries)."""
    segments: list[_Segment] = []
    room = page.room
    at = start.at if start is not None else 0
    following: Position | None = None  # the first byte this page leaves unread
    for line, row in _group(package, digest, start.row if start is not None else None):
        if row.kind != "text":
            continue
        if room <= 0:
            following = Position(phase="file", row=line.offset, at=0)
            break
        part = package.files.read_verified(row.path, row.size, row.sha256, package.deadline)
        if at > len(part):
            raise CursorRefused("cursor", "points past the end of its part")
        taken = part[at : at + room]
        segments.append(_Segment(line.offset, at, taken))
        room -= len(taken)
        if at + len(taken) < len(part):
            following = Position(phase="file", row=line.offset, at=at + len(taken))
            break
        at = 0
    text = b"".join(segment.data for segment in segments)
    consumed = page.add_text(ref, "record", text, 0)
    if not page.entries:
        page.add(Entry(ref, "record", ""))  # a record whose text is empty
    for segment in segments:
        if consumed < len(segment.data):
            return Position(phase="file", row=segment.row, at=segment.at + consumed)
        consumed -= len(segment.data)
    return following


def _item(package: Package, page: Page, ref: str, start: Position | None) -> Position | None:
    """A page of a handoff item's readable projection: section, status, content and its evidence."""
    item = None
    row = 0
    for line in package.lines(DETAILS, start.row if start is not None else 0):
        detail = detail_row(line.data)
        found = next((entry for entry in package.unit_items(detail) if entry["itemId"] == ref), None)
        if found is not None:
            item, row = found, line.offset
            break
        if start is not None:
            break
    if item is None:
        raise RefNotFound(f"{ref} is not an item of this package's handoff")
    projection = _projection(item).encode()
    at = start.at if start is not None else 0
    if at > len(projection):
        raise CursorRefused("cursor", "points past the end of the item")
    end = page.add_text(ref, "item", projection, at)
    return None if end >= len(projection) else Position(phase="file", row=row, at=end)


def _projection(item: dict[str, Any]) -> str:
    lines = [f"[{item['section']} / {item['status']}] item {item['itemId']}", item["content"], "evidence:"]
    for evidence in item["evidence"]:
        span = evidence.get("utf16")
        where = f", UTF-16 {span[0]}-{span[1]}" if isinstance(span, list) and len(span) == 2 else ""
        lines.append(f"- {evidence.get('ref', '')} (session {evidence.get('sessionId', '')}{where})")
    return "\n".join(lines) + "\n"
