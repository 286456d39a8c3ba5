"""The asset action: an attachment's metadata and a controlled way to its original.

The original is the package's own copy (``snapshot/assets/<sha256>``), found through its files.jsonl
row. One over 1,125,000 bytes is never read: HANDOFF_ASSET_TOO_LARGE says so and that it is kept.
An image (PNG, JPEG, GIF, WebP) is handed to the runtime as bytes checked against their sha256, for
its image budget; a text attachment is read as text, paged like a part; any other type is described
and not read (no base64 pages pretending the model can understand it).
"""

from __future__ import annotations

import re

from continuum_handoff_read.arguments import Arguments
from continuum_handoff_read.cursors import CursorRefused, Cursors, Position
from continuum_handoff_read.errors import AssetTooLarge, BadRequest, RefNotFound
from continuum_handoff_read.manifest import FILES, FileRow, Package, file_row
from continuum_handoff_read.results import AssetImage, Entry, Page, ToolResult

# The runtime's image budget for one original (seed 000 §7.2).
MAX_ASSET_BYTES = 1_125_000
IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
TEXT_TYPES = frozenset({"application/json", "application/xml", "application/x-yaml", "application/yaml"})
_ASSET = re.compile(r"a_([0-9a-f]{64})")


def _located(package: Package, ref: str, digest: str) -> tuple[int, FileRow]:
    for line in package.lines_containing(FILES, digest.encode()):
        row = file_row(line.data)
        if row.kind == "asset" and row.ref == ref:
            return line.offset, row
    raise RefNotFound(f"{ref} is not an attachment of this package")


def _media_type(row: FileRow) -> str:
    return row.media_type.split(";", 1)[0].strip().lower()


def asset(package: Package, arguments: Arguments, start: Position | None, cursors: Cursors) -> ToolResult:
    """The attachment `arguments.ref` names: metadata, and its original within the budgets."""
    matched = _ASSET.fullmatch(arguments.ref)
    if matched is None:
        raise BadRequest("ref", "is not an attachment ref (a_<sha256>)")
    if start is not None and start.phase != "file":
        raise CursorRefused("cursor", "was not issued by an asset read")
    offset, row = _located(package, arguments.ref, matched.group(1))
    media_type = _media_type(row)
    described = (
        f"attachment {row.attachment_id} ({row.media_type or 'unknown type'}, {row.size} bytes, sha256 "
        f"{row.sha256}) of record r_{row.record_ref}"
    )
    if row.size > MAX_ASSET_BYTES:
        raise AssetTooLarge(
            f"{described} is over the {MAX_ASSET_BYTES}-byte limit of an original: it was not read; the "
            "original is kept in the package"
        )
    page = Page(2)
    if media_type in IMAGE_TYPES:
        data = package.files.read_verified(row.path, row.size, row.sha256, package.deadline)
        page.add(Entry(arguments.ref, "asset", f"{described}: the image is attached"))
        result = page.result(True)
        return ToolResult(result.entries, True, image=AssetImage(media_type, data))
    if media_type.startswith("text/") or media_type in TEXT_TYPES:
        data = package.files.read_verified(row.path, row.size, row.sha256, package.deadline)
        at = start.at if start is not None else 0
        if at > len(data):
            raise CursorRefused("cursor", "points past the end of the attachment")
        if at == 0:
            page.add(Entry(arguments.ref, "asset", described))
        end = page.add_text(arguments.ref, "asset", data, at)
        if end >= len(data):
            return page.result(True)
        return page.result(False, cursors.issue(arguments, Position(phase="file", row=offset, at=end)),
                           "The text continues: call again with next_cursor.")  # fmt: skip
    page.add(Entry(arguments.ref, "asset", f"{described}: not read"))
    return page.result(
        True,
        warning=f"The type {row.media_type or 'unknown'} is not supported here: it was not read; the original is kept.",
    )
