"""Removing what merge keeps once nothing needs it: packages of deleted targets, and what cancelled
operations left behind.

- `SessionEventsConsumer` follows transcript's session-events outbox from merge's durable cursor. A
  DELETED event naming the target of a completed operation removes that operation's package once
  transcript confirms the target is gone (a replayed event removes nothing twice; an event about a
  live session removes nothing). Only the target's own package goes: a later merge that read it keeps
  its own copies of the originals.
- `CancelledSweeper` finishes, every little while, the cleanup of cancelled operations whose writer
  stopped (a run cleans up after its own cancel; a cancel of a paused operation has no run).
- `reconcile` (`python -m continuum_merge cleanup`, the CronJob) does the same for every completed
  operation whose target is gone, finishes the cleanup of cancelled operations whose writer stopped
  (claims, an unpublished target, the directory), and removes operation directories no operation owns. It reads
  merge's database first: when that fails it removes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc

from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as api
from continuum_merge import store
from continuum_merge.transcript_client import TranscriptClient
from continuum_merge.worker import cleanup_cancelled
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database

logger = logging.getLogger("continuum.merge")

CONSUMER = "merge.session-events"
# What an operation's directory is named (its id, a uuid4 in hex): anything else under the package root
# (a volume's lost+found, an operator's notes) is never taken for a stray.
OPERATION_DIRECTORY = re.compile(r"^[0-9a-f]{32}$")
# Operations read per query while reconciling.
PAGE = 200


async def remove_package(package_root: Path, operation_id: str) -> bool:
    """Remove `<package_root>/<operation id>/`; whether it was there."""
    package = package_root / operation_id
    if not await asyncio.to_thread(package.exists):
        return False
    await asyncio.to_thread(shutil.rmtree, package, ignore_errors=True)
    return True


async def forget_target(database: Database, transcript: TranscriptClient, package_root: Path, session_id: str) -> bool:
    """Remove the package of the completed operation whose target is `session_id`, once transcript says
    the target is gone; whether a package was removed."""
    async with database.connection() as connection:
        operation = await store.load_by_target(connection, session_id)
    if operation is None or operation.status != "completed":
        return False
    return await _forget_gone_target(transcript, package_root, operation)


async def _forget_gone_target(transcript: TranscriptClient, package_root: Path, operation: store.Operation) -> bool:
    if await transcript.find_session(operation.owner, operation.target_session_id) is not None:
        return False
    removed = await remove_package(package_root, operation.operation_id)
    if removed:
        logger.info("removed a deleted target's package", extra={"operation_id": operation.operation_id})
    return removed


class SessionEventsConsumer:
    """Watches transcript's session events until stopped, resuming from its cursor after any break."""

    def __init__(
        self,
        database: Database,
        transcript: TranscriptClient,
        package_root: Path,
        retry_seconds: float,
        clock: Clock,
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
            except Exception as error:
                # A database or transcript hiccup must not end cleanup for the life of the process: resume
                # from the durable cursor (the class name only: an error's text may quote a row).
                logger.warning("session events consumer failed; resuming", extra={"error": type(error).__name__})
            await self._clock.sleep(self._retry_seconds)

    async def _consume(self) -> None:
        async with self._database.connection() as connection:
            cursor = await store.load_cursor(connection, CONSUMER)
        stream = self._transcript.stub.WatchSessionEvents(
            api.WatchSessionEventsRequest(after_event_id=cursor), metadata=self._transcript.metadata(None)
        )
        async for response in stream:
            event = response.event
            if event.type == tpb.SESSION_EVENT_TYPE_DELETED:
                for session_id in event.deleted_session_ids or [event.session_id]:
                    await forget_target(self._database, self._transcript, self._package_root, session_id)
            # After the removal: a crash in between replays the event, which then removes nothing.
            async with self._database.transaction() as connection:
                await store.save_cursor(connection, CONSUMER, event.event_id, self._clock.now_ms())


async def sweep_cancelled(database: Database, transcript: TranscriptClient, package_root: Path, clock: Clock) -> int:
    """Finish the cleanup of every cancelled operation whose writer stopped and that still holds something
    (a cancel of a paused operation has no run that would); how many were cleaned."""
    cleaned = 0
    after = ""
    while True:
        async with database.connection() as connection:
            page = await store.cancelled_with_free_lease(connection, after, PAGE)
        if not page:
            return cleaned
        for operation in page:
            package = package_root / operation.operation_id
            if _left_over(operation, await asyncio.to_thread(package.exists)):
                await cleanup_cancelled(transcript, database, clock, operation, package)
                cleaned += 1
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
        """Sweep forever (cancel to stop)."""
        while True:
            try:
                cleaned = await sweep_cancelled(self._database, self._transcript, self._package_root, self._clock)
            except Exception as error:
                logger.warning("cancelled operations sweep failed", extra={"error": type(error).__name__})
            else:
                if cleaned:
                    logger.info("cleaned cancelled operations", extra={"count": cleaned})
            await self._clock.sleep(self._interval)


@dataclass(frozen=True)
class Reconciled:
    """What one reconcile removed."""

    target_packages: int
    cancelled: int
    strays: int


async def reconcile(database: Database, transcript: TranscriptClient, package_root: Path, clock: Clock) -> Reconciled:
    """Remove what the consumer and the workers missed, a page of operations at a time. A directory is
    removed as a stray only after the database answered that no operation owns it: when the database
    cannot be read, the error propagates and nothing more is removed."""
    targets = strays = 0
    after = ""
    while True:
        async with database.connection() as connection:
            page = await store.operations_after(connection, after, PAGE)
        if not page:
            break
        for operation in page:
            package = package_root / operation.operation_id
            present = await asyncio.to_thread(package.exists)
            if operation.status == "completed" and present:
                targets += await _forget_gone_target(transcript, package_root, operation)
        after = page[-1].operation_id
    cancelled = await sweep_cancelled(database, transcript, package_root, clock)
    names = await asyncio.to_thread(_directories, package_root)
    for name in names:
        # A directory is created only after its operation's row: one without a row belongs to nobody.
        async with database.connection() as connection:
            owned = await store.load(connection, name) is not None
        if not owned:
            strays += await remove_package(package_root, name)
    return Reconciled(targets, cancelled, strays)


def _left_over(operation: store.Operation, present: bool) -> bool:
    """Whether a cancelled operation may still hold something: its directory, a claim, or a target its
    cancelled publish may have created."""
    return present or operation.claim_id is not None or operation.stage == "publishing"


def _directories(package_root: Path) -> list[str]:
    """The names of the operation directories under the package root (none when it does not exist)."""
    if not package_root.is_dir():
        return []
    return sorted(
        entry.name
        for entry in package_root.iterdir()
        if OPERATION_DIRECTORY.match(entry.name) and entry.is_dir() and not entry.is_symlink()
    )
