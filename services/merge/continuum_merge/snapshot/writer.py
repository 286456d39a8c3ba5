"""Writing the staging tree: files hashed as their bytes go out, JSONL streams hashed line by line, and
the free disk checked against the reserve before anything is written. Blocking I/O: callers run these
methods in a worker thread.

Files are written without an fsync each: the seal makes the whole staging tree durable at once with
`TreeSync` before its rename. An fsync per file costs the file's data, its inode and its
directory's blocks as separate synchronous writes plus a cache flush, tens of microseconds of CPU and
more of waiting for each of the ~55,000 files of a GiB of history; one syncfs writes them in large
batches and flushes once, with the same guarantee (every byte on disk before the rename)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from continuum_merge.snapshot.errors import DiskReserveShort
from continuum_merge.snapshot.layout import (
    ASSETS_DIR,
    FILES,
    GAPS,
    OCCURRENCES,
    RAW_DIR,
    RECORDS,
    STREAMS,
    TEXT_DIR,
    asset_path,
    raw_path,
    text_path,
)
from continuum_merge.snapshot.records import PreparedRecord, canonical, utf8_parts

# Free space is asked again after at most this many bytes were written since the last look.
RESERVE_CHECK_BYTES = 4 * 1024 * 1024
# The allocator's free pages are handed back once the process's resident memory grew this much past
# what it was after the last time. Every page handed back is faulted in (and zeroed) again by the next
# buffer that uses it. The buffers of the pages in flight (read ahead, being prepared, being written)
# take a few tens of MiB, so a smaller slack trims them on nearly every page: at 4 MiB a quarter of the
# copy's CPU went to page faults (1 GiB: 11.4-12.4 s of CPU against 10.0-10.6 s at 32 MiB, with 2.3
# times the faults). Bounded this way the resident memory stays within this many bytes of its trimmed
# level, which is flat in the history's size, whatever the sizes of the messages.
TRIM_SLACK_BYTES = 32 * 1024 * 1024
STREAM_BUFFER_BYTES = 1024 * 1024
# Creating a file takes its directory's lock, and every text part goes to text/: more threads than
# cores spin on that lock (measured: 8 threads cost 3x the system time of 2 for the same files).
WRITER_THREADS = 2
# Files one writer task creates in turn: few tasks for the many small records, yet a long message's
# parts spread over the threads.
FILES_PER_TASK = 16
# The most buffers one writev takes (a text part of a message of many short lines is many pieces).
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16


# glibc's mallopt parameter and the size from which allocations are always their own mapping: the
# buffers of a page of messages and of the records made of it (up to a few MiB; a message is at most
# 16 MiB) come from the heap and are reused within the page, instead of each being a fresh mapping
# whose memory is faulted in, zeroed and unmapped again. 32 MiB is glibc's largest threshold.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(None, use_errno=True)
# syncfs(2) is Linux's; elsewhere the seal fsyncs the staging tree file by file.
_SYNCFS = getattr(_LIBC, "syncfs", None)


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc's malloc_trim; a no-op elsewhere), so
    the buffers of the pages already written do not pile up as resident memory over a long copy."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc/self/statm); 0 where there is no such file."""
    try:
        descriptor = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        fields = os.read(descriptor, 256).split()
    finally:
        os.close(descriptor)
    return int(fields[1]) * PAGE_BYTES


def pin_allocator_threshold() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (by default it moves as large blocks are
    freed, so whether the copy's stream of 32 KiB-2 MiB buffers lands on the heap is left to chance,
    which fragments it and makes the process's memory creep with the history's size; fixed and trimmed
    whenever the resident memory grew TRIM_SLACK_BYTES, it stays flat). A process-wide setting,
    harmless elsewhere; a no-op without glibc."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def disk_free(path: Path) -> int:
    """Bytes available to this process on the file system holding `path`."""
    return shutil.disk_usage(path).free


# A record handed to the writer threads: its assets' files rows and the (bytes, sha256) of its raw file
# and text parts to come, in tasks of at most FILES_PER_TASK files.
_PendingRecord = tuple[PreparedRecord, Sequence[Mapping[str, Any]], list[Future[list[tuple[int, str]]]]]


class JsonlStream:
    """One append-only JSONL file whose sha256, line count and size grow with every line written."""

    def __init__(self, path: Path) -> None:
        self._handle: BinaryIO = path.open("xb", buffering=STREAM_BUFFER_BYTES)
        self._digest = hashlib.sha256()
        self.count = 0
        self.size = 0

    def write(self, row: Mapping[str, Any]) -> None:
        """Append one row."""
        line = canonical(row) + b"\n"
        self._digest.update(line)
        self._handle.write(line)
        self.count += 1
        self.size += len(line)

    def close(self) -> None:
        """Flush and close (idempotent); durable with the rest of the tree at the seal."""
        self._handle.close()

    def describe(self) -> dict[str, int | str]:
        """What the manifest records of the stream."""
        return {"sha256": self._digest.hexdigest(), "count": self.count, "bytes": self.size}


