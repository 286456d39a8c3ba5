"""Extraction and aggregation: a sealed snapshot package in, a verified structured handoff out.

Reads only the operation's package directory (``snapshot/``), writes ``work/`` and ``handoff/``, and
calls a model only through `continuum_runtime.provider.ModelProvider`. No database access: the
worker commits units around `run_unit` in its own short transactions.

- `ExtractionSettings`: the budgets (kept apart) and call patience; `CallPolicy`: timeout, attempts, backoff.
- `plan_units`: deterministic units over the snapshot's extractable text parts.
- `split_unit`: two deterministic halves of a unit whose request or answer did not fit.
- `run_unit`: one unit's serial model request(s), checked items, ``work/<unit id>.json`` and its sha256.
- `aggregate`: every unit's items kept as details, condensed in shrinking layers into a bounded brief,
  and ``handoff/ready.json`` naming every file's hash.
- `verify_unit_result`: a completed unit's result checked against its committed sha256 before reuse.
- `verify_handoff`: the handoff checked against ready.json before it is published or read.
"""

from __future__ import annotations

from continuum_merge.extraction.aggregate import HandoffReady, aggregate, verify_handoff
from continuum_merge.extraction.budget import CallPolicy, ExtractionSettings
from continuum_merge.extraction.errors import (
    AnswerInvalid,
    AttachmentUnreadable,
    ExtractionError,
    HandoffDamaged,
    PackageUnreadable,
    StorageShort,
    UnitTooLarge,
)
from continuum_merge.extraction.plan import UnitBudget, UnitSpec, plan_units, scan_unit, split_unit
from continuum_merge.extraction.unit import CallHook, CallRecord, UnitOutcome, run_unit, verify_unit_result

__all__ = [
    "AnswerInvalid",
    "AttachmentUnreadable",
    "CallHook",
    "CallPolicy",
    "CallRecord",
    "ExtractionError",
    "ExtractionSettings",
    "HandoffDamaged",
    "HandoffReady",
    "PackageUnreadable",
    "StorageShort",
    "UnitBudget",
    "UnitOutcome",
    "UnitSpec",
    "UnitTooLarge",
    "aggregate",
    "plan_units",
    "run_unit",
    "scan_unit",
    "split_unit",
    "verify_handoff",
    "verify_unit_result",
]
