"""The package's flat manifests, read streaming and bounded, each checked against its recorded hash.

What merge writes (services/merge: snapshot/layout.py, snapshot/writer.py, extraction/aggregate.py),
as a file contract; the package directory is ``<package root>/<operation id>/``:

- ``handoff/ready.json``: ``snapshotHash`` (the sha256 of ``snapshot/manifest.json``) and ``files``
  (path under ``handoff/`` and sha256 of details.jsonl, overview.json, brief.json, handoff.md, layers).
  Its own sha256 is the operation's handoff hash, which the service verified before calling here.
- ``snapshot/manifest.json``: ``version``, ``sources`` (root session id, session count, last message
  id) and ``streams`` (sha256, line count and bytes of records.jsonl, files.jsonl, occurrences.jsonl,
  gaps.jsonl).
- ``snapshot/records.jsonl``: ``{recordRef, origin: {kind, sessionId, recordId, version}, role,
  createdAt, rawRef, textParts, processingPolicy}`` per record.
- ``snapshot/files.jsonl``: ``{ref, recordRef, part, path, bytes, sha256, kind}`` per file; each
  record's rows together (raw first, then text parts in order, then assets with ``mediaType`` and
  ``attachmentId``), records in records.jsonl's order.
- ``handoff/details.jsonl``: ``{unitId, path, sha256, textPath, textSha256, items, counts}`` per unit;
  ``details/<unit>.json`` holds the unit's items ``{itemId, section, status, content, evidence:
  [{ref, recordRef, part, sessionId, utf16}]}``.

A stream is hashed whole (a buffer at a time, within the call's deadline) before its first row is
used, so every row stands on the chain ready.json -> manifest.json -> stream. Lines are read a buffer
at a time; no stream is ever held whole.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

import orjson

from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import PackageDamaged
from continuum_handoff_read.files import IntactFiles, PackageFiles, read_range

if TYPE_CHECKING:
    from continuum_handoff_read.scanners import Scanners

READY = "handoff/ready.json"
MANIFEST = "snapshot/manifest.json"
OVERVIEW = "handoff/overview.json"
RECORDS = "snapshot/records.jsonl"
FILES = "snapshot/files.jsonl"
DETAILS = "handoff/details.jsonl"
# Where every text part is: ``snapshot/text/<recordRef>-<part>.txt`` (text_part checks it).
TEXT_PARTS = "snapshot/text"
# Bounds on what is parsed whole: the entry files, one manifest line, one unit's details, one raw
# session record (read to learn which tree it belongs to).
ENTRY_FILE_BYTES = 1024 * 1024
MAX_LINE_BYTES = 64 * 1024
DETAIL_FILE_BYTES = 8 * 1024 * 1024
SESSION_RAW_BYTES = 1024 * 1024
BUFFER_BYTES = 1024 * 1024
FIRST_BUFFER_BYTES = 64 * 1024

HEX64 = re.compile(r"[0-9a-f]{64}")
# Merge numbers a record's text parts from 0; nine digits at most.
_MAX_PART = 999_999_999


def _is_hex64(value: object) -> TypeGuard[str]:
    return type(value) is str and len(value) == 64 and not value.strip("0123456789abcdef")


@dataclass(frozen=True)
class Stream:
    """A manifest file: its package path, size and sha256."""

    path: str
    size: int
    sha256: str


class FileRow(NamedTuple):
    """One files.jsonl row; `path` is package-relative (``snapshot/...``). (A tuple: a search makes one
    per text part.)"""

    ref: str
    record_ref: str
    kind: str
    part: int | None
    path: str
    size: int
    sha256: str
    media_type: str
    attachment_id: str


class TextPart(NamedTuple):
    """A text part's files.jsonl row, parsed only as far as a search needs it (a search makes one per
    part); `line` is the row itself, parsed whole by `file_row` for its sha256 when something from the
    part is handed out."""

    record_ref: str
    part: int
    size: int
    path: str
    line: bytes

    @property
    def ref(self) -> str:
        """The part's ref."""
        return f"r_{self.record_ref}:p{self.part}"

    def follows(self, previous: TextPart | None) -> bool:
        """Whether `previous` is the part just before this one in its record (a match may span the two)."""
        return previous is not None and previous.record_ref == self.record_ref and previous.part == self.part - 1


@dataclass(frozen=True)
class RecordRow:
    """One records.jsonl row."""

    record_ref: str
    kind: str
    session_id: str
    record_id: str
    role: str
    created_at: str
    text_parts: int


