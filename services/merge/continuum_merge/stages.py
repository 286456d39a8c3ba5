"""The merge's real stages: the `Pipeline` the worker runs, over `snapshot` and `extraction`.

The snapshot reads the sources through transcript's gRPC contract acting for the operation's owner; a
source that is itself a completed merge target contributes its package's originals (the snapshot finds
them beside this operation's directory, under the same package root). Extraction and aggregation read
only the sealed package and ask the configured model provider (offline by default).

Every failure of those packages leaves here as a `StageStop` naming a MergeErrorCode and what the worker
does about it: retry later by itself (transcript or the provider unreachable), pause until the user
resumes (disk short, a busy or changed source, a record or an attachment to handle, a model that keeps
refusing, a package that no longer matches its hashes: it is never rebuilt from sources that changed), or
fail (a source is gone).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import grpc

from continuum_merge.admission import TreeCut
from continuum_merge.extraction import (
    AnswerInvalid,
    AttachmentUnreadable,
    ExtractionSettings,
    HandoffDamaged,
    PackageUnreadable,
    StorageShort,
    UnitSpec,
    UnitTooLarge,
    aggregate,
    plan_units,
    run_unit,
    split_unit,
    verify_handoff,
)
from continuum_merge.extraction.unit import SHRINKABLE, CallHook
from continuum_merge.pipeline import Sealed, SplitNeeded, StageStop, UnitDone
from continuum_merge.snapshot import (
    DiskReserveShort,
    PackageDamaged,
    RecordRequiresHandling,
    SealedSnapshot,
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
from continuum_runtime.clock import Clock, SystemClock
from continuum_runtime.provider import (
    ModelProvider,
    ProviderBadResponse,
    ProviderError,
    ProviderInputTooLarge,
    ProviderOutputTruncated,
    ProviderQuotaExhausted,
)

# Recorded with every unit: results of another processor are never reused for this one's units.
# 2: slices are byte ranges with their own sha256 (1: code point ranges).
PROCESSOR_VERSION = "merge-extract-2"
# Planned units handed to the worker at once (each becomes a row of a few hundred bytes).
PLAN_BATCH_UNITS = 256


def _sealed(snapshot: SealedSnapshot) -> Sealed:
    return Sealed(snapshot.version, snapshot.snapshot_hash, snapshot.blocking_record_refs)


def _new_unit(spec: UnitSpec, model: str) -> NewUnit:
    """A planned or split unit as the row to insert."""
    return NewUnit(
        spec.unit_id, spec.stage, spec.ordinal, spec.input_hash, spec.input_json(), spec.processor_version, model
    )


def _damaged(what: str) -> StageStop:
    # Paused for diagnosis (issue 9): resuming verifies again, nothing is rebuilt from the sources.
    return StageStop("PACKAGE_DAMAGED", what, "paused")


def snapshot_stop(error: Exception) -> StageStop:
    """What the worker does about a failure of the snapshot copy (any other error is raised again)."""
    if isinstance(error, DiskReserveShort):
        return StageStop("DISK_RESERVE", str(error), "paused")
    if isinstance(error, RecordRequiresHandling):
        return StageStop("RECORD_REQUIRES_HANDLING", str(error), "paused")
    if isinstance(error, SourceMissing):
        return StageStop("SOURCE_MISSING", str(error), "failed")
    if isinstance(error, SourceChanged):
        return StageStop("SOURCE_BUSY", str(error), "paused")
    if isinstance(error, SourceUnavailable):
        return StageStop("SOURCE_BUSY", "transcript is unavailable; retrying", "retry")
    if isinstance(error, PackageDamaged):
        # An earlier merge's package a source depends on (this one is not sealed yet).
        return _damaged(str(error))
    if isinstance(error, grpc.aio.AioRpcError):
        if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
            return StageStop("SOURCE_MISSING", f"a source session is gone ({error.code().name})", "failed")
        return StageStop("SOURCE_BUSY", f"transcript refused a read ({error.code().name}); retrying", "retry")
    raise error


def model_stop(error: Exception) -> StageStop:
    """What the worker does about a failure of a model call, its answer or the package it reads that
    splitting cannot cure (any other error is raised again).

    Everything the provider does wrong pauses with PROVIDER_UNAVAILABLE: the attempts and backoff of
    issue 10 were already spent on the call (`complete_patiently`), and credentials or a refused model
    need the user; resuming (perhaps with another model) redoes only the unfinished units.
    """
    if isinstance(error, (UnitTooLarge, ProviderInputTooLarge, ProviderOutputTruncated, AnswerInvalid)):
        # A unit at the shrink floor, or a condensing pack (packs are not split).
        reason = "answers outside the item schema" if isinstance(error, AnswerInvalid) else type(error).__name__
        return StageStop(
            "PROVIDER_UNAVAILABLE",
            f"a request at the shrink floor still failed ({reason}); resume, perhaps with another model",
            "paused",
        )
    if isinstance(error, ProviderError):
        if isinstance(error, ProviderQuotaExhausted):
            # The user's own spending quota at the provider (seed 000 §6.3): no cap of ours, and no retry.
            return StageStop(
                "PROVIDER_UNAVAILABLE",
                f"the model provider refused for billing or quota (HTTP {error.status}); resume once the quota"
                " is raised",
                "paused",
            )
        if error.retryable or isinstance(error, ProviderBadResponse):
            what = f"the model provider kept failing ({type(error).__name__}, {error.status or 'no status'})"
        else:
            what = f"the model provider refused ({type(error).__name__}); check its credentials and model"
        return StageStop("PROVIDER_UNAVAILABLE", what + "; resume when it is fixed", "paused")
    if isinstance(error, (PackageUnreadable, HandoffDamaged)):
        return _damaged(str(error))
    if isinstance(error, StorageShort):
        # Resumable once space is freed; the units committed so far stay.
        return StageStop("DISK_RESERVE", str(error), "paused")
    if isinstance(error, AttachmentUnreadable):
        # The sealed package is never edited: the user describes the attachment in the source and merges
        # again; originals and completed units stay meanwhile.
        return StageStop("RECORD_REQUIRES_HANDLING", str(error), "paused")
    raise error


def _next_batch(specs: Iterator[UnitSpec]) -> list[UnitSpec]:
    """The next `PLAN_BATCH_UNITS` planned units (fewer at the end, none after it)."""
    try:
        return list(itertools.islice(specs, PLAN_BATCH_UNITS))
    except PackageUnreadable as error:
        raise _damaged(str(error)) from error


def check_reserve(package_dir: Path, reserve_bytes: int) -> None:
    """StorageShort when the package's filesystem has less free space than the reserve, before a write."""
    free = shutil.disk_usage(package_dir).free
    if free < reserve_bytes:
        raise StorageShort(package_dir.name, f"{free} bytes free, below the reserve of {reserve_bytes} bytes")


