"""Scanner processes: the text parts of a search page, prescanned in parallel.

A search is CPU-bound Python: per text part, a manifest row parsed, four short syscalls (open, fstat,
read, close) and a bytes.find. Threads serialize on the GIL (measured: slower than one thread), so the
service keeps a few scanner processes, started once, and a search page hands each of them a piece: a
run of files.jsonl lines, as bytes the reader has already verified against the manifest's hash (a
scanner never reads a manifest itself).

A scanner parses each text row exactly as the reader does, opens the part beneath the package with the
same checks (PackageFiles: openat2 beneath the package without symlinks, O_NOFOLLOW, a regular file of
the registered size), reads it whole after the carried tail of the part before it in the same record,
and looks for the query. It answers which text rows it scanned and which of them the reader must look
at itself ("flagged"): a match ending in the row's own bytes, or a first row of the piece that may
continue a part of the piece before (a scanner never sees that part's bytes). It stops before a row it
cannot take (larger than the reader's buffer or the budget, damaged, unreadable), where the reader
goes on in its own thread and meets the same row and its error.

A scanner hashes nothing and hands nothing out: the reader re-reads every flagged part, verifies it and
builds the excerpts exactly as it does without scanners, so the answer is the same either way.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import PackageDamaged
from continuum_handoff_read.files import PackageFiles
from continuum_handoff_read.manifest import text_part

logger = logging.getLogger("continuum.handoff_read")

# A stopped scanner gets this long to exit before it is killed.
_STOP_SECONDS = 2.0
# The name of every scanner process (in `ps` and multiprocessing's children).
SCANNER_NAME = "handoff-read-scanner"


class Piece(NamedTuple):
    """A run of whole files.jsonl lines starting at byte `offset` of the stream, and how to scan it:
    the query, the page's budget left (no row past it is taken) and the largest part a row may have
    (the reader's buffer)."""

    package_dir: str
    offset: int
    lines: bytes
    query: bytes
    budget: int
    max_part: int


class Prescan(NamedTuple):
    """What a scanner found in a piece: the offsets and sizes of the text rows it scanned, in order; the
    indexes of those the reader must look at; and the offset of the first line it did not handle (the
    piece's end when it handled all)."""

    offsets: list[int]
    sizes: list[int]
    flagged: list[int]
    end: int


def prescan(piece: Piece, buffer: bytearray) -> Prescan:
    """Scan `piece` (in a scanner process) with `buffer` (at least max_part + len(query) bytes)."""
    offsets: list[int] = []
    sizes: list[int] = []
    flagged: list[int] = []
    view = memoryview(buffer)
    query = piece.query
    carry_bytes = len(query) - 1
    try:
        files = PackageFiles(Path(piece.package_dir))
    except PackageDamaged:
        return Prescan(offsets, sizes, flagged, piece.offset)
    with files:
        read_whole = files.read_whole
        previous = None
        tail = b""
        scanned = 0
        here = piece.offset
        for data in piece.lines.split(b"\n"):
            start, here = here, here + len(data) + 1
            if b'"text"' not in data:  # not raw rows, most assets (as the reader filters)
                continue
            try:
                row = text_part(data)
            except PackageDamaged:
                return Prescan(offsets, sizes, flagged, start)
            if row is None:
                continue
            size = row.size
            if size > piece.max_part or scanned + size > piece.budget:
                return Prescan(offsets, sizes, flagged, start)
            chained = previous is not None and previous.record_ref == row.record_ref and previous.part == row.part - 1
            if not chained:
                tail = b""
            kept = len(tail)
            end = kept + size
            buffer[:kept] = tail
            try:
                read_whole(row.path, size, view[kept:end])
            except (PackageDamaged, OSError):
                return Prescan(offsets, sizes, flagged, start)
            # Any match found has a byte in this part: the carried bytes are one byte shorter than the query.
            if buffer.find(query, 0, end) >= 0 or (previous is None and row.part > 0):
                flagged.append(len(offsets))
            offsets.append(start)
            sizes.append(size)
            scanned += size
            tail = bytes(view[max(0, end - carry_bytes) : end]) if carry_bytes else b""
            previous = row
    return Prescan(offsets, sizes, flagged, piece.offset + len(piece.lines))


def _serve(connection: Connection) -> None:
    """A scanner process: answer pieces until the reader closes the pipe or sends None."""
    # Ctrl-C in a terminal reaches the whole process group: the service decides when scanners stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    buffer = bytearray()
    while True:
        try:
            piece = connection.recv()
        except EOFError:
            return
        if piece is None:
            return
        try:
            needed = piece.max_part + len(piece.query)
            if len(buffer) < needed:
                buffer = bytearray(needed)
            connection.send(prescan(piece, buffer))
        except Exception:
            # A programming error: the reader logs it (with its frames) and scans the page itself.
            connection.send(traceback.format_exc())


class Scanner:
    """One scanner process and the reader's end of its pipe."""

    def __init__(self, context: Any) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name=SCANNER_NAME, daemon=True)
        self.process.start()
        child.close()
        # Whether a piece was sent whose answer was not received: its answer would reach the next
        # borrower as the answer to another piece, so such a scanner is never lent again.
        self.busy = False

    def send(self, piece: Piece) -> bool:
        """Hand `piece` over; False when the process is gone."""
        self.busy = True
        try:
            self.connection.send(piece)
        except OSError:
            return False
        return True

    def receive(self, deadline: Deadline) -> Prescan | None:
        """The answer to the piece sent, or None (the deadline passed, the process died or failed)."""
        try:
            if not self.connection.poll(deadline.remaining()):
                return None
            answer = self.connection.recv()
        except (EOFError, OSError):
            return None
        self.busy = False
        if isinstance(answer, str):
            logger.error("a search scanner failed; the page is scanned in the reader's thread\n%s", answer)
            return None
        prescanned: Prescan = answer
        return prescanned

    def stop(self) -> None:
        with suppress(OSError):
            self.connection.send(None)
        self.connection.close()
        self.process.join(_STOP_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Scanners:
    """The service's scanner processes, lent to one search page at a time (a page that finds none idle,
    because other searches hold them, scans in its own thread). Thread-safe."""

    def __init__(self, count: int) -> None:
        # forkserver: the service runs gRPC threads, which a plain fork would copy mid-flight.
        self._context = multiprocessing.get_context("forkserver")
        self._idle: queue.SimpleQueue[Scanner] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(count):
            self._idle.put(Scanner(self._context))

    @contextmanager
    def borrow(self) -> Iterator[list[Scanner]]:
        """Every idle scanner (possibly none), returned when the block ends."""
        taken: list[Scanner] = []
        while True:
            try:
                taken.append(self._idle.get_nowait())
            except queue.Empty:
                break
        try:
            yield taken
        finally:
            for scanner in taken:
                self._give_back(scanner)

    def _give_back(self, scanner: Scanner) -> None:
        with self._lock:
            closed = self._closed
        if closed or scanner.busy or not scanner.process.is_alive():
            scanner.process.kill()
            scanner.stop()
            if closed:
                return
            scanner = Scanner(self._context)
        self._idle.put(scanner)

    def run(self, scanners: Sequence[Scanner], pieces: Sequence[Piece], deadline: Deadline) -> list[Prescan] | None:
        """Each piece on its scanner, in parallel; their answers in order, or None when any failed or
        the deadline passed (the caller then scans in its own thread)."""
        for scanner, piece in zip(scanners, pieces, strict=False):
            if not scanner.send(piece):
                return None
        answers = []
        for scanner in scanners[: len(pieces)]:
            answer = scanner.receive(deadline)
            if answer is None:
                return None
            answers.append(answer)
        return answers

    def close(self) -> None:
        """Stop every idle scanner; borrowed ones stop when they are given back."""
        with self._lock:
            self._closed = True
        while True:
            try:
                scanner = self._idle.get_nowait()
            except queue.Empty:
                return
            scanner.stop()
