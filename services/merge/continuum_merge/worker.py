"""The merge worker inside the service: it leases operations in the database and runs their stages.

A replica takes an operation that needs work (preparing, no live lease, no pending retry time) by one
conditional update that bumps the run epoch, so with two replicas on one PostgreSQL exactly one works
on an operation, and a replica that was killed is taken over once its lease lapses. Every write of a
run is fenced by its epoch (`store.Fence`): a cancel, a resume elsewhere or a takeover makes the old
run's writes match nothing, and the run stops. A graceful stop cancels the runs (and the model call in
flight) and releases their leases, so the next replica or start continues at once.

Stages (seed 000 §5.2): snapshotting under the MERGE claims → seal recorded, claims released →
extracting unit by unit (pending → running with an attempt, the call outside any transaction, the
result renamed into place, running → completed) → aggregating → validating → publishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from continuum_merge import store
from continuum_merge.admission import TreeChanged, claim_sources, cut_json, holder, parse_cut, read_cut
from continuum_merge.errors import MergeError, SourceBusy, TranscriptRefused, TranscriptUnavailable
from continuum_merge.extraction.plan import UNIT_STAGE
from continuum_merge.pipeline import Pipeline, Sealed, SplitNeeded, StageStop
from continuum_merge.settings import MergeSettings
from continuum_merge.store import Fence, Operation
from continuum_merge.transcript_client import HeldClaim, TargetSpec, TranscriptClient
from continuum_runtime.cancellation import finish_before_stopping
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database
from continuum_runtime.provider import ProviderError

logger = logging.getLogger("continuum.merge")

# Named points where a test can have the process killed (MERGE_CRASH_AT), to prove recovery.
SEAL_BEFORE_RECORD = "seal_before_record"
SEAL_AFTER_RECORD = "seal_after_record"
UNIT_BEFORE_COMMIT = "unit_before_commit"
UNIT_AFTER_COMMIT = "unit_after_commit"
PUBLISH_BEFORE_TARGET = "publish_before_target"
PUBLISH_AFTER_TARGET = "publish_after_target"
PUBLISH_BEFORE_COMPLETE = "publish_before_complete"
PUBLISH_AFTER_COMPLETE = "publish_after_complete"
# What the target's one program-written entry message says; the handoff itself stays in the package.
ENTRY_TEXT = (
    "This session continues the work of {count} merged sessions ({sources}). Their history is kept "
    "as a sealed package of merge operation {operation_id}; read it as historical reference."
)


class Superseded(Exception):
    """The run's fence no longer holds (cancel, resume, takeover): stop without writing anything."""


# Called at every named point; the service's own kills the process at `crash_at`, a test may hold there.
Failpoint = Callable[[str], Awaitable[None]]


def crash_point(name: str, wanted: str) -> None:
    """Kill this process at the named point when the settings ask for it (recovery tests)."""
    if name == wanted:
        logger.warning("crashing at a failpoint", extra={"failpoint": name})
        os.kill(os.getpid(), signal.SIGKILL)


def crash_at(wanted: str) -> Failpoint:
    """The service's failpoint: a kill at the named point `wanted` (nothing when it is empty)."""

    async def failpoint(name: str) -> None:
        crash_point(name, wanted)

    return failpoint