@dataclass(frozen=True)
class DetailRow:
    """One details.jsonl row: a unit's details file and its item count."""

    unit_id: str
    path: str
    sha256: str
    items: int


class Line(NamedTuple):
    """A manifest line with its byte offset and the offset of the line after it."""

    offset: int
    end: int
    data: bytes


class Package:
    """One package opened for one call: its entry files read and checked, streams verified on first use.
    `scanners`: the service's scanner processes a search may borrow (none: it scans in its thread)."""

    def __init__(
        self,
        package_dir: Path,
        deadline: Deadline,
        intact: IntactFiles | None = None,
        scanners: Scanners | None = None,
    ) -> None:
        self.directory = package_dir
        self.files = PackageFiles(package_dir, intact)
        self.deadline = deadline
        self.scanners = scanners
        self._verified: set[str] = set()
        try:
            self.ready = self._entry_json(READY)
            manifest_bytes = self._entry_bytes(MANIFEST)
            if hashlib.sha256(manifest_bytes).hexdigest() != self.ready.get("snapshotHash"):
                raise PackageDamaged("snapshot/manifest.json is not the snapshot ready.json names")
            self.manifest = _object(manifest_bytes, MANIFEST)
            self._handoff_hashes = _handoff_hashes(self.ready)
            self._streams = _streams(self.manifest)
        except BaseException:
            self.files.close()
            raise

    def close(self) -> None:
        """Release the package directory."""
        self.files.close()

    def __enter__(self) -> Package:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _entry_bytes(self, relative: str) -> bytes:
        size = self.files.size(relative)
        if size > ENTRY_FILE_BYTES:
            raise PackageDamaged(f"{relative} is larger than an entry file can be")
        return self.files.read(relative, size)

    def _entry_json(self, relative: str) -> dict[str, Any]:
        return _object(self._entry_bytes(relative), relative)

    def overview(self) -> dict[str, Any]:
        """handoff/overview.json, checked against ready.json."""
        data = self._entry_bytes(OVERVIEW)
        if hashlib.sha256(data).hexdigest() != self._handoff_hashes.get("overview.json"):
            raise PackageDamaged("handoff/overview.json does not match ready.json")
        return _object(data, OVERVIEW)

    def stream(self, path: str) -> Stream:
        """A manifest stream, verified whole against its recorded hash on first use in this call."""
        if path in (RECORDS, FILES):
            stream = self._streams[path]
        elif path == DETAILS:
            stream = Stream(path, self.files.size(path), self._handoff_hashes.get("details.jsonl", ""))
        else:
            raise ValueError(path)
        if path not in self._verified:
            self.files.verify(stream.path, stream.size, stream.sha256, self.deadline)
            self._verified.add(path)
        return stream

    def lines(self, path: str, start: int = 0, containing: bytes = b"") -> Iterator[Line]:
        """The lines of a stream from byte `start` (a line start the reader handed out) on; only those
        holding `containing`, when given (a cheap filter before any line is parsed)."""
        stream = self.stream(path)
        if not 0 <= start <= stream.size:
            raise PackageDamaged(f"{path} has no line at byte {start}")
        with self.files.open(stream.path, stream.size) as descriptor:
            offset = start
            pending = b""
            # A page often stops after a few hundred lines: read small first, then larger buffers.
            buffer_bytes = FIRST_BUFFER_BYTES
            while offset < stream.size:
                self.deadline.check(f"reading {path}")
                chunk = read_range(descriptor, offset, min(buffer_bytes, stream.size - offset))
                buffer_bytes = min(2 * buffer_bytes, BUFFER_BYTES)
                here = offset - len(pending)
                offset += len(chunk)
                lines = (pending + chunk if pending else chunk).split(b"\n")
                pending = lines.pop()
                for data in lines:
                    following = here + len(data) + 1
                    if containing in data:
                        yield Line(here, following, data)
                    here = following
                if len(pending) > MAX_LINE_BYTES:
                    raise PackageDamaged(f"{path} has a line longer than {MAX_LINE_BYTES} bytes")
            if pending and containing in pending:
                yield Line(stream.size - len(pending), stream.size, pending)

    def lines_containing(self, path: str, needle: bytes, start: int = 0) -> Iterator[Line]:
        """The lines of a stream holding `needle` (e.g. a hex digest), found with bytes.find buffer by
        buffer rather than by parsing every line: the way to locate a ref without an index."""
        stream = self.stream(path)
        with self.files.open(stream.path, stream.size) as descriptor:
            offset = start
            while offset < stream.size:
                self.deadline.check(f"looking up a ref in {path}")
                length = min(BUFFER_BYTES + MAX_LINE_BYTES, stream.size - offset)
                data = read_range(descriptor, offset, length)
                last_newline = data.rfind(b"\n")
                if offset + length < stream.size:
                    if last_newline < 0:
                        raise PackageDamaged(f"{path} has a line longer than {MAX_LINE_BYTES} bytes")
                    data = data[: last_newline + 1]
                position = 0
                while (found := data.find(needle, position)) >= 0:
                    line_start = data.rfind(b"\n", 0, found) + 1
                    line_end = data.find(b"\n", found)
                    line_end = len(data) if line_end < 0 else line_end
                    yield Line(offset + line_start, offset + line_end + 1, data[line_start:line_end])
                    position = line_end + 1
                offset += len(data)

    def sources(self) -> list[dict[str, Any]]:
        """The manifest's root sources (2-5), as merge recorded them."""
        sources = self.manifest.get("sources")
        if not isinstance(sources, list) or not all(isinstance(source, dict) for source in sources):
            raise PackageDamaged("snapshot/manifest.json lists no sources")
        return sources

    def unit_items(self, row: DetailRow) -> list[dict[str, Any]]:
        """The items of one unit's details file, checked against its sha256."""
        size = self.files.size(row.path)
        if size > DETAIL_FILE_BYTES:
            raise PackageDamaged(f"{row.path} is larger than a unit's details can be")
        value = _object(self.files.read_verified(row.path, size, row.sha256, self.deadline), row.path)
        items = value.get("items")
        if not isinstance(items, list) or not all(_is_item(item) for item in items):
            raise PackageDamaged(f"{row.path} holds items that are not merge's schema")
        return items

    def session_roots(self) -> Iterator[tuple[str, str]]:
        """(session id, root session id) of every session record, in package order: a session
        record's raw JSON names the tree it belongs to. Streams both manifests once."""
        files_offset = 0
        for line in self.lines_containing(RECORDS, b'"session"'):
            record = record_row(line.data)
            if record.kind != "session":
                continue
            raw = None
            for candidate in self.lines_containing(FILES, record.record_ref.encode(), files_offset):
                row = file_row(candidate.data)
                if row.record_ref == record.record_ref and row.kind == "raw":
                    raw, files_offset = row, candidate.end
                    break
            if raw is None or raw.size > SESSION_RAW_BYTES:
                raise PackageDamaged("a session record has no raw file of a session's size")
            value = _object(self.files.read_verified(raw.path, raw.size, raw.sha256, self.deadline), raw.path)
            session = value.get("session")
            root = session.get("rootSessionId") if isinstance(session, dict) else None
            yield record.session_id, root if isinstance(root, str) and root else record.session_id

    def tree(self, source_id: str) -> frozenset[str]:
        """The sessions of the source tree rooted at `source_id` (a session id that is no root: itself)."""
        members = {session for session, root in self.session_roots() if root == source_id or session == source_id}
        return frozenset(members)


