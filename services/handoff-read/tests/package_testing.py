"""Merge packages written by the tests, in exactly the layout merge writes (importable as
`package_testing`).

This mirrors merge's writers (services/merge: snapshot/writer.py, snapshot/records.py, snapshot/build.py
and extraction/aggregate.py): canonical JSON lines (sorted keys, no spaces), raw/<recordRef>.json,
text parts of at most 32 KiB cut on code point boundaries, assets/<sha256>, manifest.json with each
stream's sha256, count and bytes, seal.json; handoff/details/<unit>.json, text/<unit>.txt,
details.jsonl, overview.json, brief.json, handoff.md and ready.json listing their sha256. The tests
check that merge's own verifiers accept what this writes, so the mirror cannot drift silently. It
exists for inputs a real merge cannot produce quickly (tens of MiB, split matches, planted files);
the real merge is exercised by test_real_package.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

TEXT_PART_BYTES = 32 * 1024
FORMAT = "continuum-merge-snapshot/v1"
SCHEMA_VERSION = 2


def canonical(value: object) -> bytes:
    """merge's one serialization: JSON with sorted keys, no spaces, UTF-8."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def sha256_hex(data: bytes) -> str:
    """Lowercase hex sha256."""
    return hashlib.sha256(data).hexdigest()


def utf8_parts(data: bytes, limit: int = TEXT_PART_BYTES) -> list[bytes]:
    """`data` in parts of at most `limit` bytes, each ending on a code point boundary (one empty part
    for empty text), as merge cuts them."""
    if not data:
        return [b""]
    parts = []
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:
            end -= 1
        parts.append(data[start:end])
        start = end
    return parts


class _Stream:
    def __init__(self, path: Path) -> None:
        self._handle: BinaryIO = path.open("xb")
        self._digest = hashlib.sha256()
        self.count = 0
        self.size = 0

    def write(self, row: dict[str, Any]) -> None:
        line = canonical(row) + b"\n"
        self._digest.update(line)
        self._handle.write(line)
        self.count += 1
        self.size += len(line)

    def close(self) -> dict[str, Any]:
        self._handle.close()
        return {"sha256": self._digest.hexdigest(), "count": self.count, "bytes": self.size}


@dataclass
class Item:
    """A detail item as a unit result holds it."""

    section: str
    status: str
    content: str
    evidence: list[dict[str, Any]]


