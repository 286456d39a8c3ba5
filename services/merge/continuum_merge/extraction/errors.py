"""Failures of extraction and aggregation: one root type, one subclass per thing the worker does about it.

Plain exception classes: the foundation maps them to its MergeErrorCode. Messages carry ids, paths
inside the package and counts only, never history text or model output.
"""

from __future__ import annotations

__all__ = [
    "AnswerInvalid",
    "AttachmentUnreadable",
    "ExtractionError",
    "HandoffDamaged",
    "PackageUnreadable",
    "StorageShort",
    "UnitTooLarge",
]


class ExtractionError(Exception):
    """Root of every failure raised by `continuum_merge.extraction`."""


class PackageUnreadable(ExtractionError):
    """The sealed snapshot is not what its manifests say (missing file, size or hash mismatch, bad line).

    The worker pauses for diagnosis: the package is never rebuilt from sources that may have changed.
    """


class AnswerInvalid(ExtractionError):
    """The model's answer stayed invalid (not JSON, wrong schema, unknown aliases) after the one repair.

    `unit_id` names the unit; the message names the first problem found, never the answer itself.
    """

    def __init__(self, message: str, *, unit_id: str) -> None:
        super().__init__(message)
        self.unit_id = unit_id


class UnitTooLarge(ExtractionError):
    """A request or its answer is over the budget's byte guard: the unit must be split (`split_unit`).

    The same remedy as the provider's `ProviderInputTooLarge` and `ProviderOutputTruncated`; an answer
    over the guard is never used, however complete.
    """

    def __init__(self, message: str, *, unit_id: str) -> None:
        super().__init__(message)
        self.unit_id = unit_id


class HandoffDamaged(ExtractionError):
    """handoff/ is missing a file, or a file does not match the hash ready.json or details.jsonl records."""


class StorageShort(ExtractionError):
    """The disk (or the user's quota) is full, or a file is over the process's size limit, while writing
    work or handoff files; or free space fell below the reserve before a write.

    The worker pauses, resumable once space is freed: results already committed stay, the file being
    written is removed (only `path`, inside the package, and the condition are named).
    """

    def __init__(self, path: str, condition: str) -> None:
        super().__init__(f"writing {path} failed: {condition}; free disk space (or raise the quota) and resume")
        self.path = path
        self.condition = condition


class AttachmentUnreadable(ExtractionError):
    """A user message consists only of attachments of media types nothing here can read: what the user
    asked for is in them alone, so extraction cannot go on without inventing it.

    The worker pauses (RECORD_REQUIRES_HANDLING); originals and completed units stay. The sealed package
    is never changed: the user adds a readable description in the source and merges again.
    """

    def __init__(self, record_ref: str, media_types: tuple[str, ...]) -> None:
        super().__init__(
            f"record {record_ref} holds only attachments of unsupported types ({', '.join(media_types)}); "
            "describe them in a message of the source, then cancel and merge again"
        )
        self.record_ref = record_ref
        self.media_types = media_types
