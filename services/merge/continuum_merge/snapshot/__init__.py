"""The sealed snapshot package: a copy of the source trees up to their cut that the rest of the merge
reads instead of the sources (see `layout` for the tree)."""

from continuum_merge.snapshot.build import build_snapshot
from continuum_merge.snapshot.errors import (
    DiskReserveShort,
    PackageDamaged,
    RecordRequiresHandling,
    SnapshotError,
    SourceChanged,
    SourceMissing,
    SourceUnavailable,
)
from continuum_merge.snapshot.layout import AFTER_SEAL, BEFORE_SEAL, SealedSnapshot, SourceCut
from continuum_merge.snapshot.reader import SourceReader, TranscriptSourceReader, capture_cut
from continuum_merge.snapshot.verify import verify_snapshot

__all__ = [
    "AFTER_SEAL",
    "BEFORE_SEAL",
    "DiskReserveShort",
    "PackageDamaged",
    "RecordRequiresHandling",
    "SealedSnapshot",
    "SnapshotError",
    "SourceChanged",
    "SourceCut",
    "SourceMissing",
    "SourceReader",
    "SourceUnavailable",
    "TranscriptSourceReader",
    "build_snapshot",
    "capture_cut",
    "verify_snapshot",
]