@dataclass
class PackageBuilder:
    """Writes `<package_dir>/snapshot/` and `<package_dir>/handoff/` for one operation."""

    package_dir: Path
    version: int = 1
    sources: list[dict[str, Any]] = field(default_factory=list)
    byte_count: int = 0
    units: list[tuple[str, list[Item]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.snapshot = self.package_dir / "snapshot"
        for directory in ("raw", "text", "assets"):
            (self.snapshot / directory).mkdir(parents=True)
        self.streams = {
            name: _Stream(self.snapshot / name)
            for name in ("records.jsonl", "files.jsonl", "occurrences.jsonl", "gaps.jsonl")
        }
        self._assets: set[str] = set()

    def _record(
        self, kind: str, session_id: str, record_id: str, said: dict[str, Any], raw: dict[str, Any], text: bytes,
        role: str, policy: str, assets: list[dict[str, Any]],
    ) -> str:  # fmt: skip
        version = sha256_hex(canonical(said))
        origin = {"kind": kind, "sessionId": session_id, "recordId": record_id, "version": version}
        ref = sha256_hex(canonical({"kind": kind, "sessionId": session_id, "recordId": record_id, "version": version}))
        raw_bytes = canonical({"recordRef": ref, "origin": origin, "createdAt": "2024-01-01T00:00:00Z", **raw})
        files = self.streams["files.jsonl"]
        raw_path = f"raw/{ref}.json"
        (self.snapshot / raw_path).write_bytes(raw_bytes)
        files.write({"ref": f"r_{ref}", "part": None, "kind": "raw", "recordRef": ref, "path": raw_path,
                     "bytes": len(raw_bytes), "sha256": sha256_hex(raw_bytes)})  # fmt: skip
        self.byte_count += len(raw_bytes)
        parts = utf8_parts(text)
        for number, data in enumerate(parts):
            path = f"text/{ref}-{number}.txt"
            (self.snapshot / path).write_bytes(data)
            files.write({"ref": f"r_{ref}:p{number}", "part": number, "kind": "text", "recordRef": ref,
                         "path": path, "bytes": len(data), "sha256": sha256_hex(data)})  # fmt: skip
            self.byte_count += len(data)
        for asset in assets:
            files.write({**asset, "recordRef": ref})
            self.byte_count += int(asset["bytes"])
        self.streams["records.jsonl"].write(
            {"recordRef": ref, "origin": origin, "role": role, "createdAt": "2024-01-01T00:00:00Z",
             "rawRef": raw_path, "textParts": len(parts), "processingPolicy": policy}
        )  # fmt: skip
        return ref

    def session(self, session_id: str, root_session_id: str, title: str = "", last_message_id: int = 0) -> str:
        """A session record (as merge's prepare_session writes it); a root also becomes a source."""
        described = {
            "cut": {"lastMessageId": last_message_id, "historyGeneration": 0},
            "kind": "CHAT" if session_id == root_session_id else "SUBTASK",
            "parentSessionId": "" if session_id == root_session_id else root_session_id,
            "rootSessionId": root_session_id,
            "title": title,
            "model": "primary-model",
            "workingDirectory": f"/work/{root_session_id}",
            "metadata": {},
        }
        if session_id == root_session_id:
            self.sources.append({"rootSessionId": session_id, "sessionCount": 1, "lastMessageId": last_message_id})
        text = f"[session {session_id} of tree {root_session_id}]\ntitle: {title}\n".encode()
        return self._record("session", session_id, session_id, described, {"session": described}, text,
                            "reference", "reference", [])  # fmt: skip

    def message(
        self, session_id: str, message_id: int, text: str | bytes, role: str = "USER",
        attachments: Sequence[tuple[str, str, bytes]] = (),
    ) -> str:  # fmt: skip
        """A message record whose text projection is `text` (written as is); its attachments' bytes go to
        assets/ once per digest. Returns the recordRef."""
        body = text if isinstance(text, bytes) else text.encode()
        rows = []
        content: list[dict[str, Any]] = [{"text": body.decode(errors="replace")}]
        for index, (attachment_id, media_type, data) in enumerate(attachments, start=1):
            digest = sha256_hex(data)
            if digest not in self._assets:
                (self.snapshot / "assets" / digest).write_bytes(data)
                self._assets.add(digest)
            rows.append({"ref": f"a_{digest}", "part": index, "path": f"assets/{digest}", "bytes": len(data),
                         "sha256": digest, "kind": "asset", "attachmentId": attachment_id,
                         "mediaType": media_type})  # fmt: skip
            content.append({"attachment": {"attachmentId": attachment_id, "mediaType": media_type}})
        said = {"role": role, "content": content, "toolCalls": [], "toolCallId": "", "status": "COMPLETE",
                "metadata": {}}  # fmt: skip
        return self._record("message", session_id, str(message_id), said,
                            {"rootSessionId": session_id, "message": said}, body, role, "extract", rows)  # fmt: skip

    def unit(self, unit_id: str, items: list[Item]) -> list[str]:
        """A unit result of the handoff; the item ids (merge's: it_ + 32 hex of unit id and index)."""
        self.units.append((unit_id, items))
        return [item_id(unit_id, index) for index in range(len(items))]

    def finish(self) -> str:
        """Seal the snapshot and publish the handoff; the handoff hash (sha256 of ready.json)."""
        manifest = {
            "format": FORMAT,
            "version": self.version,
            "operationId": self.package_dir.name,
            "sources": self.sources,
            "priorOperationIds": [],
            "streams": {name: stream.close() for name, stream in self.streams.items()},
            "byteCount": self.byte_count,
            "blockingRecordRefs": [],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True, ensure_ascii=False, indent=1).encode()
        snapshot_hash = sha256_hex(manifest_bytes)
        (self.snapshot / "manifest.json").write_bytes(manifest_bytes)
        seal = {"format": FORMAT, "version": self.version, "manifestHash": snapshot_hash}
        (self.snapshot / "seal.json").write_bytes(json.dumps(seal, sort_keys=True).encode())
        return self._handoff(snapshot_hash)

    def _handoff(self, snapshot_hash: str) -> str:
        handoff = self.package_dir / "handoff"
        for directory in ("details", "text", "layers"):
            (handoff / directory).mkdir(parents=True)
        by_section: Counter[tuple[str, str]] = Counter()
        by_source: Counter[tuple[str, str, str]] = Counter()
        total = 0
        with (handoff / "details.jsonl").open("wb") as manifest:
            for ordinal, (unit_id, items) in enumerate(self.units):
                result = {
                    "schemaVersion": SCHEMA_VERSION, "kind": "extraction", "unitId": unit_id, "ordinal": ordinal,
                    "snapshotHash": snapshot_hash, "inputHash": "0" * 64, "processorVersion": "test-processor",
                    "requestedModel": "offline", "model": "offline",
                    "items": [
                        {"itemId": item_id(unit_id, index), "section": item.section, "status": item.status,
                         "content": item.content, "evidence": item.evidence}
                        for index, item in enumerate(items)
                    ],
                }  # fmt: skip
                data = json.dumps(result, ensure_ascii=False, sort_keys=True).encode()
                (handoff / f"details/{unit_id}.json").write_bytes(data)
                lines = [f"[{i.section} / {i.status}] {i.content} ({item_id(unit_id, n)})" for n, i in enumerate(items)]
                text = ("\n".join(lines) + "\n").encode() if lines else b""
                (handoff / f"text/{unit_id}.txt").write_bytes(text)
                counts: Counter[str] = Counter(f"{item.section}/{item.status}" for item in items)
                for item in items:
                    by_section[item.section, item.status] += 1
                    for source in dict.fromkeys(evidence["sessionId"] for evidence in item.evidence):
                        by_source[source, item.section, item.status] += 1
                row = {"unitId": unit_id, "ordinal": ordinal, "path": f"details/{unit_id}.json",
                       "sha256": sha256_hex(data), "textPath": f"text/{unit_id}.txt", "textSha256": sha256_hex(text),
                       "items": len(items), "counts": dict(sorted(counts.items()))}  # fmt: skip
                manifest.write(json.dumps(row, sort_keys=True).encode() + b"\n")
                total += len(items)
        sections = ("goals_constraints", "state_conclusions", "changes", "artifacts", "validation_failures",
                    "conflicts_todos")  # fmt: skip
        overview: dict[str, Any] = {
            "schemaVersion": SCHEMA_VERSION, "snapshotHash": snapshot_hash, "units": len(self.units), "items": total,
            "bySection": {section: {} for section in sections}, "bySource": {}, "emptySections": [],
            "gaps": 0, "details": "details.jsonl",
        }  # fmt: skip
        for (section, status), count in sorted(by_section.items()):
            overview["bySection"][section][status] = count
        for (source, section, status), count in sorted(by_source.items()):
            overview["bySource"].setdefault(source, {}).setdefault(section, {})[status] = count
        overview["emptySections"] = [s for s in sections if not overview["bySection"][s]]
        brief = {"schemaVersion": SCHEMA_VERSION, "snapshotHash": snapshot_hash, "navigation": True, "layer": 0,
                 "items": [], "notExpanded": total}  # fmt: skip
        _write_json(handoff / "overview.json", overview)
        _write_json(handoff / "brief.json", brief)
        (handoff / "handoff.md").write_text("# Merged handoff\n", encoding="utf-8")
        names = ("details.jsonl", "overview.json", "brief.json", "handoff.md")
        ready = {
            "schemaVersion": SCHEMA_VERSION, "snapshotHash": snapshot_hash, "processorVersion": "test-processor",
            "requestedModel": "offline", "units": len(self.units), "items": total, "briefItems": 0, "layers": 0,
            "notExpanded": total, "navigation": True,
            "files": [{"path": name, "sha256": sha256_hex((handoff / name).read_bytes())} for name in names],
        }  # fmt: skip
        data = json.dumps(ready, sort_keys=True).encode()
        (handoff / "ready.json").write_bytes(data)
        return sha256_hex(data)


def item_id(unit_id: str, index: int) -> str:
    """merge's item id of the `index`-th item of a unit."""
    return "it_" + hashlib.sha256(f"{unit_id}\n{index}".encode()).hexdigest()[:32]


def evidence(record_ref: str, session_id: str, part: int = 0) -> dict[str, Any]:
    """An evidence entry as a unit result records it."""
    return {"ref": f"r_{record_ref}:p{part}", "recordRef": record_ref, "part": part, "sessionId": session_id,
            "utf16": [0, 10]}  # fmt: skip


def _write_json(path: Path, value: Any) -> None:
    path.write_bytes(json.dumps(value, ensure_ascii=False, sort_keys=True, indent=1).encode())


def replace_file(path: Path, how: str) -> None:
    """Plant something in place of a package file: a symlink to a file outside, a FIFO, or the same
    number of other bytes."""
    size = path.stat().st_size
    path.unlink()
    if how == "symlink":
        outside = path.parent.parent.parent / "outside.txt"
        outside.write_bytes(b"x" * size)
        path.symlink_to(outside)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "tampered":
        path.write_bytes(b"y" * size)
    else:
        raise ValueError(how)