class AssetCopy:
    """Attachment bytes on their way into assets/: written to a scratch file and hashed chunk by chunk,
    then renamed to their digest (or discarded)."""

    def __init__(self, writer: PackageWriter, scratch: Path) -> None:
        self._writer = writer
        self._scratch = scratch
        self._handle: BinaryIO = scratch.open("xb")
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        """Append one chunk (checking the reserve first)."""
        self._writer.reserve(len(chunk))
        self._digest.update(chunk)
        self._handle.write(chunk)
        self.size += len(chunk)

    @property
    def sha256(self) -> str:
        """The digest of what was written so far."""
        return self._digest.hexdigest()

    def keep(self) -> str:
        """Rename into assets/<sha256>; the package path."""
        self._handle.close()
        path = asset_path(self.sha256)
        os.replace(self._scratch, self._writer.staging / path)
        return path

    def discard(self) -> None:
        """Drop the scratch file."""
        self._handle.close()
        self._scratch.unlink(missing_ok=True)


class PackageWriter:
    """The staging directory of one snapshot version being written."""

    def __init__(self, staging: Path, reserve_bytes: int, free_space: Callable[[Path], int] = disk_free) -> None:
        self.staging = staging
        # The staging directory as a string prefix: the paths of each record's files are joined to it
        # as strings (a Path per file costs more than its stat or open).
        self._prefix = f"{staging}{os.sep}"
        self._reserve_bytes = reserve_bytes
        self._free_space = free_space
        self._unchecked = RESERVE_CHECK_BYTES  # look at the disk before the first byte
        self._scratch_count = 0
        self.byte_count = 0
        self.blocking: list[str] = []
        # Operations whose packages contributed their originals.
        self.priors: list[str] = []
        for directory in (RAW_DIR, TEXT_DIR, ASSETS_DIR):
            (staging / directory).mkdir(parents=True)
        self.streams = {name: JsonlStream(staging / name) for name in STREAMS}
        # Creating and hashing files overlaps preparing the next page (sha256 and the system calls
        # release the GIL).
        self._pool = ThreadPoolExecutor(max_workers=WRITER_THREADS, thread_name_prefix="snapshot-writer")
        self._pending: list[_PendingRecord] = []
        self._pending_refs: set[str] = set()
        self._trimmed_resident = resident_bytes()

    def reserve(self, upcoming: int) -> None:
        """Refuse to write `upcoming` more bytes once the free space, less what was written since the
        last look, would fall below the reserve. The disk is asked every few MiB, not every write."""
        self._unchecked += upcoming
        if self._unchecked < RESERVE_CHECK_BYTES:
            return
        free = self._free_space(self.staging)
        if free - upcoming < self._reserve_bytes:
            raise DiskReserveShort(free, self._reserve_bytes)
        self._unchecked = 0

    def has_record(self, record_ref: str) -> bool:
        """Whether a record with this identity and version is already in the package (the raw file is
        the set: nothing per record is held in memory)."""
        return record_ref in self._pending_refs or os.path.exists(self._prefix + raw_path(record_ref))

    def has_asset(self, sha256: str) -> bool:
        """Whether bytes with this digest are already in assets/."""
        return os.path.exists(self._prefix + asset_path(sha256))

    def open_asset(self) -> AssetCopy:
        """A scratch file for incoming attachment bytes."""
        self._scratch_count += 1
        return AssetCopy(self, self.staging / ASSETS_DIR / f".incoming-{self._scratch_count}")

    def add_records(self, batch: Sequence[tuple[PreparedRecord, Sequence[Mapping[str, Any]]]]) -> None:
        """Write new records (each with the files rows of its assets). Their raw JSON and text parts go to
        the writer threads; their rows are written (in order) once the next batch was handed over or at
        `flush`, so that creating files overlaps preparing the next page. At most two batches are in
        flight."""
        submitted: list[_PendingRecord] = []
        for record, assets in batch:
            ref = record.record_ref
            # The text parts are views of the record's text pieces: cut without copying a byte.
            files: list[tuple[str, Sequence[bytes | memoryview]]] = [(raw_path(ref), record.raw)]
            files += [(text_path(ref, part), pieces) for part, pieces in enumerate(utf8_parts(record.text))]
            self.reserve(sum(len(piece) for _, pieces in files for piece in pieces))
            tasks = [
                self._pool.submit(_write_files, self._prefix, files[start : start + FILES_PER_TASK])
                for start in range(0, len(files), FILES_PER_TASK)
            ]
            submitted.append((record, assets, tasks))
        self.flush()
        self._pending = submitted
        self._pending_refs = {record.record_ref for record, _, _ in submitted}
        resident = resident_bytes()
        if resident == 0 or resident > self._trimmed_resident + TRIM_SLACK_BYTES:
            release_free_memory()
            self._trimmed_resident = resident_bytes()

    def flush(self) -> None:
        """Wait for the files of the records in flight and write their files rows and records lines."""
        for record, assets, tasks in self._pending:
            ref = record.record_ref
            files = [file for task in tasks for file in task.result()]
            for part, (size, sha) in enumerate(files, start=-1):
                if part < 0:
                    row: dict[str, Any] = {"ref": f"r_{ref}", "part": None, "kind": "raw", "path": raw_path(ref)}
                else:
                    row = {"ref": f"r_{ref}:p{part}", "part": part, "kind": "text", "path": text_path(ref, part)}
                self.streams[FILES].write({**row, "recordRef": ref, "bytes": size, "sha256": sha})
                self.byte_count += size
            for asset in assets:
                self.streams[FILES].write({**asset, "recordRef": ref})
                self.byte_count += int(asset["bytes"])
            self.streams[RECORDS].write(
                {
                    "recordRef": ref,
                    "origin": dict(record.origin),
                    "role": record.role,
                    "createdAt": record.created_at,
                    "rawRef": raw_path(ref),
                    "textParts": len(files) - 1,
                    "processingPolicy": record.processing_policy,
                }
            )
        self._pending = []
        self._pending_refs = set()

    def copy_record_file(self, source: Path, path: str) -> str:
        """Copy one file of an earlier package into the same place here, hashing while copying; its sha256.
        (The caller counts its bytes from the earlier package's files row.)"""
        digest = hashlib.sha256()
        with source.open("rb") as reading, (self.staging / path).open("xb") as writing:
            while chunk := reading.read(STREAM_BUFFER_BYTES):
                self.reserve(len(chunk))
                digest.update(chunk)
                writing.write(chunk)
        return digest.hexdigest()

    def occurrence(self, row: Mapping[str, Any]) -> None:
        """A record seen again at another position."""
        self.streams[OCCURRENCES].write(row)

    def gap(self, row: Mapping[str, Any]) -> None:
        """Something history lacks (non-blocking)."""
        self.streams[GAPS].write(row)

    def close(self) -> None:
        """Stop the writer threads (after their current files) and close every stream. Records still in
        flight are not listed: call `flush` first when the copy succeeded."""
        self._pool.shutdown()
        for stream in self.streams.values():
            stream.close()


