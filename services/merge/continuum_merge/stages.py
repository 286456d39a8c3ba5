"""The real stages behind the worker's `Pipeline`: the sealed snapshot (`continuum_merge.snapshot`) and
the extraction, aggregation and handoff checks (`continuum_merge.extraction`), with their failures
mapped to what the operation shows (MergeErrorCode and paused / failed / retry)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from continuum_merge.admission import TreeCut
from continuum_merge.extraction import (
    AnswerInvalid,
    HandoffDamaged,
    PackageUnreadable,
    UnitSpec,
    UnitTooLarge,
    aggregate,
    plan_units,
    run_unit,
    split_unit,
    verify_handoff,
)
from continuum_merge.extraction.plan import UnitBudget
from continuum_merge.pipeline import Sealed, SplitNeeded, StageStop, UnitDone
from continuum_merge.snapshot import (
    DiskReserveShort,
    PackageDamaged,
    RecordRequiresHandling,
    SealedSnapshot,
    SnapshotError,
    SourceChanged,
    SourceCut,
    SourceMissing,
    SourceUnavailable,
    TranscriptSourceReader,
    build_snapshot,
    verify_snapshot,
)
from continuum_merge.store import NewUnit, Unit
from continuum_merge.transcript_client import TranscriptClient
from continuum_runtime.provider import (
    ModelProvider,
    ProviderAuthFailed,
    ProviderInputTooLarge,
    ProviderOutputTruncated,
    ProviderRequestRejected,
)

# Recorded with every unit: a new processor plans (and names) its units anew.
PROCESSOR_VERSION = "merge-extraction/2"


def _sealed(snapshot: SealedSnapshot) -> Sealed:
    return Sealed(snapshot.version, snapshot.snapshot_hash, tuple(snapshot.blocking_record_refs))


def snapshot_stop(error: SnapshotError) -> StageStop:
    """What a snapshot failure means for the operation."""
    if isinstance(error, DiskReserveShort):
        return StageStop(
            "DISK_RESERVE", "less free disk than the configured reserve; resume once space is freed", "paused"
        )
    if isinstance(error, SourceMissing):
        return StageStop("SOURCE_MISSING", f"source session {error.session_id} is gone", "paused")
    if isinstance(error, SourceChanged):
        return StageStop("SOURCE_BUSY", f"source session {error.session_id} changed while it was copied", "paused")
    if isinstance(error, SourceUnavailable):
        return StageStop("SOURCE_BUSY", "transcript is unavailable; retrying", "retry")
    if isinstance(error, RecordRequiresHandling):
        return StageStop("RECORD_REQUIRES_HANDLING", f"{len(error.record_refs)} record(s) need handling", "paused")
    if isinstance(error, PackageDamaged):
        return StageStop("PACKAGE_DAMAGED", "the sealed package does not match its hashes", "failed")
    return StageStop("PACKAGE_DAMAGED", "the snapshot could not be built", "failed")


class PackagePipeline:
    """The stages over an operation's package directory, reading sources through transcript."""

    def __init__(
        self,
        transcript: TranscriptClient,
        provider: ModelProvider,
        *,
        transcript_timeout_seconds: float,
        disk_reserve_bytes: int,
        budget: UnitBudget | None = None,
    ) -> None:
        self._transcript = transcript
        self._provider = provider
        self._timeout = transcript_timeout_seconds
        self._reserve = disk_reserve_bytes
        self._budget = budget or UnitBudget()

    async def snapshot(
        self, owner: str, package_dir: Path, cuts: Sequence[TreeCut], version: int, failpoint: Callable[[str], None]
    ) -> Sealed:
        """Copy every source tree up to its cut, acting for the owner, and seal it."""
        reader = TranscriptSourceReader(self._transcript.stub, self._transcript.metadata(owner), self._timeout)
        sources = [
            SourceCut(cut.root_session_id, cut.session_ids, cut.last_message_ids, cut.history_generations)
            for cut in cuts
        ]
        try:
            sealed = await build_snapshot(
                reader, sources, package_dir, version=version, disk_reserve_bytes=self._reserve, failpoint=failpoint
            )
        except SnapshotError as error:
            raise snapshot_stop(error) from error
        return _sealed(sealed)

    async def verify_snapshot(self, package_dir: Path) -> Sealed:
        """The recorded seal checked against the package (in a thread: it hashes every file)."""
        try:
            return _sealed(await asyncio.to_thread(verify_snapshot, package_dir))
        except SnapshotError as error:
            raise snapshot_stop(error) from error

    async def plan(self, package_dir: Path, model: str) -> list[NewUnit]:
        """The extraction units, as rows (the spec lives in the bounded input_json)."""
        try:
            specs = await asyncio.to_thread(
                plan_units, package_dir, processor_version=PROCESSOR_VERSION, budget=self._budget
            )
        except PackageUnreadable as error:
            raise StageStop("PACKAGE_DAMAGED", "the sealed snapshot could not be planned", "failed") from error
        return [
            NewUnit(
                spec.unit_id, "extracting", spec.ordinal, spec.input_hash, spec.input_json(), PROCESSOR_VERSION, model
            )
            for spec in specs
        ]

    async def run_unit(self, package_dir: Path, unit: Unit, model: str) -> UnitDone:
        """One unit's model call(s) and its result renamed into place."""
        spec = UnitSpec.from_stored(unit.unit_id, unit.ordinal, unit.input_json)
        try:
            outcome = await run_unit(spec, package_dir, self._provider, model=model, budget=self._budget)
        except (UnitTooLarge, ProviderInputTooLarge, ProviderOutputTruncated) as error:
            raise await self._split(package_dir, spec, model) from error
        except PackageUnreadable as error:
            raise StageStop("PACKAGE_DAMAGED", "the sealed snapshot could not be read", "failed") from error
        except AnswerInvalid as error:
            raise StageStop(
                "PROVIDER_UNAVAILABLE", "the model's answers stayed invalid; resume, maybe with another model", "paused"
            ) from error
        except (ProviderAuthFailed, ProviderRequestRejected) as error:
            raise StageStop(
                "PROVIDER_UNAVAILABLE", "the model provider refused the request; check its settings", "paused"
            ) from error
        usage = outcome.usage
        return UnitDone(
            outcome.relative_path,
            outcome.sha256,
            outcome.model,
            usage.prompt_tokens if usage is not None else None,
            usage.completion_tokens if usage is not None else None,
        )

    async def _split(self, package_dir: Path, spec: UnitSpec, model: str) -> SplitNeeded | StageStop:
        """The two halves replacing a unit that did not fit; a single part that does not fit pauses."""
        try:
            halves = await asyncio.to_thread(split_unit, package_dir, spec)
        except PackageUnreadable:
            return StageStop("PACKAGE_DAMAGED", "the sealed snapshot could not be read", "failed")
        if halves is None:
            return StageStop(
                "PROVIDER_UNAVAILABLE",
                "one stored record is too large for the model; resume with another model",
                "paused",
            )
        return SplitNeeded(
            [
                NewUnit(
                    half.unit_id,
                    "extracting",
                    half.ordinal,
                    half.input_hash,
                    half.input_json(),
                    PROCESSOR_VERSION,
                    model,
                )
                for half in halves
            ]
        )

    async def aggregate(self, package_dir: Path, results: Sequence[Path], model: str) -> str:
        """The handoff built from the units' results; the hash of its ready.json."""
        try:
            ready = await aggregate(package_dir, results, self._provider, model=model, budget=self._budget)
        except (PackageUnreadable, HandoffDamaged) as error:
            raise StageStop("PACKAGE_DAMAGED", "the units' results could not be aggregated", "failed") from error
        except AnswerInvalid as error:
            raise StageStop(
                "PROVIDER_UNAVAILABLE", "the model's answers stayed invalid; resume, maybe with another model", "paused"
            ) from error
        except (ProviderAuthFailed, ProviderRequestRejected) as error:
            raise StageStop(
                "PROVIDER_UNAVAILABLE", "the model provider refused the request; check its settings", "paused"
            ) from error
        return ready.handoff_hash

    async def verify_handoff(self, package_dir: Path) -> str:
        """The handoff checked file by file against ready.json (in a thread); its hash."""
        try:
            return (await asyncio.to_thread(verify_handoff, package_dir)).handoff_hash
        except HandoffDamaged as error:
            raise StageStop("PACKAGE_DAMAGED", "the handoff does not match its ready.json", "failed") from error
