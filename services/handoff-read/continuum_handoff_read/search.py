"""Literal search over every text the package registers: the snapshot's text parts, then the
handoff's detailed items.

The query's UTF-8 bytes are looked for with bytes.find over whole buffers (no lines, so no line is
ever too long to search, and nothing is decoded but the excerpts). Each buffer is preceded by the last
len(query) - 1 bytes before it, from the same file or from the previous part of the same record, so a
match split across buffers or across two parts is found; a match lying wholly in those carried bytes
was reported with the buffer before and is not reported again. A page scans at most 8 MiB of text,
then answers with a cursor; `complete` is True only once every candidate was scanned.

Every part scanned is a regular file beneath the package of its registered size (checked on open), but
its sha256 is computed only when something from it is handed out: before the first excerpt that shows
its bytes (a match in it, or carried bytes of it before a match in the next part), in memory when the
buffer holds the whole part, else by reading it again. Why that is enough: the package is sealed by
merge and its chain ready.json -> manifest.json -> streams is verified before any row is used, so a
part's bytes can differ only if someone altered the sealed package; such a part is refused
(HANDOFF_PACKAGE_DAMAGED) before any of its bytes reach the model, and "no match" over a part of its
registered size is accepted. Hashing every scanned part was a third of the search's CPU time.

Reader threads prefetching the next parts were measured and lost (more CPU, no less wall time): each
part costs four short syscalls (open, fstat, read, close), and every return from one needs the GIL back
from the scanning thread. So the service keeps scanner processes (scanners.py): a page hands each idle
one a piece of files.jsonl, and this thread scans only the parts they flag, the same way it scans any
part. A page narrowed to a source, or finding no scanner idle, scans in this thread alone.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from continuum_handoff_read.arguments import MAX_QUERY_BYTES, Arguments
from continuum_handoff_read.cursors import CursorRefused, Cursors, Position
from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import BudgetExceeded, PackageDamaged
from continuum_handoff_read.files import read_into, read_range
from continuum_handoff_read.manifest import (
    DETAILS,
    FILES,
    MAX_LINE_BYTES,
    RECORDS,
    Line,
    Package,
    RecordRow,
    Stream,
    TextPart,
    detail_row,
    file_row,
    item_selected,
    record_row,
    text_part,
)
from continuum_handoff_read.results import Entry, Page, ToolResult, utf8_end, utf8_start
from continuum_handoff_read.scanners import Lent, Parked, Piece, Pipeline, Prescan, Scanners

# Seed 000 §7.2: at most 8 MiB of body scanned per page.
SCAN_BYTES = 8 * 1024 * 1024
BUFFER_BYTES = 1024 * 1024
# A scanner's piece of files.jsonl: expected to hold half its share of a page's budget (two pieces out
# per scanner keep it busy while the reader takes the other's answer), within these bounds. Measured on
# 2 CPUs with read-ahead: 2 per share beats 1 (1.6x: a scanner waits for its next piece), 4 (1.1x) and
# 8 (1.2x: the reader's work per piece).
PIECES_PER_SCANNER = 2
PIECE_MIN_BYTES = 4 * 1024
# Two pieces out, with their framing and the line before each, fit in what a scanner's pipe may hold
# (half its send buffer: about 104 KiB on Linux), so short parts, which make the largest pieces, still
# keep two out per scanner; a send never waits for a scanner, which could be stuck in a read past the
# call's deadline.
PIECE_MAX_BYTES = 48 * 1024
# Bytes of context on each side of a match in its excerpt.
CONTEXT_BYTES = 120
DEFAULT_LIMIT = 20

_BUDGET = "budget"
_OUTPUT = "output"
_TIME = "time"


@dataclass
class _Stop:
    """Why and where a page ended before the last candidate."""

    reason: str
    position: Position


class _Where(NamedTuple):
    """Where a text part's scan began: its files.jsonl line, the byte it resumed at, matches already
    returned there, the previous part's line and the record's line (a Position once a page stops)."""

    row: int
    at: int
    skip: int
    previous: int
    record: int

    def position(self, at: int, skip: int) -> Position:
        return Position(phase="records", row=self.row, at=at, skip=skip, previous=self.previous, record=self.record)


class _Previous(NamedTuple):
    """The last text row scanned (offset -1: none) and where its line is (in `data`, from `at`): parsed
    only when a flagged part may continue its part."""

    offset: int
    data: bytes
    at: int

    def part(self) -> TextPart | None:
        return text_part(_line(self.data, self.at)) if self.offset >= 0 else None

    def position(self, row: int) -> Position:
        """Where a page resumes at the line at `row`, carrying this row's tail."""
        return Position(phase="records", row=row, previous=self.offset)