def _write_files(prefix: str, files: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> list[tuple[int, str]]:
    """Create each (package path, pieces of its bytes) of `files` under `prefix` (the staging directory
    and a separator; none may exist yet); their sizes and sha256s. Plain descriptors: one open, writev
    and close per file, nothing buffered or copied on the way."""
    written: list[tuple[int, str]] = []
    for path, pieces in files:
        descriptor = os.open(prefix + path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            _write_all(descriptor, pieces)
        finally:
            os.close(descriptor)
        digest = hashlib.sha256()
        for piece in pieces:
            digest.update(piece)
        written.append((sum(len(piece) for piece in pieces), digest.hexdigest()))
    return written


def _write_all(descriptor: int, pieces: Sequence[bytes | memoryview]) -> None:
    """writev every byte of `pieces` (at most IOV_MAX of them per call), resuming after a short write."""
    remaining = [memoryview(piece) for piece in pieces if piece]
    while remaining:
        done = os.writev(descriptor, remaining[:IOV_MAX])
        while remaining and done >= len(remaining[0]):
            done -= len(remaining.pop(0))
        if remaining:
            remaining[0] = remaining[0][done:]


def fresh_directory(path: Path) -> None:
    """An empty directory at `path`: whatever an earlier attempt left there is removed, never reused."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


class TreeSync:
    """Makes a staging tree durable at once: Linux's syncfs(2) on the file system holding it, which since
    5.8 reports a write-back error met on that file system since this was opened, so a file whose bytes
    failed to reach the disk fails the seal as its fsync would have. Open it before the first file is
    written (an error met earlier, and already reported to another process, would not be). Where libc
    has no syncfs, `sync` fsyncs every file and directory of the tree instead."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def sync(self) -> None:
        """Everything of the tree on disk, the disk's cache flushed; OSError when write-back failed."""
        if _SYNCFS is None:
            _sync_tree(self._path)
        elif _SYNCFS(self._descriptor) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), str(self._path))

    def close(self) -> None:
        """Release the descriptor."""
        os.close(self._descriptor)


def _sync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory` (entries streamed, none listed in memory)."""
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _sync_tree(Path(entry.path))
                continue
            descriptor = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
    sync_directory(directory)


def sync_directory(path: Path) -> None:
    """fsync a directory, so renames and new entries in it are durable."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
