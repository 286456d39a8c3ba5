"""Reading a sealed snapshot and writing work and handoff files: the only file access of extraction.

The operation's directory (`package_dir`, ``<package root>/<operation id>/``) holds ``snapshot/``
(sealed; read only here), ``work/`` (unit results) and ``handoff/``. What extraction reads of the
snapshot, in the layout of issue 9 and seed 000 §4.2:

- ``seal.json``: present only once sealed; its ``manifestHash`` is the sha256 of ``manifest.json``,
  which is the snapshot hash (the manifest carries every stream's hash, the streams every file's).
- ``records.jsonl``: one record per line, in source → message order:
  ``{"recordRef", "origin": {"sessionId", "recordId", "version", "kind"}, "role", "createdAt",
  "rawRef", "processingPolicy"}``; only ``processingPolicy == "extract"`` is sent to a model.
- ``files.jsonl``: one file per line, each record's files together and in records.jsonl's order:
  ``{"ref", "recordRef", "part", "path", "bytes", "sha256", "kind"}``; ``kind == "text"`` rows are
  UTF-8 parts (``text/<recordRef>-<part>.txt``) in part order; others (``raw``, ``asset``; no part
  number) are originals never sent to a model; an ``asset`` row also names its ``mediaType``.

Every path comes from a manifest, is checked to stay inside the snapshot (relative, no ``..``, no
symlink) and every byte read is checked against the recorded size and sha256.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from continuum_merge.extraction.errors import PackageUnreadable, StorageShort

__all__ = [
    "HANDOFF_DIR",
    "SNAPSHOT_DIR",
    "STORAGE_ERRNOS",
    "WORK_DIR",
    "FileRow",
    "RecordRow",
    "file_sha256",
    "fsync_dir",
    "iter_files",
    "iter_jsonl",
    "iter_part_chunks",
    "iter_records",
    "read_part_range",
    "read_text_part",
    "snapshot_identity",
    "write_atomic",
]

SNAPSHOT_DIR = "snapshot"
WORK_DIR = "work"
HANDOFF_DIR = "handoff"

_HASH = re.compile(r"[0-9a-f]{64}")
# One path segment as the program names files: no separators, no leading dot.
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")
_CHUNK = 1 << 20
# A write failing with one of these is short of storage (disk full, quota, file size limit), not a bug:
# the operation pauses until space is freed.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


@dataclass(frozen=True)
class RecordRow:
    """One line of records.jsonl, the fields extraction uses."""

    record_ref: str
    session_id: str
    role: str
    processing_policy: str


@dataclass(frozen=True)
class FileRow:
    """One line of files.jsonl."""

    ref: str
    record_ref: str
    part: int
    path: str
    size: int
    sha256: str
    kind: str
    # An asset's media type as transcript recorded it ("" for raw and text rows).
    media_type: str = ""


def snapshot_identity(package_dir: Path) -> str:
    """The snapshot hash: the sha256 of manifest.json, as seal.json records it (``manifestHash``).

    Raises PackageUnreadable when the snapshot is not sealed or its manifest is not the one sealed.
    """
    snapshot = package_dir / SNAPSHOT_DIR
    try:
        seal = json.loads((snapshot / "seal.json").read_bytes())
        manifest_hash = file_sha256(snapshot / "manifest.json")
    except (OSError, ValueError) as exc:
        raise PackageUnreadable(f"snapshot is not sealed: seal or manifest unreadable ({type(exc).__name__})") from exc
    if not isinstance(seal, dict) or seal.get("manifestHash") != manifest_hash:
        raise PackageUnreadable("snapshot manifest.json does not match the hash in seal.json")
    return manifest_hash


def iter_jsonl(path: Path, start: int = 0) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of a JSONL file from byte `start` on, each with the byte offset of its line.

    Read one line at a time; PackageUnreadable names the offset of the first bad line.
    """
    try:
        with path.open("rb") as lines:
            lines.seek(start)
            offset = start
            for line in lines:
                here, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError:
                    value = None
                if not isinstance(value, dict):
                    raise PackageUnreadable(f"{path.name} line at byte {here} is not a JSON object")
                yield here, value
    except OSError as exc:
        raise PackageUnreadable(f"{path.name} unreadable ({type(exc).__name__})") from exc


def iter_records(package_dir: Path, start: int = 0) -> Iterator[tuple[int, RecordRow]]:
    """records.jsonl of the sealed snapshot from byte `start` on, in its order, with each line's offset."""
    path = package_dir / SNAPSHOT_DIR / "records.jsonl"
    for offset, row in iter_jsonl(path, start):
        origin = row.get("origin")
        session_id = origin.get("sessionId") if isinstance(origin, dict) else None
        record_ref, role, policy = (row.get(key) for key in ("recordRef", "role", "processingPolicy"))
        if not (
            isinstance(record_ref, str)
            and _HASH.fullmatch(record_ref)
            and isinstance(session_id, str)
            and isinstance(role, str)
            and isinstance(policy, str)
        ):
            raise PackageUnreadable(f"records.jsonl row at byte {offset} lacks recordRef, origin.sessionId or role")
        # Roles are compared in lower case: transcript's enum names them USER, ASSISTANT, TOOL.
        yield offset, RecordRow(record_ref, session_id, role.lower(), policy)