@dataclass
class _Out:
    """The pieces out on scanners, where the next piece starts and the line before it (which its
    scanner reads to carry a part's tail into the piece)."""

    pipeline: Pipeline
    sent: int
    before: bytes

    @classmethod
    def resumed(cls, parked: Parked, deadline: Deadline) -> _Out:
        """A parked page's pieces, now answering to `deadline`."""
        parked.pipeline.deadline = deadline
        return cls(parked.pipeline, parked.sent, parked.before)


def _line(data: bytes, at: int) -> bytes:
    """The line of `data` beginning at `at`."""
    end = data.find(b"\n", at)
    return data[at:] if end < 0 else data[at:end]


@dataclass
class _Records:
    """records.jsonl walked beside files.jsonl, to know which session a text part belongs to."""

    lines: Iterator[Line]
    current: RecordRow | None = None
    offset: int = 0

    def of(self, row: TextPart) -> RecordRow:
        while self.current is None or self.current.record_ref != row.record_ref:
            line = next(self.lines, None)
            if line is None:
                raise PackageDamaged("snapshot/files.jsonl names a record records.jsonl does not hold in order")
            self.current, self.offset = record_row(line.data), line.offset
        return self.current


@dataclass
class _Scan:
    package: Package
    arguments: Arguments
    query: bytes
    page: Page
    members: frozenset[str] | None
    scanned: int = 0
    verified: set[str] = field(default_factory=set)
    # One read buffer for every part of the page: the carried bytes and up to BUFFER_BYTES read.
    buffer: bytearray = field(default_factory=lambda: bytearray(BUFFER_BYTES + MAX_QUERY_BYTES))
    # Text bytes per files.jsonl byte: a first guess (merge's rows are a few hundred bytes, its parts
    # up to 32 KiB), corrected by every answer of a scanner.
    ratio: float = 48.0

    def __post_init__(self) -> None:
        self.view = memoryview(self.buffer)
        # A match may begin this many bytes before a buffer and end inside it.
        self.carry_bytes = len(self.query) - 1

    def out_of_time(self) -> bool:
        """Whether the deadline passed; before anything was scanned that fails the call."""
        if not self.package.deadline.expired():
            return False
        if self.scanned == 0 and not self.page.entries:
            raise BudgetExceeded("the call's time budget ran out before the search could scan anything")
        return True

    def verify(self, part: TextPart, whole: memoryview | None = None) -> None:
        """Check a part against its registered sha256 before anything from it is handed out: `whole`,
        the part as scanned, when the buffer held all of it, else the file read again."""
        if part.path in self.verified:
            return
        row = file_row(part.line)
        if whole is None:
            self.package.files.verify(row.path, row.size, row.sha256, self.package.deadline)
        elif hashlib.sha256(whole).hexdigest() != row.sha256:
            raise PackageDamaged(f"{row.path} does not match its registered sha256")
        self.verified.add(part.path)

    def records(self, start: Position) -> _Stop | None:
        """Scan the text parts from `start` on: with the service's scanner processes when some are idle
        and the search is not narrowed to a source, else in this thread."""
        scanners = self.package.scanners
        if scanners is not None and self.members is None:
            stream = self.package.stream(FILES)
            # What a scanner's answers depend on: a parked page of another search is never picked up.
            package = str(self.package.directory), self.package.files.identity(), stream.sha256
            key = (*package, self.query, SCAN_BYTES, BUFFER_BYTES)
            resumed = start.at or start.skip
            with scanners.borrow(key, -1 if resumed else start.row, start.previous) as lent:
                if lent.scanners:
                    return self._records_in_parallel(start, stream, lent, scanners, key)
        return self._records_here(start)

    def _records_in_parallel(
        self, start: Position, stream: Stream, lent: Lent, scanners: Scanners, key: Hashable
    ) -> _Stop | None:
        """Scan the text parts from `start` on with scanners: pieces of files.jsonl go out while what they
        are expected to hold fits the page's budget, and come back in order; the parts a scanner flags
        (and a row it could not take, from where this thread goes on alone) are scanned here as
        `_records_here` scans them. A page ending at its budget sends the next page's first pieces and
        parks them: the next page of this search picks their answers up."""
        offset = start.row
        previous = _Previous(-1, b"", 0)
        if start.previous >= 0:
            previous = _Previous(start.previous, next(self.package.lines(FILES, start.previous)).data, 0)
        if start.at or start.skip:
            # The cursor points inside a row: that row the way _records_here resumes it, then onwards.
            line = next(self.package.lines(FILES, start.row))
            stop = self._records_here(start, rows=1)
            if stop is not None:
                return stop
            offset, previous = line.end, _Previous(line.offset, line.data, 0)
        head = None
        if lent.parked is not None:
            out = _Out.resumed(lent.parked, self.package.deadline)
            head, self.ratio = lent.parked.head, lent.parked.ratio
        else:
            # The line before the first piece, for its scanner to carry a part's tail into the piece.
            before = _line(previous.data, previous.at) if previous.offset >= 0 else b""
            out = _Out(Pipeline(lent.scanners, self.package.deadline), offset, before)
        answered_lines = answered_text = 0
        with self.package.files.open(stream.path, stream.size) as descriptor:
            while True:
                self._send(out, descriptor, stream.size, SCAN_BYTES - self.scanned)
                if head is not None:
                    (piece, answer, first), head = head, None
                elif out.pipeline.empty:
                    return None if offset >= stream.size else self._records_here(previous.position(offset))
                elif self.out_of_time():
                    return _Stop(_TIME, previous.position(offset))
                else:
                    answered = out.pipeline.next()
                    if answered is None:
                        return self._records_here(previous.position(offset))
                    (piece, answer), first = answered, 0
                stop, previous, at = self._take(piece, answer, previous, first)
                if stop is not None:
                    if stop.reason == _BUDGET:
                        self._read_ahead(
                            scanners, key, stop.position, out, (piece, answer, at), descriptor, stream.size
                        )
                    return stop
                offset = piece.offset + len(piece.lines)
                if answer.end < offset:
                    return self._records_here(previous.position(answer.end))
                # Text bytes per files.jsonl byte so far, to size what goes out next.
                answered_lines += len(piece.lines)
                answered_text += sum(answer.sizes)
                self.ratio = max(1.0, answered_text / answered_lines)

    def _read_ahead(
        self,
        scanners: Scanners,
        key: Hashable,
        where: Position,
        out: _Out,
        head: tuple[Piece, Prescan, int],
        descriptor: int,
        size: int,
    ) -> None:
        """A page ended at its budget at `where`: the next page's first pieces go out now, while this page
        is answered, and are parked with the rest of `head` (the answered piece it ended in) for it."""
        self._send(out, descriptor, size, SCAN_BYTES)
        sent_by = tuple(scanner.sent for scanner in out.pipeline.scanners)
        pipeline, sent, before = out.pipeline, out.sent, out.before
        scanners.park(Parked(key, where.row, where.previous, head, pipeline, sent, before, self.ratio, sent_by))

    def _send(self, out: _Out, descriptor: int, size: int, budget: int) -> None:
        """Send pieces while there is room and what is out is expected to hold less than `budget`."""
        while out.sent < size and out.pipeline.room() and out.pipeline.out_bytes * self.ratio < budget:
            piece = self._piece(descriptor, out.sent, size, len(out.pipeline.scanners), out.before)
            if piece is None or not out.pipeline.send(piece):
                return
            out.sent += len(piece.lines)
            out.before = _line(piece.lines, piece.lines.rfind(b"\n", 0, len(piece.lines) - 1) + 1)

    def _take(
        self, piece: Piece, answer: Prescan, previous: _Previous, first: int = 0
    ) -> tuple[_Stop | None, _Previous, int]:
        """Count a scanner's rows from the `first` on into the page in order, scanning the flagged ones
        here; a stop where the budget ends or the page fills, the last row taken and the index of the row
        a stop is at. Rows between two flagged ones are counted at once (most pieces flag none)."""
        offsets, sizes = answer.offsets, answer.sizes
        done = first
        for index in [*(flag for flag in answer.flagged if flag >= first), len(offsets)]:
            clean = sum(sizes[done:index])
            if self.scanned + clean <= SCAN_BYTES:
                self.scanned += clean
                if index > done:
                    previous = _Previous(offsets[index - 1], piece.lines, offsets[index - 1] - piece.offset)
            else:
                for position in range(done, index):
                    if self.scanned + sizes[position] > SCAN_BYTES:
                        return _Stop(_BUDGET, previous.position(offsets[position])), previous, position
                    self.scanned += sizes[position]
                    previous = _Previous(offsets[position], piece.lines, offsets[position] - piece.offset)
            if index == len(offsets):
                break
            row = offsets[index]
            if self.scanned + sizes[index] > SCAN_BYTES:
                return _Stop(_BUDGET, previous.position(row)), previous, index
            stop = self._flagged(row, _line(piece.lines, row - piece.offset), previous)
            if stop is not None:
                return stop, previous, index
            previous = _Previous(row, piece.lines, row - piece.offset)
            done = index + 1
        return None, previous, len(offsets)

    def _piece(self, descriptor: int, offset: int, size: int, scanners: int, before: bytes) -> Piece | None:
        """The whole lines from `offset` expected to hold about a PIECES_PER_SCANNER-th of a scanner's
        share of the budget (within PIECE_MIN_BYTES and PIECE_MAX_BYTES of files.jsonl); None when a
        line is longer than a manifest line may be (this thread then meets it and says so)."""
        share = SCAN_BYTES / scanners / PIECES_PER_SCANNER
        length = int(min(PIECE_MAX_BYTES, max(PIECE_MIN_BYTES, share / self.ratio)))
        data = read_range(descriptor, offset, min(length, size - offset))
        if offset + len(data) < size:
            cut = data.rfind(b"\n")
            if cut < 0:
                data = read_range(descriptor, offset, min(MAX_LINE_BYTES + 1, size - offset))
                cut = data.rfind(b"\n")
                if cut < 0:
                    return None
            data = data[: cut + 1]
        package = str(self.package.directory), self.package.files.identity()
        return Piece(*package, offset, data, before, self.query, BUFFER_BYTES)

    def _flagged(self, offset: int, line: bytes, previous: _Previous) -> _Stop | None:
        """Scan a part a scanner flagged, as `_records_here` scans a whole part (with the tail of the
        part before it in its record), and report its matches."""
        row = text_part(line)
        if row is None:
            raise PackageDamaged("snapshot/files.jsonl changed while it was read")
        before = previous.part()
        if not row.follows(before):
            before = None
        tail = b""
        if before is not None and self.carry_bytes:
            tail = self.package.files.tail(before.path, before.size, self.carry_bytes)
        kept = len(tail)
        end = kept + row.size
        self.buffer[:kept] = tail
        self.package.files.read_whole(row.path, row.size, self.view[kept:end])
        self.scanned += row.size
        if self.buffer.find(self.query, 0, end) < 0:
            return None
        return self._matches(_Where(offset, 0, 0, previous.offset, 0), row, before, kept, end, 0)

    def _records_here(self, start: Position, rows: int | None = None) -> _Stop | None:
        """Scan the text parts from `start` on in this thread (only the first `rows` text rows, when given)."""
        records = None
        if self.members is not None:
            records = _Records(self.package.lines(RECORDS, start.record), offset=start.record)
        previous: TextPart | None = None
        previous_offset = -1
        tail = b""
        if start.previous >= 0:
            previous_offset = start.previous
            previous = text_part(next(self.package.lines(FILES, start.previous)).data)
            if previous is None:
                raise CursorRefused("cursor", "does not follow a text part")
            tail = self.package.files.tail(previous.path, previous.size, self.carry_bytes)
        # The loop below runs once per part (tens of thousands per package): what it uses, bound locally.
        buffer, view, query, carry_bytes = self.buffer, self.view, self.query, self.carry_bytes
        read_whole = self.package.files.read_whole
        for line in self.package.lines(FILES, start.row, containing=b'"text"'):  # not raw rows, most assets
            row = text_part(line.data)
            if row is None:
                continue
            if rows is not None:
                if rows == 0:
                    return None
                rows -= 1
            if records is not None and records.of(row).session_id not in self.members:  # type: ignore[operator]
                continue
            if not row.follows(previous):
                previous, previous_offset, tail = None, -1, b""
            size = row.size
            if line.offset != start.row and self.scanned + size <= SCAN_BYTES and size <= BUFFER_BYTES:
                # The common case, kept lean: a whole part from its first byte, within the page's budget
                # (an empty part on a spent budget goes the long way, which stops there).
                if self.scanned == SCAN_BYTES or self.out_of_time():
                    where = _Where(line.offset, 0, 0, previous_offset, records.offset if records is not None else 0)
                    return _Stop(_BUDGET if self.scanned == SCAN_BYTES else _TIME, where.position(0, 0))
                kept = len(tail)
                end = kept + size
                buffer[:kept] = tail
                read_whole(row.path, size, view[kept:end])
                self.scanned += size
                if buffer.find(query, 0, end) >= 0:
                    where = _Where(line.offset, 0, 0, previous_offset, records.offset if records is not None else 0)
                    stop = self._matches(where, row, previous, kept, end, 0)
                    if stop is not None:
                        return stop
                tail = bytes(view[max(0, end - carry_bytes) : end]) if carry_bytes else b""
            else:
                resumed = line.offset == start.row
                where = _Where(
                    line.offset,
                    start.at if resumed else 0,
                    start.skip if resumed else 0,
                    previous_offset,
                    records.offset if records is not None else 0,
                )
                stop, tail = self._file(where, row, previous, tail)
                if stop is not None:
                    return stop
            previous, previous_offset = row, line.offset
        return None

    def _file(self, where: _Where, row: TextPart, previous: TextPart | None, tail: bytes) -> tuple[_Stop | None, bytes]:
        """Scan one text part from `where.at` on; a stop, or the bytes to carry into the next part."""
        at, skip = where.at, where.skip
        if at > row.size:
            raise CursorRefused("cursor", "points past the end of its file")
        descriptor = self.package.files.descriptor(row.path, row.size)
        try:
            carry = tail[-self.carry_bytes :] if self.carry_bytes and at == 0 else b""
            if at > 0 and self.carry_bytes:
                own = read_range(descriptor, max(0, at - self.carry_bytes), min(at, self.carry_bytes))
                carry = (tail + own)[-self.carry_bytes :]
            buffer = self.buffer
            while True:
                if self.scanned >= SCAN_BYTES:
                    return _Stop(_BUDGET, where.position(at, skip)), b""
                if self.out_of_time():
                    return _Stop(_TIME, where.position(at, skip)), b""
                length = min(row.size - at, SCAN_BYTES - self.scanned, BUFFER_BYTES)
                # The carried bytes, then the file's next bytes read in place: no copy per part.
                kept = len(carry)
                buffer[:kept] = carry
                end = kept + length
                read_into(descriptor, self.view[kept:end], at)
                self.scanned += length
                stop = self._matches(where, row, previous, kept, end, at, skip)
                if stop is not None:
                    return stop, b""
                skip = 0
                carry = bytes(self.view[max(0, end - self.carry_bytes) : end]) if self.carry_bytes else b""
                at += length
                if at >= row.size:
                    return None, carry
        finally:
            os.close(descriptor)

    def _matches(
        self, where: _Where, row: TextPart, previous: TextPart | None, kept: int, end: int, at: int, skip: int = 0
    ) -> _Stop | None:
        """Report the matches in buffer[:end], which holds `kept` carried bytes and then `row`'s bytes from
        `at`, after the first `skip` of them; a stop when the page is full."""
        buffer = self.buffer
        # A whole part in one buffer (merge's parts are at most 32 KiB) is checked in memory, on the very
        # bytes an excerpt shows.
        whole = self.view[kept:end] if at == 0 and end - kept == row.size else None
        reported = 0
        position = 0
        while (found := buffer.find(self.query, position, end)) >= 0:
            position = found + len(self.query)
            if position <= kept:
                continue  # wholly in the carried bytes: reported with the buffer before
            reported += 1
            if reported <= skip:
                continue
            if not self.page.add(self._match(end, found, at - kept, row, previous, whole)):
                return _Stop(_OUTPUT, where.position(at, reported - 1))
        return None

    def _match(
        self, end: int, found: int, base: int, row: TextPart, previous: TextPart | None, whole: memoryview | None
    ) -> Entry:
        """The entry of a match at buffer[found:] (the buffer holds `end` bytes; buffer[0] is byte `base`
        of `row`, negative: the carried bytes from the end of `previous`; `whole`: all of `row`, when the
        buffer holds it); every file it shows is verified first."""
        self.verify(row, whole)
        if base < 0 and previous is not None:
            self.verify(previous)
        offset = base + found
        ref = row.ref
        if offset < 0 and previous is not None:
            ref, offset = previous.ref, previous.size + offset
        return Entry(ref, "part", _excerpt(bytes(self.view[:end]), found, len(self.query), offset))

    def items(self, start: Position) -> _Stop | None:
        """Scan the handoff's detailed items from `start` on."""
        for line in self.package.lines(DETAILS, start.row):
            detail = detail_row(line.data)
            first = start.at if line.offset == start.row else 0
            here = Position(phase="items", row=line.offset, at=first)
            size = self.package.files.size(detail.path)
            if self.scanned and self.scanned + size > SCAN_BYTES:
                return _Stop(_BUDGET, here)
            if self.out_of_time():
                return _Stop(_TIME, here)
            items = self.package.unit_items(detail)
            self.scanned += size
            for index in range(first, len(items)):
                entry = self._item(items[index])
                if entry is not None and not self.page.add(entry):
                    return _Stop(_OUTPUT, here.model_copy(update={"at": index}))
        return None

    def _item(self, item: dict[str, Any]) -> Entry | None:
        if not item_selected(item, self.arguments.section, self.members):
            return None
        content = item["content"].encode()
        found = content.find(self.query)
        if found < 0:
            return None
        excerpt = _excerpt(content, found, len(self.query), found)
        return Entry(item["itemId"], "item", f"[{item['section']} / {item['status']}] {excerpt}")