class MergeStages:
    """The `Pipeline` of the service: snapshot over transcript, extraction with `provider`.

    `extraction` holds the request budgets and the call patience (timeout, attempts, backoff waited on
    `clock`); `on_call` hears of every answered model call (units and condensing packs).
    """

    def __init__(
        self,
        transcript: TranscriptClient,
        provider: ModelProvider,
        *,
        timeout_seconds: float,
        disk_reserve_bytes: int,
        extraction: ExtractionSettings | None = None,
        clock: Clock | None = None,
        on_call: CallHook | None = None,
    ) -> None:
        self._transcript = transcript
        self._provider = provider
        self._timeout = timeout_seconds
        self._reserve = disk_reserve_bytes
        self._extraction = extraction or ExtractionSettings()
        self._budget = self._extraction.unit_budget()
        self._policy = self._extraction.call_policy(clock or SystemClock())
        self._on_call = on_call

    async def snapshot(
        self, owner: str, package_dir: Path, cuts: Sequence[TreeCut], version: int, failpoint: Callable[[str], None]
    ) -> Sealed:
        """Copy the source trees up to their recorded cuts, acting for `owner`, and seal."""
        reader = TranscriptSourceReader(self._transcript.stub, self._transcript.metadata(owner), self._timeout)
        sources = [
            SourceCut(cut.root_session_id, cut.session_ids, cut.last_message_ids, cut.history_generations)
            for cut in cuts
        ]
        try:
            sealed = await build_snapshot(
                reader, sources, package_dir, version=version, disk_reserve_bytes=self._reserve, failpoint=failpoint
            )
        except (
            DiskReserveShort,
            RecordRequiresHandling,
            SourceMissing,
            SourceChanged,
            SourceUnavailable,
            PackageDamaged,
            grpc.aio.AioRpcError,
        ) as error:
            raise snapshot_stop(error) from error
        return _sealed(sealed)

    async def verify_snapshot(self, package_dir: Path) -> Sealed:
        """The recorded seal checked whole against the package (in a thread)."""
        try:
            return _sealed(await asyncio.to_thread(verify_snapshot, package_dir))
        except PackageDamaged as error:
            raise _damaged(str(error)) from error

    async def plan(self, package_dir: Path, model: str) -> AsyncIterator[Sequence[NewUnit]]:
        """The extraction units of the sealed snapshot, as rows to insert, `PLAN_BATCH_UNITS` at a time
        (the manifests are read in a thread, one batch's worth at a time)."""
        specs = plan_units(package_dir, processor_version=PROCESSOR_VERSION, budget=self._budget)
        while batch := await asyncio.to_thread(_next_batch, specs):
            yield [_new_unit(spec, model) for spec in batch]

    async def run_unit(self, package_dir: Path, unit: Unit, model: str) -> UnitDone:
        """Run one stored unit against the sealed snapshot it was planned over.

        When its request or answer does not fit, or its answer stays invalid after the one repair, the
        unit is split into two halves of its own parts, or a single part into two slices (`SplitNeeded`:
        the worker commits them and runs them in its place); a unit at the shrink floor pauses instead.
        """
        try:
            spec = UnitSpec.from_stored(unit.unit_id, unit.ordinal, unit.input_json)
        except ValueError as error:
            raise _damaged(str(error)) from error
        try:
            await asyncio.to_thread(check_reserve, package_dir, self._reserve)
            outcome = await run_unit(
                spec,
                package_dir,
                self._provider,
                model=model,
                budget=self._budget,
                policy=self._policy,
                on_call=self._on_call,
            )
        except SHRINKABLE as error:
            raise await self._split(package_dir, spec, model, error) from error
        except (ProviderError, PackageUnreadable, StorageShort, AttachmentUnreadable) as error:
            raise model_stop(error) from error
        usage = outcome.usage
        return UnitDone(
            outcome.relative_path,
            outcome.sha256,
            outcome.model,
            None if usage is None else usage.prompt_tokens,
            None if usage is None else usage.completion_tokens,
        )

    async def _split(self, package_dir: Path, spec: UnitSpec, model: str, error: Exception) -> Exception:
        """The two halves replacing a unit that did not fit (`SplitNeeded`); a unit at the shrink floor
        pauses."""
        try:
            halves = await asyncio.to_thread(split_unit, package_dir, spec, floor_tokens=self._budget.floor_tokens)
        except PackageUnreadable as unreadable:
            return model_stop(unreadable)
        if halves is None:
            return model_stop(error)
        return SplitNeeded([_new_unit(half, model) for half in halves])

    async def aggregate(self, package_dir: Path, results: AsyncIterable[Path], model: str) -> str:
        """Build the handoff from the units' results (in plan order); the hash of its ready.json."""
        try:
            await asyncio.to_thread(check_reserve, package_dir, self._reserve)
            ready = await aggregate(
                package_dir,
                results,
                self._provider,
                model=model,
                budget=self._budget,
                brief_tokens=self._extraction.brief_tokens,
                policy=self._policy,
                on_call=self._on_call,
            )
        except (AnswerInvalid, ProviderError, PackageUnreadable, HandoffDamaged, StorageShort) as error:
            raise model_stop(error) from error
        return ready.handoff_hash

    async def verify_handoff(self, package_dir: Path) -> str:
        """The handoff checked against ready.json (in a thread); its hash."""
        try:
            return (await asyncio.to_thread(verify_handoff, package_dir)).handoff_hash
        except HandoffDamaged as error:
            raise _damaged(str(error)) from error
