"""Failures of extraction and aggregation: one root type, one subclass per thing the worker does about it.

Plain exception classes: the foundation maps them to its MergeErrorCode. Messages carry ids, paths
inside the package and counts only, never history text or model output.
"""

from __future__ import annotations

__all__ = ["AnswerInvalid", "ExtractionError", "HandoffDamaged", "PackageUnreadable", "UnitTooLarge"]


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