def _excerpt(buffer: bytes, found: int, length: int, offset: int) -> str:
    """The match with up to CONTEXT_BYTES on each side, cut on code point boundaries, and where it is."""
    low = utf8_start(buffer, max(0, found - CONTEXT_BYTES))
    high = utf8_end(buffer, min(len(buffer), found + length + CONTEXT_BYTES))
    before = "…" if low > 0 else ""
    after = "…" if high < len(buffer) else ""
    text = buffer[low:high].decode("utf-8", errors="replace")
    return f"at byte {offset}: {before}{text}{after}"


def search(package: Package, arguments: Arguments, start: Position | None, cursors: Cursors) -> ToolResult:
    """One page of a literal search for `arguments.query`, narrowed by source and section."""
    page = Page(arguments.limit or DEFAULT_LIMIT)
    members = package.tree(arguments.source_id) if arguments.source_id else None
    scan = _Scan(package, arguments, arguments.query.encode(), page, members)
    if start is None:
        # Records have no section: a search narrowed to a section reads only the handoff's items.
        start = Position(phase="items" if arguments.section else "records")
    stop = _scan(scan, start)
    if stop is None:
        warning = "" if page.entries else "No match anywhere in the package."
        return page.result(True, warning=warning)
    warnings = {
        _BUDGET: f"This page scanned {scan.scanned} bytes of text (the page's budget); what this page did not "
        "show may still be in the package: continue with next_cursor.",
        _OUTPUT: "The page is full; more matches may follow: continue with next_cursor.",
        _TIME: "The call's time budget ran out before the scan finished: continue with next_cursor.",
    }
    return page.result(False, cursors.issue(arguments, stop.position), warnings[stop.reason])


def _scan(scan: _Scan, start: Position) -> _Stop | None:
    stop = None
    if start.phase == "records":
        stop = scan.records(start)
        start = Position(phase="items")
    if stop is None and start.phase == "items":
        stop = scan.items(start)
    elif stop is None:
        raise CursorRefused("cursor", "was not issued by a search")
    return stop
