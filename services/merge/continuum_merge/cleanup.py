"""Removing what merge holds for deleted targets and cancelled operations, without touching transcript's data.

`SessionEventsConsumer` follows transcript's session-events outbox from merge's own durable cursor: when a
deleted subtree contains a completed merge's target, the operation's package is removed once transcript
confirms the target is gone (the operation row stays, for diagnosis). `reconcile` walks the package tree
for anything the consumer or a run's own cleanup missed: a deleted target's package, a cancelled
operation whose writer stopped. It removes nothing it cannot account for, and nothing at all when the
database cannot be read (the error propagates). The `cleanup` command (a CronJob) runs it.
`CancelledSweeper` finishes, every little while, the cleanup of cancelled operations whose writer stopped
and that still hold something: a run cleans up after its own cancel, but a cancel of a paused operation
has no run (its staging copy, maybe paused short of disk, would otherwise wait for the CronJob).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_merge import store
from continuum_merge.store import Operation
from continuum_merge.transcript_client import TranscriptClient
from continuum_merge.worker import cleanup_cancelled, mark_cleaned
from continuum_runtime.cancellation import finish_before_stopping
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database

logger = logging.getLogger("continuum.merge")

CONSUMER = "merge.session-events"
# Operations read per query while sweeping or reconciling.
SWEEP_PAGE = 200


async def remove_package_of_deleted_target(
    database: Database, transcript: TranscriptClient, package_root: Path, session_id: str
) -> bool:
    """If `session_id` is a completed merge's target and transcript confirms it is gone, remove that
    merge's package; True when one was removed."""
    operation = await finish_before_stopping(_operation_of_target(database, session_id))
    if operation is None or operation.status != "completed":
        return False
    if await transcript.find_session(operation.owner, session_id) is not None:
        return False
    package = package_root / operation.operation_id
    if not await asyncio.to_thread(package.exists):
        return False
    await asyncio.to_thread(shutil.rmtree, package)
    logger.info("removed a deleted target's package", extra={"operation_id": operation.operation_id})
    return True


async def _operation_of_target(database: Database, session_id: str) -> Operation | None:
    async with database.connection() as connection:
        return await store.load_by_target(connection, session_id)


class SessionEventsConsumer:
    """Watches the outbox until stopped, resuming from its cursor after any break."""

    def __init__(
        self, database: Database, transcript: TranscriptClient, package_root: Path, retry_seconds: float, clock: Clock
    ) -> None:
        self._database = database
        self._transcript = transcript
        self._package_root = package_root
        self._retry_seconds = retry_seconds
        self._clock = clock

    async def run(self) -> None:
        """Consume forever (cancel to stop)."""
        while True:
            try:
                await self._consume()
            except grpc.aio.AioRpcError as error:
                logger.warning("session events stream broke; resuming", extra={"code": error.code().name})
            except Exception:
                # Resume from the durable cursor. The log keeps the frames, never the error's text (it may
                # quote a row): see continuum_runtime.logs.
                logger.warning("session events consumer failed; resuming", exc_info=True)
            await self._clock.sleep(self._retry_seconds)

    async def _consume(self) -> None:
        cursor = await finish_before_stopping(self._load_cursor())
        stream = self._transcript.stub.WatchSessionEvents(
            api.WatchSessionEventsRequest(after_event_id=cursor), metadata=self._transcript.metadata(None)
        )
        async for response in stream:
            event = response.event
            if event.type == tpb.SESSION_EVENT_TYPE_DELETED:
                for session_id in event.deleted_session_ids or [event.session_id]:
                    await remove_package_of_deleted_target(
                        self._database, self._transcript, self._package_root, session_id
                    )
            # Removing first, then the cursor: a replayed event finds nothing left to remove.
            await finish_before_stopping(self._save_cursor(event.event_id))

    # The database steps finish before a stop: cut between two statements, a SQLite connection leaks.
    async def _load_cursor(self) -> int:
        async with self._database.connection() as connection:
            return await store.load_cursor(connection, CONSUMER)

    async def _save_cursor(self, event_id: int) -> None:
        async with self._database.transaction() as connection:
            await store.save_cursor(connection, CONSUMER, event_id, self._clock.now_ms())