def _object(data: bytes, where: str) -> dict[str, Any]:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise PackageDamaged(f"{where} holds a line or file that is not JSON") from None
    if not isinstance(value, dict):
        raise PackageDamaged(f"{where} holds JSON that is not an object")
    return value


def file_row(data: bytes) -> FileRow:
    """A files.jsonl line, its path checked against merge's layout for its kind (the digest in the path
    must be the row's record, or for an asset its sha256; a text part's number its part), compared with
    the path the layout gives (cheaper than a pattern per row)."""
    row = _object(data, FILES)
    get = row.get
    kind, path, record_ref, sha256, size, part, ref = (
        get("kind"), get("path"), get("recordRef"), get("sha256"), get("bytes"), get("part"), get("ref")
    )  # fmt: skip
    layout = None
    if _is_hex64(record_ref):
        if kind == "text" and type(part) is int and 0 <= part <= _MAX_PART:
            layout = f"text/{record_ref}-{part}.txt"
        elif kind == "raw" and part is None:
            layout = f"raw/{record_ref}.json"
        elif kind == "asset" and type(part) is int and _is_hex64(sha256):
            layout = f"assets/{sha256}"
    if not (
        layout is not None
        and path == layout
        and type(ref) is str
        and type(size) is int
        and size >= 0
        and type(sha256) is str
    ):
        raise PackageDamaged("snapshot/files.jsonl holds a row that is incomplete or names a path outside the layout")
    media_type, attachment_id = row.get("mediaType"), row.get("attachmentId")
    return FileRow(
        ref,
        str(record_ref),
        str(kind),
        part,
        "snapshot/" + str(path),
        size,
        sha256,
        media_type if isinstance(media_type, str) else "",
        attachment_id if isinstance(attachment_id, str) else "",
    )


