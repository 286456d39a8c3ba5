"""The list action: a directory generated from the flat manifests, a page at a time.

Without filters: the package's root sources (manifest.json), the handoff's sections with their counts
(overview.json), then every attachment (files.jsonl). With `source_id`: that source tree's records,
then the handoff items whose evidence comes from it. With `section`: that section's items (of the
source, when both are given). Nothing is kept between pages but the cursor's offsets; a page reads at
most SCAN_BYTES of manifests and details.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from continuum_handoff_read.arguments import SECTIONS, Arguments
from continuum_handoff_read.cursors import CursorRefused, Cursors, Position
from continuum_handoff_read.manifest import (
    DETAILS,
    FILES,
    RECORDS,
    Package,
    detail_row,
    file_row,
    item_selected,
    record_row,
)
from continuum_handoff_read.results import Entry, Page, ToolResult, utf8_end
from continuum_handoff_read.search import SCAN_BYTES

DEFAULT_LIMIT = 50
# What a directory line shows of an item's content.
ITEM_PREVIEW_BYTES = 300

_Phase = Callable[["_Listing", Position], Position | None]


class _Listing:
    def __init__(self, package: Package, arguments: Arguments, page: Page) -> None:
        self.package = package
        self.arguments = arguments
        self.page = page
        self.members = package.tree(arguments.source_id) if arguments.source_id else None
        self.read = 0

    def sources(self, start: Position) -> Position | None:
        for index, source in enumerate(self.package.sources()):
            if index < start.at:
                continue
            root = str(source.get("rootSessionId", ""))
            text = (
                f"source session {root}: {source.get('sessionCount', 0)} sessions, copied up to message "
                f"{source.get('lastMessageId', 0)}; list or search with source_id={root} to narrow to it"
            )
            if not self.page.add(Entry(root, "source", text)):
                return Position(phase="sources", at=index)
        return None

    def sections(self, start: Position) -> Position | None:
        by_section = self.package.overview().get("bySection")
        by_section = by_section if isinstance(by_section, dict) else {}
        for index, section in enumerate(SECTIONS):
            if index < start.at:
                continue
            counts = by_section.get(section)
            counts = counts if isinstance(counts, dict) else {}
            total = sum(count for count in counts.values() if isinstance(count, int))
            described = ", ".join(f"{count} {status}" for status, count in sorted(counts.items()))
            text = (
                f"section {section}: {total} items ({described}); list or search with section={section}"
                if total
                else f"section {section}: nothing recorded"
            )
            if not self.page.add(Entry(section, "section", text)):
                return Position(phase="sections", at=index)
        return None

    def attachments(self, start: Position) -> Position | None:
        for line in self.package.lines_containing(FILES, b'"asset"', start.row):
            if line.offset - start.row > SCAN_BYTES:
                return Position(phase="attachments", row=line.offset)
            row = file_row(line.data)
            if row.kind != "asset":
                continue
            text = (
                f"attachment {row.attachment_id} ({row.media_type or 'unknown type'}, {row.size} bytes) in record "
                f"r_{row.record_ref}; read it with action asset"
            )
            if not self.page.add(Entry(row.ref, "asset", text)):
                return Position(phase="attachments", row=line.offset)
        return None

    def records(self, start: Position) -> Position | None:
        for line in self.package.lines(RECORDS, start.row):
            if line.offset - start.row > SCAN_BYTES:
                return Position(phase="records", row=line.offset)
            record = record_row(line.data)
            if self.members is not None and record.session_id not in self.members:
                continue
            text = (
                f"{record.kind} record {record.record_id} of session {record.session_id} ({record.role}, "
                f"{record.created_at or 'no time'}, {record.text_parts} text parts)"
            )
            if not self.page.add(Entry(f"r_{record.record_ref}", "record", text)):
                return Position(phase="records", row=line.offset)
        return None

    def items(self, start: Position) -> Position | None:
        for line in self.package.lines(DETAILS, start.row):
            detail = detail_row(line.data)
            first = start.at if line.offset == start.row else 0
            size = self.package.files.size(detail.path)
            if self.read and self.read + size > SCAN_BYTES:
                return Position(phase="items", row=line.offset, at=first)
            self.read += size
            items = self.package.unit_items(detail)
            for index in range(first, len(items)):
                entry = self._item(items[index])
                if entry is not None and not self.page.add(entry):
                    return Position(phase="items", row=line.offset, at=index)
        return None

    def _item(self, item: dict[str, Any]) -> Entry | None:
        if not item_selected(item, self.arguments.section, self.members):
            return None
        content = item["content"].encode()
        shown = content[: utf8_end(content, ITEM_PREVIEW_BYTES)].decode(errors="replace")
        more = "…" if len(content) > ITEM_PREVIEW_BYTES else ""
        return Entry(item["itemId"], "item", f"[{item['section']} / {item['status']}] {shown}{more}")


_PHASES: dict[str, _Phase] = {
    "sources": _Listing.sources,
    "sections": _Listing.sections,
    "attachments": _Listing.attachments,
    "records": _Listing.records,
    "items": _Listing.items,
}


def list_directory(package: Package, arguments: Arguments, start: Position | None, cursors: Cursors) -> ToolResult:
    """One page of the directory the arguments ask for."""
    if arguments.section:
        phases = ["items"]
    elif arguments.source_id:
        phases = ["records", "items"]
    else:
        phases = ["sources", "sections", "attachments"]
    start = start or Position(phase=phases[0])  # type: ignore[arg-type]
    if start.phase not in phases:
        raise CursorRefused("cursor", "was not issued by this listing")
    listing = _Listing(package, arguments, Page(arguments.limit or DEFAULT_LIMIT))
    for phase in phases[phases.index(start.phase) :]:
        stop = _PHASES[phase](listing, start if phase == start.phase else Position(phase=phase))  # type: ignore[arg-type]
        if stop is not None:
            return listing.page.result(
                False, cursors.issue(arguments, stop), "More entries follow: continue with next_cursor."
            )
    return listing.page.result(True)
