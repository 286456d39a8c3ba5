"""Why a snapshot could not be built or read. Plain exceptions: the operation machinery maps each to a
MergeErrorCode (DiskReserveShort → DISK_RESERVE, RecordRequiresHandling → RECORD_REQUIRES_HANDLING,
SourceMissing → SOURCE_MISSING, PackageDamaged → PACKAGE_DAMAGED, SourceChanged → SOURCE_BUSY) or, for
SourceUnavailable, retries later. Messages carry ids, counts and paths inside the package only, never
message bodies."""

from __future__ import annotations


class SnapshotError(Exception):
    """Root of the snapshot's failures."""


class DiskReserveShort(SnapshotError):
    """Less free disk than the reserve while copying: the staging copy stops; resume once space is freed."""

    def __init__(self, free_bytes: int, reserve_bytes: int) -> None:
        super().__init__(f"{free_bytes} bytes free, below the reserve of {reserve_bytes} bytes")
        self.free_bytes = free_bytes
        self.reserve_bytes = reserve_bytes


class RecordRequiresHandling(SnapshotError):
    """Records that were saved but cannot be read safely: their raw bytes are sealed in the package and
    the merge pauses until someone handles them (raised by the worker after the seal is recorded)."""

    def __init__(self, record_refs: tuple[str, ...]) -> None:
        super().__init__(f"{len(record_refs)} record(s) could not be read safely")
        self.record_refs = record_refs


class SourceMissing(SnapshotError):
    """A source root session is gone (deleted or never readable) before the snapshot was sealed."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"source session {session_id} is missing")
        self.session_id = session_id


class SourceChanged(SnapshotError):
    """A source changed under the copy (attachment bytes differing from their recorded hash twice, or
    a history rewritten after the cut): nothing is spliced; copy again once the source is idle."""

    def __init__(self, session_id: str, what: str) -> None:
        super().__init__(f"source session {session_id} changed during the copy: {what}")
        self.session_id = session_id
        self.what = what


class SourceUnavailable(SnapshotError):
    """Transcript could not be reached (or timed out); nothing was sealed, try again later."""


class PackageDamaged(SnapshotError):
    """A sealed package does not match its own hashes or layout (a missing, extra or altered file)."""

    def __init__(self, package_dir: str, what: str) -> None:
        super().__init__(f"package {package_dir} is damaged: {what}")
        self.what = what