def text_part(data: bytes) -> TextPart | None:
    """A files.jsonl line if it is a text part's (None for other kinds), its path checked against
    merge's layout (the row's record and part number) as `file_row` checks it."""
    row = _object(data, FILES)
    get = row.get
    if get("kind") != "text":
        return None
    record_ref, part, size, path = get("recordRef"), get("part"), get("bytes"), get("path")
    if not (
        _is_hex64(record_ref)
        and type(part) is int
        and 0 <= part <= _MAX_PART
        and path == f"text/{record_ref}-{part}.txt"
        and type(size) is int
        and size >= 0
    ):
        raise PackageDamaged("snapshot/files.jsonl holds a row that is incomplete or names a path outside the layout")
    return TextPart(record_ref, part, size, "snapshot/" + path, data)


def record_row(data: bytes) -> RecordRow:
    """A records.jsonl line."""
    row = _object(data, RECORDS)
    origin = row.get("origin")
    fields = [row.get("recordRef"), row.get("role"), row.get("createdAt", "")]
    if isinstance(origin, dict):
        fields += [origin.get("kind"), origin.get("sessionId"), origin.get("recordId")]
    parts = row.get("textParts", 0)
    if len(fields) != 6 or not all(isinstance(value, str) for value in fields) or not isinstance(parts, int):
        raise PackageDamaged("snapshot/records.jsonl holds an incomplete row")
    record_ref, role, created_at, kind, session_id, record_id = fields
    if not HEX64.fullmatch(record_ref):
        raise PackageDamaged("snapshot/records.jsonl holds a row without a recordRef")
    return RecordRow(record_ref, kind, session_id, record_id, role, created_at, parts)


_UNIT_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")


def detail_row(data: bytes) -> DetailRow:
    """A details.jsonl line; its details path must be ``details/<unitId>.json``."""
    row = _object(data, DETAILS)
    unit_id, path, sha256, items = (row.get(key) for key in ("unitId", "path", "sha256", "items"))
    if not (
        isinstance(unit_id, str)
        and _UNIT_ID.fullmatch(unit_id)
        and path == f"details/{unit_id}.json"
        and isinstance(sha256, str)
        and HEX64.fullmatch(sha256)
        and isinstance(items, int)
    ):
        raise PackageDamaged("handoff/details.jsonl holds an incomplete row or a path outside details/")
    return DetailRow(unit_id, "handoff/" + path, sha256, items)


def _is_item(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and all(isinstance(item.get(key), str) for key in ("itemId", "section", "status", "content"))
        and isinstance(item.get("evidence"), list)
        and all(isinstance(evidence, dict) for evidence in item["evidence"])
    )


def item_selected(item: dict[str, Any], section: str, members: frozenset[str] | None) -> bool:
    """Whether a handoff item passes a call's filters: its section (when one is named) and a source's
    sessions (when a source is named: some of the item's evidence comes from them)."""
    if section and item["section"] != section:
        return False
    return members is None or bool({str(evidence.get("sessionId", "")) for evidence in item["evidence"]} & members)


def _handoff_hashes(ready: dict[str, Any]) -> dict[str, str]:
    listed = ready.get("files")
    if not isinstance(listed, list):
        raise PackageDamaged("handoff/ready.json lists no files")
    hashes = {}
    for row in listed:
        if not isinstance(row, dict) or not isinstance(row.get("path"), str) or not isinstance(row.get("sha256"), str):
            raise PackageDamaged("handoff/ready.json lists a file without its path or hash")
        hashes[row["path"]] = row["sha256"]
    return hashes


def _streams(manifest: dict[str, Any]) -> dict[str, Stream]:
    described = manifest.get("streams")
    streams = {}
    for path in (RECORDS, FILES):
        name = path.removeprefix("snapshot/")
        entry = described.get(name) if isinstance(described, dict) else None
        if not (
            isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
        ):
            raise PackageDamaged(f"snapshot/manifest.json does not describe {name}")
        streams[path] = Stream(path, entry["bytes"], entry["sha256"])
    return streams