def iter_files(package_dir: Path, start: int = 0) -> Iterator[tuple[int, FileRow]]:
    """files.jsonl of the sealed snapshot from byte `start` on, with each line's offset; paths checked."""
    path = package_dir / SNAPSHOT_DIR / "files.jsonl"
    for offset, row in iter_jsonl(path, start):
        ref, record_ref, part, relative, size, sha256, kind, media_type = (
            row.get(key) for key in ("ref", "recordRef", "part", "path", "bytes", "sha256", "kind", "mediaType")
        )
        if not (
            isinstance(ref, str)
            and ref
            and isinstance(record_ref, str)
            # Text parts are numbered; a record's raw file and its assets have no part number.
            and ((isinstance(part, int) and part >= 0) or (part is None and kind != "text"))
            and isinstance(relative, str)
            and _safe_relative(relative)
            and isinstance(size, int)
            and size >= 0
            and isinstance(sha256, str)
            and _HASH.fullmatch(sha256)
            and isinstance(kind, str)
            and isinstance(media_type, str | None)
        ):
            raise PackageUnreadable(f"files.jsonl row at byte {offset} is incomplete or names an unsafe path")
        yield offset, FileRow(ref, record_ref, part or 0, relative, size, sha256, kind, media_type or "")


def read_text_part(package_dir: Path, relative: str, *, size: int, sha256: str) -> str:
    """The text of the part at `relative` in the snapshot, after checking its size and sha256.

    `relative` comes from files.jsonl (already checked to be a safe path); a symlink is never followed.
    """
    path = package_dir / SNAPSHOT_DIR / relative
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(descriptor, "rb") as part:
            # One byte more than recorded, so a grown file is noticed without reading all of it.
            data = part.read(size + 1)
    except OSError as exc:
        raise PackageUnreadable(f"text part {relative} unreadable ({type(exc).__name__})") from exc
    if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
        raise PackageUnreadable(f"text part {relative} does not match its size or sha256 in files.jsonl")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PackageUnreadable(f"text part {relative} is not UTF-8") from exc


def iter_part_chunks(package_dir: Path, relative: str, *, size: int, sha256: str) -> Iterator[bytes]:
    """The bytes of the part at `relative`, in chunks of at most 1 MiB, checked against `size` and
    `sha256` as they are read: PackageUnreadable after the last chunk when they do not match (a caller
    that acted on earlier chunks must then drop what it made of them)."""
    path = package_dir / SNAPSHOT_DIR / relative
    digest = hashlib.sha256()
    read = 0
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(descriptor, "rb") as part:
            # One byte more than recorded in all, so a grown file is noticed without reading all of it.
            while read <= size and (chunk := part.read(min(_CHUNK, size + 1 - read))):
                read += len(chunk)
                digest.update(chunk)
                yield chunk
    except OSError as exc:
        raise PackageUnreadable(f"text part {relative} unreadable ({type(exc).__name__})") from exc
    if read != size or digest.hexdigest() != sha256:
        raise PackageUnreadable(f"text part {relative} does not match its size or sha256 in files.jsonl")


def read_part_range(package_dir: Path, relative: str, *, start: int, end: int, sha256: str) -> str:
    """The text of bytes [start, end) of the part at `relative` (a slice cut on code point boundaries),
    after checking them against the slice's `sha256`; only those bytes are read."""
    path = package_dir / SNAPSHOT_DIR / relative
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(descriptor, "rb") as part:
            part.seek(start)
            data = part.read(end - start)
    except OSError as exc:
        raise PackageUnreadable(f"text part {relative} unreadable ({type(exc).__name__})") from exc
    if len(data) != end - start or hashlib.sha256(data).hexdigest() != sha256:
        raise PackageUnreadable(f"a slice of text part {relative} does not match its planned sha256")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PackageUnreadable(f"a slice of text part {relative} is not UTF-8 cut on code points") from exc


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> str:
    """Write `data` to `path` through a temporary file, fsync and rename; returns its sha256.

    A reader sees the old file or the whole new one, never a part; a crash leaves at most a ``.tmp``.
    Out of storage (`STORAGE_ERRNOS`) the temporary file is removed and StorageShort raised.
    """
    temporary = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with temporary.open("wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
    except OSError as exc:
        if exc.errno not in STORAGE_ERRNOS:
            raise
        temporary.unlink(missing_ok=True)
        raise StorageShort(f"{path.parent.name}/{path.name}", errno.errorcode[exc.errno]) from exc
    os.replace(temporary, path)
    fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _safe_relative(relative: str) -> bool:
    """Whether `relative` is a program-made path inside the snapshot: relative, plain segments only."""
    parts = PurePosixPath(relative).parts
    return bool(parts) and "\\" not in relative and all(_SEGMENT.fullmatch(part) for part in parts)
