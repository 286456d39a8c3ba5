"""Verifying a sealed snapshot against its own hashes: seal → manifest → streams → every file.

Streams and files are read in bounded chunks; what is held in memory grows only with the number of
distinct attachments (their digests), never with the history. Runs blocking: call it in a thread.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from continuum_merge.snapshot.errors import PackageDamaged
from continuum_merge.snapshot.layout import (
    ASSETS_DIR,
    FILES,
    FORMAT,
    MANIFEST,
    RAW_DIR,
    RECORDS,
    SEAL,
    SNAPSHOT,
    STREAMS,
    TEXT_DIR,
    SealedSnapshot,
    is_package_path,
)

READ_BYTES = 1024 * 1024
TOP_LEVEL = frozenset({MANIFEST, SEAL, *STREAMS, RAW_DIR, TEXT_DIR, ASSETS_DIR})


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file, one line at a time."""
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as error:
                raise PackageDamaged(str(path.parent.parent), f"{path.name} line {number} is not JSON") from error
            if not isinstance(row, dict):
                raise PackageDamaged(str(path.parent.parent), f"{path.name} line {number} is not an object")
            yield row


def _file_digest(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(READ_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _load_json(path: Path, package: str) -> tuple[bytes, dict[str, Any]]:
    if path.is_symlink() or not path.is_file():
        raise PackageDamaged(package, f"{path.name} is missing")
    data = path.read_bytes()
    try:
        value = json.loads(data)
    except ValueError as error:
        raise PackageDamaged(package, f"{path.name} is not JSON") from error
    if not isinstance(value, dict):
        raise PackageDamaged(package, f"{path.name} is not an object")
    return data, value


def verify_snapshot(package_dir: Path) -> SealedSnapshot:
    """Check `<package_dir>/snapshot/` whole: the seal names the manifest's hash, the manifest names each
    stream's hash, count and size, files.jsonl names each file's size and hash, and the tree holds
    exactly the listed files (no symlinks, no strays). Returns what the seal stands for; PackageDamaged
    on the first mismatch, and on anything unreadable or malformed."""
    try:
        return _verify(package_dir)
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise PackageDamaged(str(package_dir), f"unreadable or malformed ({type(error).__name__})") from error


def _verify(package_dir: Path) -> SealedSnapshot:
    package = str(package_dir)
    snapshot = package_dir / SNAPSHOT
    if snapshot.is_symlink() or not snapshot.is_dir():
        raise PackageDamaged(package, "there is no sealed snapshot")
    _, seal = _load_json(snapshot / SEAL, package)
    manifest_bytes, manifest = _load_json(snapshot / MANIFEST, package)
    snapshot_hash = hashlib.sha256(manifest_bytes).hexdigest()
    if seal.get("format") != FORMAT or seal.get("manifestHash") != snapshot_hash:
        raise PackageDamaged(package, "the seal does not match the manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") != seal.get("version"):
        raise PackageDamaged(package, "the manifest's format or version differs from the seal")
    for entry in snapshot.iterdir():
        if entry.name not in TOP_LEVEL or entry.is_symlink():
            raise PackageDamaged(package, f"unexpected entry {entry.name}")
    streams = manifest.get("streams")
    if not isinstance(streams, dict) or set(streams) != set(STREAMS):
        raise PackageDamaged(package, "the manifest does not describe every stream")
    for name in STREAMS:
        digest, size = _file_digest(snapshot / name)
        lines = _count_lines(snapshot / name)
        if {"sha256": digest, "count": lines, "bytes": size} != streams[name]:
            raise PackageDamaged(package, f"{name} differs from the manifest")
    byte_count, listed = _verify_files(snapshot, package)
    if byte_count != manifest.get("byteCount"):
        raise PackageDamaged(package, "the files' sizes do not add up to the manifest's byte count")
    if _count_tree(snapshot, package) != listed:
        raise PackageDamaged(package, "the tree holds files that files.jsonl does not list")
    blocking = manifest.get("blockingRecordRefs")
    if not isinstance(blocking, list):
        raise PackageDamaged(package, "the manifest lacks its blocking records")
    return SealedSnapshot(int(manifest["version"]), snapshot_hash, int(streams[RECORDS]["count"]), byte_count,
                          tuple(str(ref) for ref in blocking))  # fmt: skip


def _count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def _verify_files(snapshot: Path, package: str) -> tuple[int, int]:
    """Every files.jsonl row against its file; the bytes of all rows, and how many distinct files."""
    byte_count = 0
    distinct = 0
    assets: set[str] = set()
    for row in iter_jsonl(snapshot / FILES):
        path = row.get("path")
        if not isinstance(path, str) or not is_package_path(path):
            raise PackageDamaged(package, "files.jsonl lists a path outside the layout")
        byte_count += int(row.get("bytes", -1))
        if path.startswith(ASSETS_DIR + "/"):
            if path in assets:
                continue
            assets.add(path)
        distinct += 1
        target = snapshot / path
        if target.is_symlink() or not target.is_file():
            raise PackageDamaged(package, f"{path} is missing")
        if _file_digest(target) != (row.get("sha256"), row.get("bytes")):
            raise PackageDamaged(package, f"{path} does not match its hash")
    return byte_count, distinct


def _count_tree(snapshot: Path, package: str) -> int:
    count = 0
    for directory in (RAW_DIR, TEXT_DIR, ASSETS_DIR):
        with os.scandir(snapshot / directory) as entries:
            for entry in entries:
                if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
                    raise PackageDamaged(package, f"{directory}/{entry.name} is not a regular file")
                if not is_package_path(f"{directory}/{entry.name}"):
                    raise PackageDamaged(package, f"{directory}/{entry.name} is not a package file name")
                count += 1
    return count
