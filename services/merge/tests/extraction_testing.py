"""A small builder of sealed snapshot packages in the documented layout (importable as `extraction_testing`).

It writes what the snapshot stage seals (issue 9 "Snapshot package", as continuum_merge.snapshot writes
it): per record its raw file row, its text parts of at most 32 KiB of UTF-8 cut on code point boundaries
and its asset rows in files.jsonl, then its records.jsonl line (roles in transcript's upper case);
manifest.json with every stream's hash, and seal.json naming the manifest's sha256. So extraction is
tested against packages without running the snapshot stage.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PART_BYTES = 32 * 1024


@dataclass
class SnapshotBuilder:
    """Collects records, then `seal` writes them under ``<package_dir>/snapshot/``."""

    package_dir: Path
    part_bytes: int = PART_BYTES
    _records: list[dict[str, Any]] = field(default_factory=list)
    _files: list[dict[str, Any]] = field(default_factory=list)
    _texts: dict[str, bytes] = field(default_factory=dict)
    _raws: dict[str, bytes] = field(default_factory=dict)
    _sources: list[str] = field(default_factory=list)

    def add(self, session_id: str, record_id: int, role: str, text: str, *, policy: str = "extract") -> str:
        """Add one record with `text` cut into parts; returns its recordRef."""
        if session_id not in self._sources:
            self._sources.append(session_id)
        raw = json.dumps({"id": record_id, "role": role, "content": text}, sort_keys=True).encode()
        version = hashlib.sha256(raw).hexdigest()
        record_ref = hashlib.sha256(f"{session_id}\n{record_id}\n{version}".encode()).hexdigest()
        self._records.append(
            {
                "recordRef": record_ref,
                "origin": {"sessionId": session_id, "recordId": record_id, "version": version, "kind": "message"},
                "role": role.upper(),
                "createdAt": f"2026-11-30T12:00:{record_id % 60:02d}Z",
                "rawRef": f"raw/{record_ref}.json",
                "processingPolicy": policy,
            }
        )
        self._raws[record_ref] = raw
        self._files.append(
            {
                "ref": f"r_{record_ref}",
                "recordRef": record_ref,
                "part": None,
                "path": f"raw/{record_ref}.json",
                "bytes": len(raw),
                "sha256": hashlib.sha256(raw).hexdigest(),
                "kind": "raw",
            }
        )
        for part, chunk in enumerate(split_utf8(text, self.part_bytes)):
            path = f"text/{record_ref}-{part}.txt"
            self._texts[path] = chunk
            self._files.append(
                {
                    "ref": f"r_{record_ref}:p{part}",
                    "recordRef": record_ref,
                    "part": part,
                    "path": path,
                    "bytes": len(chunk),
                    "sha256": hashlib.sha256(chunk).hexdigest(),
                    "kind": "text",
                }
            )
        return record_ref

    def add_asset(self, record_ref: str, data: bytes) -> None:
        """Add an attachment original of the record just added (kind asset: not sent to a model)."""
        path = f"assets/{_sha(data)}"
        self._texts[path] = data
        self._files.append(
            {
                "ref": f"a_{_sha(data)}",
                "recordRef": record_ref,
                "part": None,
                "path": path,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "kind": "asset",
            }
        )

    def seal(self) -> Path:
        """Write the snapshot directory and its seal; returns the package (operation) directory."""
        snapshot = self.package_dir / "snapshot"
        for relative, data in [*self._texts.items(), *((f"raw/{ref}.json", raw) for ref, raw in self._raws.items())]:
            (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / relative).write_bytes(data)
        manifests = {
            "records.jsonl": _jsonl(self._records),
            "files.jsonl": _jsonl(self._files),
            "occurrences.jsonl": b"",
            "gaps.jsonl": b"",
        }
        for name, data in manifests.items():
            (snapshot / name).write_bytes(data)
        manifest = {
            "version": 1,
            "sources": self._sources,
            "counts": {"records": len(self._records), "files": len(self._files)},
            "hashes": {name: hashlib.sha256(data).hexdigest() for name, data in manifests.items()},
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        (snapshot / "manifest.json").write_bytes(manifest_bytes)
        seal = {"format": "continuum-merge-snapshot/v1", "version": 1, "manifestHash": _sha(manifest_bytes)}
        (snapshot / "seal.json").write_bytes(json.dumps(seal, sort_keys=True).encode())
        return self.package_dir


def split_utf8(text: str, limit: int) -> list[bytes]:
    """`text` as UTF-8 parts of at most `limit` bytes, cut on code point boundaries."""
    data = text.encode()
    parts = []
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:
            end -= 1
        parts.append(data[start:end])
        start = end
    return parts or [b""]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(row, sort_keys=True).encode() + b"\n" for row in rows)
