"""The sealed snapshot package: its fixed layout, names and the values the rest of merge exchanges.

```
<package root>/<operation id>/
  staging/                       written while copying; never read as a snapshot
  snapshot/                      staging renamed atomically once complete
    manifest.json                format, version, operation, sources and their cut, stream hashes/counts
    records.jsonl                one line per distinct record (identity + version), no bodies
    files.jsonl                  one line per raw file, text part and asset reference: path, bytes, sha256
    occurrences.jsonl            a record seen again at another position (same identity and version)
    gaps.jsonl                   what history lacks: a missing child session, attachment bytes, prior package
    raw/<recordRef>.json         the complete original record
    text/<recordRef>-<part>.txt  the text projection in parts of at most 32 KiB of UTF-8
    assets/<sha256>              original attachment bytes, named by their digest
    seal.json                    format, version and the manifest's sha256 (= the snapshot hash)
```

Every path is generated here from hex digests and counters: no title, file name or model output ever
names a file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

FORMAT = "continuum-merge-snapshot/v1"
STAGING = "staging"
SNAPSHOT = "snapshot"
MANIFEST = "manifest.json"
SEAL = "seal.json"
RECORDS = "records.jsonl"
FILES = "files.jsonl"
OCCURRENCES = "occurrences.jsonl"
GAPS = "gaps.jsonl"
STREAMS = (RECORDS, FILES, OCCURRENCES, GAPS)
RAW_DIR = "raw"
TEXT_DIR = "text"
ASSETS_DIR = "assets"
# A text part holds at most this many bytes of UTF-8, cut on a code point boundary.
TEXT_PART_BYTES = 32 * 1024

# Failpoints the build passes, for crash tests: the staging tree is complete but not yet renamed,
# and the snapshot directory is renamed and synced.
BEFORE_SEAL = "snapshot_before_seal"
AFTER_SEAL = "snapshot_after_seal"

HEX64 = re.compile(r"^[0-9a-f]{64}$")
# What an operation id may look like to be used as a directory name (no separators, no dots).
OPERATION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class SourceCut:
    """One source tree as admission recorded it, under its claims: the root, every session of the tree
    (root first), and per session the last live message id at that moment (0 when it had none) and its
    history generation (a session whose history was rewritten since is not copied: SourceChanged)."""

    root_session_id: str
    session_ids: tuple[str, ...]
    last_message_ids: Mapping[str, int] = field(default_factory=dict)
    history_generations: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class SealedSnapshot:
    """What the database records about a sealed snapshot. `snapshot_hash` is the sha256 of manifest.json
    (which carries the hash of every stream, which carry the hash of every file). `byte_count` counts the
    bytes of the files listed in files.jsonl. `blocking_record_refs` names records saved but unreadable:
    after recording the seal and releasing the claims, the merge pauses with RECORD_REQUIRES_HANDLING."""

    version: int
    snapshot_hash: str
    record_count: int
    byte_count: int
    blocking_record_refs: tuple[str, ...] = ()


def raw_path(record_ref: str) -> str:
    """The package-relative path of a record's raw JSON."""
    return f"{RAW_DIR}/{record_ref}.json"


def text_path(record_ref: str, part: int) -> str:
    """The package-relative path of a record's text part."""
    return f"{TEXT_DIR}/{record_ref}-{part}.txt"


def asset_path(sha256: str) -> str:
    """The package-relative path of attachment bytes with this digest."""
    return f"{ASSETS_DIR}/{sha256}"


def is_package_path(path: str) -> bool:
    """Whether `path` is one the layout generates (so a listed path can never escape the package)."""
    directory, _, name = path.partition("/")
    if directory == RAW_DIR:
        return name.endswith(".json") and bool(HEX64.match(name[: -len(".json")]))
    if directory == TEXT_DIR:
        stem, _, part = name.removesuffix(".txt").rpartition("-")
        return name.endswith(".txt") and bool(HEX64.match(stem)) and part.isdigit() and part == str(int(part))
    if directory == ASSETS_DIR:
        return bool(HEX64.match(name))
    return False