def file_sha256(path: Path) -> str | None:
    """The file's sha256, None when it is missing."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as handle:
            while chunk := handle.read(1024 * 1024):
                digest.update(chunk)
    except FileNotFoundError:
        return None
    return digest.hexdigest()


class Worker:
    """Leases operations and runs each in its own task, up to `max_concurrent_runs` at once."""

    def __init__(
        self,
        settings: MergeSettings,
        database: Database,
        transcript: TranscriptClient,
        pipeline: Pipeline,
        clock: Clock,
        name: str,
        failpoint: Failpoint,
    ) -> None:
        self._settings = settings
        self._db = database
        self._transcript = transcript
        self._pipeline = pipeline
        self._clock = clock
        self.name = name
        self._failpoint = failpoint
        self._wake = asyncio.Event()
        self._runs: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start looking for work (operations this or a crashed replica left are found at once)."""
        self._loop = asyncio.create_task(self._poll())

    def wake(self) -> None:
        """Look for work now (a start or a resume in this process)."""
        self._wake.set()

    def superseded(self, operation_id: str) -> None:
        """Stop the local run of a cancelled operation at once; its cleanup follows."""
        run = self._runs.get(operation_id)
        if run is not None:
            run.cancel()

    async def stop(self) -> None:
        """Graceful stop: no new work, every run cancelled (its model call too), every lease released."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        runs = list(self._runs.values())
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)

    async def _poll(self) -> None:
        while True:
            try:
                await self._take_work()
            except MergeError as error:
                logger.warning("looking for merge work failed", extra={"reason": error.reason})
            except (OSError, SQLAlchemyError) as error:
                # The database is unreachable for now: look again at the next poll.
                logger.warning("looking for merge work failed", extra={"error": type(error).__name__})
            waiter = asyncio.ensure_future(self._wake.wait())
            sleeper = asyncio.ensure_future(self._clock.sleep(self._settings.worker_poll_seconds))
            try:
                await asyncio.wait((waiter, sleeper), return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
                sleeper.cancel()
            self._wake.clear()

    async def _take_work(self) -> None:
        free = self._settings.max_concurrent_runs - len(self._runs)
        if free <= 0:
            return
        now = self._clock.now_ms()
        async with self._db.connection() as connection:
            candidates = await store.claimable(connection, self.name, now, free + len(self._runs))
        ttl_ms = round(self._settings.lease_ttl_seconds * 1000)
        for operation in candidates:
            if operation.operation_id in self._runs or len(self._runs) >= self._settings.max_concurrent_runs:
                continue
            async with self._db.transaction() as connection:
                fence = await store.take_lease(connection, operation, self.name, self._clock.now_ms(), ttl_ms)
            if fence is None:
                continue
            logger.info("merge run started", extra={"operation_id": fence.operation_id, "run_epoch": fence.run_epoch})
            run = OperationRun(
                self._settings, self._db, self._transcript, self._pipeline, self._clock, fence, self._failpoint
            )
            task = asyncio.create_task(run.run())
            self._runs[fence.operation_id] = task
            task.add_done_callback(functools.partial(self._finished, fence.operation_id))

    def _finished(self, operation_id: str, _: asyncio.Task[None]) -> None:
        self._runs.pop(operation_id, None)
        self._wake.set()


class OperationRun:
    """One run of one operation, from the lease to the end of its stages (or to being superseded)."""

    def __init__(
        self,
        settings: MergeSettings,
        database: Database,
        transcript: TranscriptClient,
        pipeline: Pipeline,
        clock: Clock,
        fence: Fence,
        failpoint: Failpoint,
    ) -> None:
        self._settings = settings
        self._db = database
        self._transcript = transcript
        self._pipeline = pipeline
        self._clock = clock
        self._fence = fence
        self._failpoint = failpoint
        self._package = settings.resolved_package_root() / fence.operation_id
        self._claim: HeldClaim | None = None
        self._owner = ""

    def _snapshot_failpoint(self, name: str) -> None:
        # The snapshot's own points (before and after the seal) run inside its thread: kills only.
        crash_point(name, self._settings.crash_at)

    async def run(self) -> None:
        """Run the stages while the lease is renewed; whatever happens, give the lease up at the end
        and clean up after a cancel."""
        main = asyncio.current_task()
        assert main is not None
        heartbeat = asyncio.create_task(self._heartbeat(main))
        try:
            await self._stages()
        except (Superseded, asyncio.CancelledError):
            logger.info("merge run superseded or stopped", extra={"operation_id": self._fence.operation_id})
        except StageStop as stop:
            await self._stop_for(stop)
        except (TranscriptUnavailable, ProviderError) as error:
            code = "SOURCE_BUSY" if isinstance(error, TranscriptUnavailable) else "PROVIDER_UNAVAILABLE"
            await self._stop_for(StageStop(code, "a dependency is unavailable; retrying", "retry"))
        except Exception:
            # A bug (or a refusal nobody expected) must not spin: the operation waits and is retried, by
            # this or another replica, possibly after a fix is deployed. The log keeps the frames, never
            # the error's text (continuum_runtime.logs).
            logger.error(
                "merge run failed unexpectedly", exc_info=True, extra={"operation_id": self._fence.operation_id}
            )
            await self._stop_for(StageStop("", "", "retry"))
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            await self._finish()

    async def _heartbeat(self, main: asyncio.Task[None]) -> None:
        """Renew the lease (and the claims while held); a lost lease stops the run."""
        ttl_ms = round(self._settings.lease_ttl_seconds * 1000)
        claim_due = self._clock.monotonic() + self._settings.claim_renew_seconds
        while True:
            await self._clock.sleep(self._settings.lease_renew_seconds)
            try:
                async with self._db.transaction() as connection:
                    renewed = await store.renew_lease(connection, self._fence, self._clock.now_ms(), ttl_ms)
                if not renewed:
                    main.cancel()
                    return
                if self._claim is not None and self._clock.monotonic() >= claim_due:
                    claim_due = self._clock.monotonic() + self._settings.claim_renew_seconds
                    await self._renew_claim()
            except (OSError, SQLAlchemyError) as error:
                # The database is unreachable: keep running; the lease lapses by itself if this lasts.
                logger.warning(
                    "merge lease not renewed",
                    extra={"operation_id": self._fence.operation_id, "error": type(error).__name__},
                )

    async def _renew_claim(self) -> None:
        claim = self._claim
        if claim is None:
            return
        try:
            renewed = await self._transcript.renew_claim(self._owner, claim.claim_id, self._settings.claim_ttl_seconds)
        except MergeError as error:
            logger.warning(
                "merge claim not renewed", extra={"operation_id": self._fence.operation_id, "reason": error.reason}
            )
            return
        async with self._db.transaction() as connection:
            await store.renew_claim(connection, self._fence, renewed.expire_ms, self._clock.now_ms())

    async def _advance(self, **values: object) -> None:
        async with self._db.transaction() as connection:
            if not await store.advance(connection, self._fence, self._clock.now_ms(), **values):
                raise Superseded(self._fence.operation_id)

    async def _current(self) -> Operation:
        async with self._db.connection() as connection:
            operation = await store.load_fenced(connection, self._fence)
        if operation is None:
            raise Superseded(self._fence.operation_id)
        return operation

    async def _stages(self) -> None:
        async with self._db.transaction() as connection:
            await store.reset_running_units(connection, self._fence, self._clock.now_ms())
        operation = await self._current()
        self._owner = operation.owner
        if operation.snapshot_hash is None:
            if not await self._record_unrecorded_seal(operation):
                await self._snapshot(operation)
        else:
            await self._sealed_again(operation)
        operation = await self._current()
        # Until a handoff hash is recorded, the handoff is (re)built from the units' results.
        if operation.stage in ("extracting", "aggregating") or operation.handoff_hash is None:
            await self._extract(operation)
            await self._advance(stage="aggregating")
            handoff_hash = await self._pipeline.aggregate(
                self._package, self._results(operation.operation_id), operation.execution.model
            )
            await self._advance(stage="validating", handoff_hash=handoff_hash)
        await self._publish(await self._current())

    async def _snapshot(self, operation: Operation) -> None:
        """Claim the sources (unless this run's admission still holds them), record the cut, copy, seal,
        record the seal, release every claim at once."""
        sources = operation.parameters.source_session_ids
        held = await self._still_held(operation)
        if held is not None and operation.cut_json:
            self._claim = held
            cuts = parse_cut(operation.cut_json)
        else:
            # After a pause or a crash the old claim may have lapsed and the sources moved on: claim
            # again and cut again; the new snapshot version never splices the old staging.
            await self._release_claims()
            try:
                claim = await claim_sources(
                    self._transcript, operation.owner, operation.operation_id, sources, self._settings.claim_ttl_seconds
                )
            except SourceBusy as busy:
                raise StageStop("SOURCE_BUSY", busy.message, "paused") from busy
            except TreeChanged as changed:
                raise StageStop(
                    "SOURCE_BUSY", "the source trees kept changing while they were claimed", "paused"
                ) from changed
            self._claim = claim
            cuts = await read_cut(self._transcript, operation.owner, sources)
            async with self._db.transaction() as connection:
                recorded = await store.record_claim(
                    connection,
                    operation.operation_id,
                    self._fence.run_epoch,
                    claim.claim_id,
                    claim.root_session_ids,
                    claim.expire_ms,
                    cut_json(cuts),
                    self._clock.now_ms(),
                )
            if not recorded:
                raise Superseded(operation.operation_id)
        version = operation.snapshot_version + 1
        await self._advance(snapshot_version=version)
        await asyncio.to_thread(self._package.mkdir, mode=0o700, parents=True, exist_ok=True)
        sealed = await self._pipeline.snapshot(operation.owner, self._package, cuts, version, self._snapshot_failpoint)
        await self._failpoint(SEAL_BEFORE_RECORD)
        await self._advance(snapshot_hash=sealed.snapshot_hash, stage="extracting")
        await self._failpoint(SEAL_AFTER_RECORD)
        await self._release_claims()
        self._block_on(sealed)

    async def _record_unrecorded_seal(self, operation: Operation) -> bool:
        """A seal an earlier run wrote but did not record before it crashed (seed 000 §5.2): it was made
        from the cut taken under the claims, so it is verified and recorded as it is, never copied again.
        False when there is no sealed package of the operation's current snapshot version to record."""
        if operation.snapshot_version == 0:
            return False
        try:
            sealed = await self._pipeline.verify_snapshot(self._package)
        except StageStop:
            # Nothing sealed (the crash came before the seal) or nothing usable: copy again.
            return False
        if sealed.version != operation.snapshot_version:
            return False
        await self._advance(snapshot_hash=sealed.snapshot_hash, stage="extracting")
        await self._release_claims()
        self._block_on(sealed)
        return True

    async def _still_held(self, operation: Operation) -> HeldClaim | None:
        """The claim the admission (or an earlier run) recorded, if transcript still holds it: renewing
        it is the proof (a lapsed claim may have let a turn change the sources since the cut)."""
        if operation.claim_id is None or not operation.locked_roots(self._clock.now_ms()):
            return None
        try:
            renewed = await self._transcript.renew_claim(
                operation.owner, operation.claim_id, self._settings.claim_ttl_seconds
            )
        except TranscriptRefused:
            return None
        async with self._db.transaction() as connection:
            if not await store.renew_claim(connection, self._fence, renewed.expire_ms, self._clock.now_ms()):
                raise Superseded(operation.operation_id)
        return renewed

    async def _sealed_again(self, operation: Operation) -> None:
        """A run after the seal was recorded: the claims must be gone, the package must still match."""
        if operation.claim_id is not None:
            await self._release_claims()
        sealed = await self._pipeline.verify_snapshot(self._package)
        if sealed.snapshot_hash != operation.snapshot_hash:
            raise StageStop(store.DAMAGED, "the sealed package no longer matches its recorded hash", "paused")
        self._block_on(sealed)

    def _block_on(self, sealed: Sealed) -> None:
        if sealed.blocking:
            raise StageStop(
                "RECORD_REQUIRES_HANDLING", f"{len(sealed.blocking)} record(s) could not be read safely", "paused"
            )

    async def _release_claims(self) -> None:
        """Free every source tree the operation holds (whichever run took the claim)."""
        self._claim = None
        await self._transcript.release_holder_claims(holder(self._fence.operation_id))
        async with self._db.transaction() as connection:
            await store.forget_claim(connection, self._fence.operation_id, self._clock.now_ms())

    async def _extract(self, operation: Operation) -> None:
        """Every extraction unit completed, in plan order, a page of units at a time: completed ones reused
        once their hash is verified (once per run), the others run one at a time under the unit commit
        protocol. A split unit's children sort right after it: the next page starts with them."""
        model = operation.execution.model
        if not operation.units_planned:
            # A batch per transaction: a crash mid-plan leaves the plan unfinished, and planning again
            # inserts only what is missing (deterministic ids).
            async for planned in self._pipeline.plan(self._package, model):
                async with self._db.transaction() as connection:
                    if not await store.insert_units(connection, self._fence, planned, self._clock.now_ms()):
                        raise Superseded(operation.operation_id)
            async with self._db.transaction() as connection:
                if not await store.finish_plan(connection, self._fence, self._clock.now_ms()):
                    raise Superseded(operation.operation_id)
        after: tuple[int, str] | None = None
        while True:
            async with self._db.connection() as connection:
                page = await store.list_units(
                    connection, operation.operation_id, UNIT_STAGE, after=after, limit=self._settings.unit_page_size
                )
            if not page:
                return
            for unit in page:
                after = (unit.ordinal, unit.unit_id)
                if not await self._unit_done(unit, model):
                    # Split: list again after it, from its children.
                    break

    async def _unit_done(self, unit: store.Unit, model: str) -> bool:
        """Whether `unit` is done (split already, completed and verified, or run now); False when it was
        split just now."""
        if unit.state == "split":
            return True
        if unit.state == "completed" and unit.result_path is not None:
            if await asyncio.to_thread(file_sha256, self._package / unit.result_path) == unit.result_hash:
                return True
            async with self._db.transaction() as connection:
                if not await store.redo_unit(connection, self._fence, unit.unit_id, self._clock.now_ms()):
                    raise Superseded(self._fence.operation_id)
        return await self._run_unit(unit, model) is not None

    async def _results(self, operation_id: str) -> AsyncIterator[Path]:
        """The completed units' result files in plan order, a page of rows at a time (all verified by
        `_extract` in this run)."""
        after: tuple[int, str] | None = None
        while True:
            async with self._db.connection() as connection:
                page = await store.list_units(
                    connection,
                    operation_id,
                    UNIT_STAGE,
                    after=after,
                    limit=self._settings.unit_page_size,
                    state="completed",
                )
            if not page:
                return
            for unit in page:
                after = (unit.ordinal, unit.unit_id)
                if unit.result_path is None:
                    raise AssertionError("a completed unit row has a result path (database constraint)")
                yield self._package / unit.result_path

    async def _run_unit(self, unit: store.Unit, model: str) -> Path | None:
        """The unit commit protocol around one unit; None when the unit was split instead."""
        request_id = uuid.uuid4().hex
        async with self._db.transaction() as connection:
            if not await store.start_unit(
                connection, self._fence, unit.unit_id, request_id, model, self._clock.now_ms()
            ):
                raise Superseded(self._fence.operation_id)
        try:
            done = await self._pipeline.run_unit(self._package, unit, model)
        except SplitNeeded as split:
            async with self._db.transaction() as connection:
                await store.finish_attempt(connection, request_id, "error", None, None, self._clock.now_ms())
                if not await store.split_unit(
                    connection, self._fence, unit.unit_id, split.children, self._clock.now_ms()
                ):
                    raise Superseded(self._fence.operation_id) from split
            return None
        except BaseException as error:
            outcome = "cancelled" if isinstance(error, asyncio.CancelledError) else "error"
            async with self._db.transaction() as connection:
                await store.finish_attempt(connection, request_id, outcome, None, None, self._clock.now_ms())
            raise
        async with self._db.transaction() as connection:
            await store.finish_attempt(
                connection, request_id, "completed", done.input_tokens, done.output_tokens, self._clock.now_ms()
            )
        await self._failpoint(UNIT_BEFORE_COMMIT)
        async with self._db.transaction() as connection:
            committed = await store.complete_unit(
                connection, self._fence, unit.unit_id, done.relative_path, done.sha256, self._clock.now_ms()
            )
        if not committed:
            raise Superseded(self._fence.operation_id)
        await self._failpoint(UNIT_AFTER_COMMIT)
        return self._package / done.relative_path

    async def _publish(self, operation: Operation) -> None:
        """The publish saga: verify, stage publishing, create the target idempotently under its reserved
        id, then the conditional completed update (against a cancel exactly one of them wins)."""
        handoff_hash = await self._pipeline.verify_handoff(self._package)
        if handoff_hash != operation.handoff_hash:
            raise StageStop(store.DAMAGED, "the handoff no longer matches its recorded hash", "paused")
        if operation.stage != "publishing":
            await self._advance(stage="publishing")
        execution = operation.execution
        sources = operation.parameters.source_session_ids
        target = TargetSpec(
            session_id=operation.target_session_id,
            operation_id=operation.operation_id,
            title=execution.target_title,
            model=execution.primary_model,
            working_directory=execution.working_directory,
            entry_text=ENTRY_TEXT.format(
                count=len(sources), sources=", ".join(sources), operation_id=operation.operation_id
            ),
        )
        await self._failpoint(PUBLISH_BEFORE_TARGET)
        await self._transcript.create_target(operation.owner, target)
        await self._failpoint(PUBLISH_AFTER_TARGET)
        await self._failpoint(PUBLISH_BEFORE_COMPLETE)
        async with self._db.transaction() as connection:
            completed = await store.complete(connection, self._fence, handoff_hash, self._clock.now_ms())
        if not completed:
            raise Superseded(operation.operation_id)
        await self._failpoint(PUBLISH_AFTER_COMPLETE)
        logger.info("merge published", extra={"operation_id": operation.operation_id})

    async def _stop_for(self, stop: StageStop) -> None:
        """Record why the run stopped. A paused or failed run frees its sources first, so the operation
        never shows them free while they are still claimed."""
        if stop.outcome != "retry":
            async with self._db.connection() as connection:
                current = await store.load_fenced(connection, self._fence)
            if current is None:
                return
            if stop.code == store.DAMAGED and stop.outcome == "paused" and current.damage_resumes > 0:
                # Paused for diagnosis, resumed, and the package still does not match: the sealed
                # originals are the only copy (the sources were released at the seal and may have
                # changed since), so this is confirmed unrecoverable. Only a cancel ends it now.
                stop = StageStop(
                    stop.code,
                    f"{stop.message}; still so after a resume, so it cannot be recovered: cancel the merge and"
                    " start a new one",
                    "failed",
                )
            with contextlib.suppress(MergeError):
                await self._release_claims()
        now = self._clock.now_ms()
        async with self._db.transaction() as connection:
            if stop.outcome == "retry":
                retry_ms = now + round(self._settings.retry_seconds * 1000)
                recorded = await store.retry_later(connection, self._fence, retry_ms, stop.code, now)
            else:
                failed = stop.outcome == "failed"
                recorded = await store.pause(connection, self._fence, stop.code, stop.message, now, failed=failed)
        logger.info(
            "merge run stopped",
            extra={
                "operation_id": self._fence.operation_id,
                "code": stop.code,
                "outcome": stop.outcome,
                "recorded": recorded,
            },
        )

    async def _finish(self) -> None:
        """Give the lease up; after a cancel, free the sources, remove a target that was never published,
        and remove the operation's directory (this run was its last writer)."""
        try:
            async with self._db.transaction() as connection:
                await store.release_lease(connection, self._fence, self._clock.now_ms())
                operation = await store.load(connection, self._fence.operation_id)
            if operation is not None and operation.status == "cancelled":
                await cleanup_cancelled(self._transcript, self._db, self._clock, operation, self._package)
        except (MergeError, OSError, SQLAlchemyError) as error:
            # The lease lapses by itself; the cleanup sweep retries what is left.
            logger.warning(
                "merge run not finished cleanly",
                extra={"operation_id": self._fence.operation_id, "error": type(error).__name__},
            )


async def cleanup_cancelled(
    transcript: TranscriptClient, database: Database, clock: Clock, operation: Operation, package: Path
) -> None:
    """What a cancelled operation leaves once its writer stopped: its claims released, a target created by
    a publish the cancel beat removed (it was never published: the operation never completed), and its
    directory; then the operation is marked cleaned."""
    await transcript.release_holder_claims(holder(operation.operation_id))
    await finish_before_stopping(_forget_claim(database, operation.operation_id, clock.now_ms()))
    if operation.stage == "publishing":
        await transcript.delete_session(operation.owner, operation.target_session_id)
    await asyncio.to_thread(shutil.rmtree, package, ignore_errors=True)
    # Marked only once its directory is gone: a writer whose lease ran out may still have been writing
    # (the next sweep tries again).
    if not await asyncio.to_thread(package.exists):
        await finish_before_stopping(mark_cleaned(database, operation.operation_id, clock.now_ms()))


# Short database steps of a cleanup: a sweeper stopped meanwhile lets them finish.
async def _forget_claim(database: Database, operation_id: str, now_ms: int) -> None:
    async with database.transaction() as connection:
        await store.forget_claim(connection, operation_id, now_ms)


async def mark_cleaned(database: Database, operation_id: str, now_ms: int) -> None:
    """Record that a cancelled operation holds nothing any more (the sweep reads it no more)."""
    async with database.transaction() as connection:
        await store.mark_cleaned(connection, operation_id, now_ms)