@dataclass(frozen=True)
class Reconciled:
    """What one cleanup pass found and removed."""

    packages: int
    removed: int


async def reconcile(database: Database, transcript: TranscriptClient, package_root: Path, clock: Clock) -> Reconciled:
    """One pass over the package tree: each directory is an operation's; remove a cancelled operation's
    once no live lease says a writer may still use it, and a completed one's once its target is gone."""
    names = sorted(path.name for path in await asyncio.to_thread(_directories, package_root))
    removed = 0
    for start in range(0, len(names), SWEEP_PAGE):
        async with database.connection() as connection:
            operations = await store.load_many(connection, names[start : start + SWEEP_PAGE])
        for operation in operations:
            if await _remove(database, transcript, package_root, operation, clock):
                removed += 1
    return Reconciled(len(names), removed)


async def _remove(
    database: Database, transcript: TranscriptClient, package_root: Path, operation: Operation, clock: Clock
) -> bool:
    package = package_root / operation.operation_id
    writer_stopped = operation.lease_expire_ms is None or operation.lease_expire_ms <= clock.now_ms()
    if operation.status == "cancelled" and writer_stopped:
        await cleanup_cancelled(transcript, database, clock, operation, package)
        return True
    if operation.status == "completed":
        return await remove_package_of_deleted_target(database, transcript, package_root, operation.target_session_id)
    return False


def _directories(package_root: Path) -> list[Path]:
    if not package_root.is_dir():
        return []
    return [path for path in package_root.iterdir() if path.is_dir() and not path.is_symlink()]


def _left_over(operation: Operation, present: bool) -> bool:
    """Whether a cancelled operation may still hold something: its directory, a claim, or a target its
    cancelled publish may have created."""
    return present or operation.claim_id is not None or operation.stage == "publishing"


async def _uncleaned(database: Database, after: str, now_ms: int) -> list[Operation]:
    async with database.connection() as connection:
        return await store.cancelled_uncleaned(connection, after, now_ms, SWEEP_PAGE)


async def sweep_cancelled(database: Database, transcript: TranscriptClient, package_root: Path, clock: Clock) -> int:
    """Finish the cleanup of every cancelled operation not cleaned yet whose writer stopped; how many held
    something. Each is marked cleaned, so a sweep reads only what was cancelled since the last one."""
    cleaned = 0
    after = ""
    while True:
        page = await finish_before_stopping(_uncleaned(database, after, clock.now_ms()))
        if not page:
            return cleaned
        for operation in page:
            package = package_root / operation.operation_id
            if _left_over(operation, await asyncio.to_thread(package.exists)):
                await cleanup_cancelled(transcript, database, clock, operation, package)
                cleaned += 1
            else:
                await finish_before_stopping(mark_cleaned(database, operation.operation_id, clock.now_ms()))
        after = page[-1].operation_id


class CancelledSweeper:
    """Sweeps cancelled operations every `interval_seconds` until stopped (a failed sweep is retried at
    the next one)."""

    def __init__(
        self,
        database: Database,
        transcript: TranscriptClient,
        package_root: Path,
        interval_seconds: float,
        clock: Clock,
    ) -> None:
        self._database = database
        self._transcript = transcript
        self._package_root = package_root
        self._interval = interval_seconds
        self._clock = clock

    async def run(self) -> None:
        """Sweep forever, the first time one interval after the start (cancel to stop)."""
        while True:
            await self._clock.sleep(self._interval)
            try:
                cleaned = await sweep_cancelled(self._database, self._transcript, self._package_root, self._clock)
            except Exception as error:
                logger.warning("cancelled operations sweep failed", extra={"error": type(error).__name__})
            else:
                if cleaned:
                    logger.info("cleaned cancelled operations", extra={"count": cleaned})
