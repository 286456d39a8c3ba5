"""Scanner processes: the text parts of a search page, prescanned in parallel.

A search is CPU-bound Python: per text part, a manifest row parsed, four short syscalls (open, fstat,
read, close) and a bytes.find. Threads serialize on the GIL (measured: slower than one thread), so the
service keeps a few scanner processes, started once, and a search page hands each of them a piece: a
run of files.jsonl lines, as bytes the reader has already verified against the manifest's hash (a
scanner never reads a manifest itself).

A scanner parses each text row exactly as the reader does, opens the part beneath the package with the
same checks (PackageFiles: openat2 beneath the package without symlinks, O_NOFOLLOW, a regular file of
the registered size), reads it whole after the carried tail of the part before it in the same record
(for the piece's first row, the part the line before the piece names), and looks for the query. It
answers which text rows it scanned and which of them the reader must look at itself ("flagged"): a
match ending in the row's own bytes, or a piece's first row continuing a part the line before the piece
does not name. It stops before a row it cannot take (larger than the reader's buffer, damaged,
unreadable): the reader goes on from there in its own thread, meets that row and says why.

A scanner hashes nothing and hands nothing out: the reader re-reads every flagged part, verifies it and
builds the excerpts exactly as it does without scanners, so the answer is the same either way.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from continuum_handoff_read.deadline import Deadline
from continuum_handoff_read.errors import PackageDamaged
from continuum_handoff_read.files import PackageFiles
from continuum_handoff_read.manifest import TEXT_PARTS, TextPart, text_part
from continuum_runtime.logs import described

logger = logging.getLogger("continuum.handoff_read")

# A stopped scanner gets this long to exit before it is killed.
_STOP_SECONDS = 2.0
# multiprocessing's name of every scanner process (among multiprocessing.active_children()).
SCANNER_NAME = "handoff-read-scanner"


class Piece(NamedTuple):
    """A run of whole files.jsonl lines starting at byte `offset` of the stream, and how to scan it:
    the package directory (its path, and its device and inode as the reader opened it), the line before
    the piece (empty: none), the query and the largest part a row may have (the reader's buffer).

    A scanner scans a piece whole (the reader cuts it where its page's budget ends, and a page may pick
    up a piece read ahead by the page before): its work is bounded by the piece's rows, at most
    search.PIECE_MAX_BYTES of manifest, times `max_part`."""

    package_dir: str
    package: tuple[int, int]
    offset: int
    lines: bytes
    previous: bytes
    query: bytes
    max_part: int


class Prescan(NamedTuple):
    """What a scanner found in a piece: the offsets and sizes of the text rows it scanned, in order; the
    indexes of those the reader must look at; and the offset of the first line it did not handle (the
    piece's end when it handled all)."""

    offsets: list[int]
    sizes: list[int]
    flagged: list[int]
    end: int


def prescan(piece: Piece, files: PackageFiles, buffer: bytearray) -> Prescan:
    """Scan `piece` (in a scanner process) in `files` with `buffer` (at least max_part + len(query) bytes)."""
    offsets: list[int] = []
    sizes: list[int] = []
    flagged: list[int] = []
    view = memoryview(buffer)
    query = piece.query
    carry_bytes = len(query) - 1
    # Every text part lives in one directory, opened once; a part's name is the tail of the path
    # text_part checked against merge's layout (``<recordRef>-<part>.txt``).
    try:
        directory = files.directory(TEXT_PARTS)
    except PackageDamaged:
        return Prescan(offsets, sizes, flagged, piece.offset)  # the reader meets it and says why
    read_named, name_at = files.read_named, len(TEXT_PARTS) + 1
    here = piece.offset
    previous = _text_part_or_none(piece.previous)
    # The tail of the part before the piece is read only if the piece's first row continues it.
    tail: bytes | None = None
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
        if size > piece.max_part:
            return Prescan(offsets, sizes, flagged, start)
        chained = row.follows(previous)
        try:
            if not chained:
                tail = b""
            elif tail is None and previous is not None:
                tail = files.tail(previous.path, previous.size, carry_bytes)
            kept = len(tail or b"")
            end = kept + size
            buffer[:kept] = tail or b""
            read_named(directory, row.path[name_at:], size, view[kept:end])
        except (PackageDamaged, OSError):
            return Prescan(offsets, sizes, flagged, start)
        # Any match found has a byte in this part: the carried bytes are one byte shorter than the query.
        # A first row continuing a part this scanner could not check is the reader's to scan.
        if buffer.find(query, 0, end) >= 0 or (not chained and row.part > 0 and not offsets):
            flagged.append(len(offsets))
        offsets.append(start)
        sizes.append(size)
        tail = bytes(view[max(0, end - carry_bytes) : end]) if carry_bytes else b""
        previous = row
    return Prescan(offsets, sizes, flagged, piece.offset + len(piece.lines))


def _text_part_or_none(line: bytes) -> TextPart | None:
    try:
        return text_part(line) if line else None
    except PackageDamaged:
        return None


class _Packages:
    """The package directories a scanner has open, by path and identity (a few: one per search at once)."""

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._open: dict[tuple[str, int, int], PackageFiles] = {}

    def get(self, piece: Piece) -> PackageFiles | None:
        """The piece's package opened, if it is still the directory the reader opened."""
        key = (piece.package_dir, *piece.package)
        files = self._open.get(key)
        if files is not None:
            return files
        if len(self._open) >= self._capacity:
            for opened in self._open.values():
                opened.close()
            self._open.clear()
        try:
            files = PackageFiles(Path(piece.package_dir))
        except PackageDamaged:
            return None
        if files.identity() != piece.package:
            files.close()  # replaced since the reader opened it
            return None
        self._open[key] = files
        return files


def _serve(connection: Connection) -> None:
    """A scanner process: answer pieces until the reader closes the pipe or sends None."""
    # Ctrl-C in a terminal reaches the whole process group: the service decides when scanners stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    buffer = bytearray()
    packages = _Packages()
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
            files = packages.get(piece)
            answer = Prescan([], [], [], piece.offset) if files is None else prescan(piece, files, buffer)
            connection.send(answer)
        except Exception as error:
            # A programming error: the reader logs it (its frames, never its message, which may quote
            # package text) and scans the page itself.
            connection.send(described(error))


class Scanner:
    """One scanner process and the reader's end of its pipe.

    A page may end with pieces still out (its budget ran out first, or its caller went away): their
    answers stay in the pipe, and the next borrower skips that many answers before its own (a scanner
    answers in order). What is out, stale or not, never exceeds what the pipe's buffer holds, so a send
    never waits for a scanner (one stuck in a read must not hold a call past its deadline).
    """

    def __init__(self, context: Any) -> None:
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name=SCANNER_NAME, daemon=True)
        self.process.start()
        child.close()
        # Half the kernel's send buffer of the pipe (it counts its own overhead in the other half).
        with socket.socket(fileno=os.dup(self.connection.fileno())) as end:
            self._buffer_bytes = end.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        # Pieces sent in all (a parked page is picked up only if none was sent since), and those not
        # answered yet with their bytes.
        self.sent = 0
        self.outstanding = 0
        self._out_bytes: deque[int] = deque()
        self._stale = 0
        # Set when the process died, failed or kept a borrower waiting past its deadline: never lent again.
        self.broken = False

    def lend(self, keep: int = 0) -> bool:
        """Make the answers still out stale but the last `keep` (a parked page's pieces the borrower picks
        up): the borrower's pieces are the next ones answered. False when fewer than `keep` are out."""
        if keep > self.outstanding:
            self._stale = self.outstanding
            return False
        self._stale = self.outstanding - keep
        return True

    def takes(self, piece: Piece) -> bool:
        """Whether `piece` fits in what the pipe still buffers."""
        return not self.broken and sum(self._out_bytes) + _wire_bytes(piece) <= self._buffer_bytes

    def send(self, piece: Piece) -> bool:
        """Hand `piece` over; False when the process is gone."""
        try:
            self.connection.send(piece)
        except OSError:
            self.broken = True
            return False
        self.sent += 1
        self.outstanding += 1
        self._out_bytes.append(_wire_bytes(piece))
        return True

    def receive(self, deadline: Deadline) -> Prescan | None:
        """The answer to the oldest piece this borrower sent, or None: the process died or failed, or
        the deadline passed (a scanner still working when its caller went away is not broken: its
        answer is skipped as stale later)."""
        while True:
            try:
                answer = self.connection.recv() if self.connection.poll(deadline.remaining()) else None
            except (EOFError, OSError):
                answer = None
            if answer is None:
                self.broken = self.broken or not (deadline.cancelled() and self.process.is_alive())
                return None
            self.outstanding -= 1
            self._out_bytes.popleft()
            if self._stale > 0:
                self._stale -= 1
                continue
            if isinstance(answer, dict):
                self.broken = True
                logger.error("a search scanner failed; the page is scanned in the reader's thread", extra=answer)
                return None
            prescanned: Prescan = answer
            return prescanned

    def stop(self) -> None:
        """Ask the process to exit (kill it when it does not)."""
        if self.broken or self.outstanding:
            self.process.kill()  # it may be stuck: a request to stop could wait behind its pieces
        else:
            with suppress(OSError):
                self.connection.send(None)
        self.connection.close()
        self.process.join(_STOP_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _wire_bytes(piece: Piece) -> int:
    # The pickled piece: its byte strings and a little framing.
    return len(piece.lines) + len(piece.previous) + len(piece.query) + len(piece.package_dir) + 512


class Pipeline:
    """Pieces out on lent scanners, at most `depth` per scanner (so none idles between two pieces),
    their answers taken in the order the pieces were sent."""

    def __init__(self, scanners: Sequence[Scanner], deadline: Deadline, depth: int = 2) -> None:
        self.scanners = scanners
        # Set anew by each call that picks a parked pipeline up.
        self.deadline = deadline
        self._depth = depth
        self._out: deque[tuple[Piece, Scanner]] = deque()
        self.out_bytes = 0

    def room(self) -> bool:
        """Whether a scanner has fewer than `depth` pieces out (stale ones counted)."""
        return any(not scanner.broken and scanner.outstanding < self._depth for scanner in self.scanners)

    def send(self, piece: Piece) -> bool:
        """Hand `piece` to the least busy scanner it fits; False when none takes it now, or sending failed."""
        ready = [s for s in self.scanners if s.outstanding < self._depth and s.takes(piece)]
        if not ready:
            return False
        scanner = min(ready, key=lambda candidate: candidate.outstanding)
        if not scanner.send(piece):
            return False
        self._out.append((piece, scanner))
        self.out_bytes += len(piece.lines)
        return True

    def next(self) -> tuple[Piece, Prescan] | None:
        """The oldest piece out and its answer; None when nothing is out or a scanner failed."""
        if not self._out:
            return None
        piece, scanner = self._out.popleft()
        self.out_bytes -= len(piece.lines)
        answer = scanner.receive(self.deadline)
        if answer is None and scanner.broken:
            # Past the deadline the others' pieces may be stuck too: none of them is lent again.
            for other in self.scanners:
                other.broken = other.broken or other.outstanding > 0
        return None if answer is None else (piece, answer)

    @property
    def empty(self) -> bool:
        """Whether no piece is out."""
        return not self._out

    def out_on(self, scanner: Scanner) -> int:
        """How many pieces are out on `scanner`."""
        return sum(1 for _, holder in self._out if holder is scanner)


class Parked(NamedTuple):
    """A search page that ended at its budget with pieces out (read ahead for the next page), kept for
    the next page of the same search: `key` is what the answers depend on (package, manifest, query,
    limits), `row` and `previous` where the next page starts; `head` the answered piece the page ended
    in and the index of its first row not taken; `sent` and `before` where the next piece starts and
    the line before it; `ratio` the text bytes per manifest byte seen so far; `sent_by` how many pieces
    each of the pipeline's scanners had been sent when the page parked (another page's since: dropped)."""

    key: Hashable
    row: int
    previous: int
    head: tuple[Piece, Prescan, int] | None
    pipeline: Pipeline
    sent: int
    before: bytes
    ratio: float
    sent_by: tuple[int, ...]


class Lent(NamedTuple):
    """What a page borrowed: the idle scanners, and the parked page it continues (if any)."""

    scanners: list[Scanner]
    parked: Parked | None


class Scanners:
    """The service's scanner processes, lent to one search page at a time (a page that finds none idle,
    because other searches hold them, scans in its own thread). Thread-safe: a page takes the parked
    read-ahead and the idle scanners together, and gives them back together, under one lock."""

    def __init__(self, count: int) -> None:
        # forkserver: the service runs gRPC threads, which a plain fork would copy mid-flight.
        self._context = multiprocessing.get_context("forkserver")
        self._lock = threading.Lock()
        self._idle: list[Scanner] = [Scanner(self._context) for _ in range(count)]
        self._closed = False
        self._parked: Parked | None = None

    @contextmanager
    def borrow(self, key: Hashable, row: int, previous: int) -> Iterator[Lent]:
        """Every idle scanner (possibly none), returned when the block ends; with the parked page when
        it was parked by this search (`key`) for a page starting at `row` after `previous`, and no
        other page used its scanners since. Any other parked page is dropped (its answers are skipped
        as stale)."""
        with self._lock:
            parked, self._parked = self._parked, None
            taken, self._idle = self._idle, []
        if parked is not None and not _continues(parked, key, row, previous, taken):
            parked = None
        for scanner in taken:
            if not scanner.lend(parked.pipeline.out_on(scanner) if parked is not None else 0):
                parked = None
        if parked is None:
            for scanner in taken:
                scanner.lend()
        try:
            yield Lent(taken, parked)
        finally:
            self._give_back(taken)

    def park(self, parked: Parked) -> None:
        """Keep a page's read-ahead for the next page of its search (the last parked wins)."""
        with self._lock:
            self._parked = parked

    def _give_back(self, scanners: list[Scanner]) -> None:
        kept: list[Scanner] = []
        for scanner in scanners:
            if not (scanner.broken or not scanner.process.is_alive()):
                kept.append(scanner)
                continue
            scanner.stop()
            try:
                kept.append(Scanner(self._context))
            except Exception:
                logger.exception("a search scanner could not be replaced; searches have one less")
        with self._lock:
            closed = self._closed
            if not closed:
                self._idle.extend(kept)
        if closed:
            for scanner in kept:
                scanner.stop()

    def close(self) -> None:
        """Stop every idle scanner; borrowed ones stop when they are given back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for scanner in idle:
            scanner.stop()


def _continues(parked: Parked, key: Hashable, row: int, previous: int, taken: list[Scanner]) -> bool:
    """Whether a page starting at `row` after `previous` of search `key` continues `parked`: its scanners
    all lent now, unbroken, and sent nothing since it parked."""
    scanners = parked.pipeline.scanners
    return (
        parked.key == key
        and (parked.row, parked.previous) == (row, previous)
        and all(scanner in taken and not scanner.broken for scanner in scanners)
        and tuple(scanner.sent for scanner in scanners) == parked.sent_by
    )
