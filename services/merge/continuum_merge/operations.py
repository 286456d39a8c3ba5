"""The operation API of issue 9: start (admission), read, resume and cancel, for the acting user.

Every decision that two callers can race for is one conditional statement in `store`; this module
reads the outcome back and answers with the operation as it stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum_merge import store, validation
from continuum_merge.admission import TreeChanged, claim_sources, cut_json, holder, read_cut
from continuum_merge.convert import STATUSES, operation_message
from continuum_merge.errors import (
    ActiveExists,
    AlreadyCompleted,
    BadRequest,
    CancelCleanup,
    IdempotencyConflict,
    MergeError,
    OperationNotFound,
    PermissionDenied,
    SourceBusy,
    StaleOperation,
    TranscriptUnavailable,
)
from continuum_merge.settings import MergeSettings
from continuum_merge.store import Execution, Operation, Parameters
from continuum_merge.transcript_client import TranscriptClient
from continuum_runtime.clock import Clock
from continuum_runtime.database import Database

logger = logging.getLogger("continuum.merge")

# Inserting can lose to a start that finished (or was discarded) in between; retrying reads again.
MAX_INSERT_ROUNDS = 3


class WorkerSignals(Protocol):
    """What the API tells this process's worker."""

    def wake(self) -> None:
        """An operation may need a worker now (a start or a resume)."""
        ...

    def superseded(self, operation_id: str) -> None:
        """The operation's current run is over (a cancel): stop working on it at once."""
        ...


class Operations:
    """Start, Get, GetActive, Resume, Cancel."""

    def __init__(
        self,
        settings: MergeSettings,
        database: Database,
        transcript: TranscriptClient,
        default_model: str,
        signals: WorkerSignals,
        clock: Clock,
    ) -> None:
        self._settings = settings
        self._db = database
        self._transcript = transcript
        self._default_model = default_model
        self._signals = signals
        self._clock = clock

    async def message(self, operation: Operation) -> pb.MergeOperation:
        """The operation as an API message, with its unit progress; a completed operation's target is
        available only while transcript still has it (a user may delete it)."""
        async with self._db.connection() as connection:
            counts = await store.unit_counts(connection, operation.operation_id)
        answer = operation_message(operation, counts, self._clock.now_ms())
        if operation.status == "completed" and not await self._target_exists(operation):
            answer.progress.target_available = False
        return answer

    async def _target_exists(self, operation: Operation) -> bool:
        try:
            return await self._transcript.find_session(operation.owner, operation.target_session_id) is not None
        except TranscriptUnavailable:
            # Unknown for now: a published target exists until someone deletes it.
            return True

    async def _owned(self, user: str, operation_id: str) -> Operation:
        async with self._db.connection() as connection:
            operation = await store.load(connection, operation_id)
        if operation is None:
            raise OperationNotFound("no such merge operation", metadata={"operation_id": operation_id})
        if operation.owner != user:
            raise PermissionDenied(
                "the merge operation belongs to another user", metadata={"operation_id": operation_id}
            )
        return operation

    async def _repeated(self, user: str, key: str, parameters: Parameters) -> Operation | None:
        """The operation an earlier start with this key made, if any; a conflict when it asked for another merge."""
        async with self._db.connection() as connection:
            earlier = await store.load_by_key(connection, user, key)
        if earlier is None:
            return None
        if not earlier.parameters.same_request(parameters):
            raise IdempotencyConflict("the idempotency key was used for another merge", await self.message(earlier))
        return earlier

    async def _refuse_if_busy(self, user: str) -> None:
        now = self._clock.now_ms()
        async with self._db.connection() as connection:
            active = await store.load_active(connection, user)
            stopping = await store.load_stopping(connection, user, now) if active is None else None
        if active is not None:
            raise ActiveExists("an unfinished merge exists", await self.message(active))
        if stopping is not None:
            raise CancelCleanup("a cancelled merge is still stopping; retry in a moment", await self.message(stopping))

    async def _capture(self, user: str, parameters: Parameters) -> Execution:
        """Check every source (the user's own live root) and capture the primary's defaults."""
        primary = None
        for index, source in enumerate(parameters.source_session_ids):
            session = await self._transcript.get_session(user, source)
            if session.parent_session_id:
                raise BadRequest(f"source_session_ids[{index}]", "must be a root session")
            if source == parameters.primary_session_id:
                primary = session
        assert primary is not None  # validation put the primary among the sources
        return Execution(
            model=parameters.model or self._default_model or primary.model,
            target_title=parameters.title or primary.title or "Merged session",
            working_directory=primary.working_directory,
            primary_model=primary.model,
        )

    async def start(self, user: str, request: api.StartMergeRequest) -> api.StartMergeResponse:
        """Admit a merge: one active slot per user, every source tree claimed, the cut recorded."""
        parameters = validation.start(request)
        key = request.idempotency_key
        earlier = await self._repeated(user, key, parameters)
        if earlier is not None:
            return api.StartMergeResponse(operation=await self.message(earlier), created=False)
        await self._refuse_if_busy(user)
        execution = await self._capture(user, parameters)
        operation_id = uuid.uuid4().hex
        for _ in range(MAX_INSERT_ROUNDS):
            async with self._db.transaction() as connection:
                inserted = await store.insert_operation(
                    connection,
                    operation_id=operation_id,
                    owner=user,
                    idempotency_key=key,
                    parameters=parameters,
                    target_session_id=uuid.uuid4().hex,
                    execution=execution,
                    now_ms=self._clock.now_ms(),
                    admission_expire_ms=self._clock.now_ms() + round(self._settings.lease_ttl_seconds * 1000),
                )
            if inserted:
                break
            # Lost to another start: the same key (answer its operation) or the active slot (refuse).
            earlier = await self._repeated(user, key, parameters)
            if earlier is not None:
                return api.StartMergeResponse(operation=await self.message(earlier), created=False)
            await self._refuse_if_busy(user)
        else:
            raise ActiveExists("an unfinished merge exists", await self.message(await self._active_or_fail(user)))
        renewer = asyncio.create_task(self._renew_admission(operation_id))
        try:
            await self._admit(user, operation_id, parameters)
        except BaseException:
            async with self._db.transaction() as connection:
                # A cancel that came meanwhile keeps the row; the start's lease ends either way.
                if not await store.discard_admission(connection, operation_id, store.FIRST_EPOCH):
                    await store.end_admission(connection, operation_id, self._clock.now_ms())
            raise
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
        self._signals.wake()
        async with self._db.connection() as connection:
            operation = await store.load(connection, operation_id)
        assert operation is not None  # only a cancel changes it now, and a cancel keeps the row
        return api.StartMergeResponse(operation=await self.message(operation), created=True)

    async def _active_or_fail(self, user: str) -> Operation:
        async with self._db.connection() as connection:
            active = await store.load_active(connection, user)
        if active is None:
            raise MergeError("the active slot kept changing; retry")
        return active

    async def _renew_admission(self, operation_id: str) -> None:
        """Keep the admission's lease while the start claims and reads the sources (transcript may be
        slow): lapsed, it would let a worker in to claim them too. Sleeps in real time, like every
        background loop: the lease's end is the injected clock's."""
        ttl_ms = round(self._settings.lease_ttl_seconds * 1000)
        while True:
            await asyncio.sleep(self._settings.lease_renew_seconds)
            try:
                async with self._db.transaction() as connection:
                    await store.renew_admission(connection, operation_id, self._clock.now_ms() + ttl_ms)
            except (OSError, SQLAlchemyError) as error:
                # The database is unreachable: the admission's own writes will fail too.
                logger.warning(
                    "admission lease not renewed", extra={"operation_id": operation_id, "error": type(error).__name__}
                )

    async def _admit(self, user: str, operation_id: str, parameters: Parameters) -> None:
        """Claim the sources and record the claim and the cut; on any failure nothing stays claimed."""
        sources = parameters.source_session_ids
        try:
            claim = await claim_sources(self._transcript, user, operation_id, sources, self._settings.claim_ttl_seconds)
        except TreeChanged as changed:
            raise SourceBusy("the source trees kept changing while they were claimed") from changed
        try:
            cuts = await read_cut(self._transcript, user, sources)
            async with self._db.transaction() as connection:
                recorded = await store.record_claim(
                    connection,
                    operation_id,
                    store.FIRST_EPOCH,
                    claim.claim_id,
                    claim.root_session_ids,
                    claim.expire_ms,
                    cut_json(cuts),
                    self._clock.now_ms(),
                    admitted=True,
                )
        except BaseException:
            with contextlib.suppress(MergeError):
                await self._transcript.release_claim(user, claim.claim_id)
            raise
        if not recorded:
            # Cancelled while admitting: the cancel won, and it leaves nothing claimed.
            await self._transcript.release_claim(user, claim.claim_id)
            async with self._db.transaction() as connection:
                await store.end_admission(connection, operation_id, self._clock.now_ms())

    async def _release_claims(self, operation: Operation) -> Operation:
        """Free the sources of a cancelled operation at once (a repeated cancel retries a release that
        failed); the operation as it stands after."""
        operation_id = operation.operation_id
        try:
            await self._transcript.release_holder_claims(holder(operation_id))
        except MergeError as error:
            # The claim lapses with its lease; a repeated cancel tries again.
            logger.warning("claims not released", extra={"operation_id": operation_id, "reason": error.reason})
            return operation
        async with self._db.transaction() as connection:
            await store.forget_claim(connection, operation_id, self._clock.now_ms())
            latest = await store.load(connection, operation_id)
        return latest or operation

    async def get(self, user: str, operation_id: str) -> pb.MergeOperation:
        """One operation of the acting user."""
        return await self.message(await self._owned(user, validation.operation_id(operation_id)))

    async def handoff_binding(self, user: str, target_session_id: str) -> api.GetHandoffBindingResponse:
        """The operation that publishes `target_session_id`, as handoff-read checks a binding; the
        acting user must own it."""
        target_session_id = validation.session_id(target_session_id, "target_session_id")
        async with self._db.connection() as connection:
            operation = await store.load_by_target(connection, target_session_id)
        if operation is None:
            raise OperationNotFound(
                "no merge operation publishes this session", metadata={"target_session_id": target_session_id}
            )
        if operation.owner != user:
            raise PermissionDenied(
                "the merge operation belongs to another user", metadata={"operation_id": operation.operation_id}
            )
        return api.GetHandoffBindingResponse(
            operation_id=operation.operation_id,
            protocol_version=operation.protocol_version,
            status=STATUSES[operation.status],
            target_session_id=operation.target_session_id,
            handoff_hash=operation.handoff_hash or "",
            snapshot_version=operation.snapshot_version,
            snapshot_hash=operation.snapshot_hash or "",
        )

    async def get_active(self, user: str) -> api.GetActiveMergeResponse:
        """The user's unfinished operation, or an empty answer."""
        async with self._db.connection() as connection:
            active = await store.load_active(connection, user)
        if active is None:
            return api.GetActiveMergeResponse()
        return api.GetActiveMergeResponse(operation=await self.message(active))

    async def resume(self, user: str, request: api.ResumeMergeRequest) -> pb.MergeOperation:
        """Resume a paused operation at the epoch the caller saw; a stale or duplicate resume is refused
        with the operation as it stands."""
        operation_id, expected_epoch, model = validation.resume(request)
        operation = await self._owned(user, operation_id)
        execution = None
        if model:
            captured = operation.execution
            execution = Execution(model, captured.target_title, captured.working_directory, captured.primary_model)
        async with self._db.transaction() as connection:
            resumed = await store.resume(
                connection, operation_id, user, expected_epoch, execution, self._clock.now_ms()
            )
            latest = await store.load(connection, operation_id)
        if latest is None:
            raise OperationNotFound("no such merge operation", metadata={"operation_id": operation_id})
        if not resumed:
            raise StaleOperation("the operation is not paused at that run epoch", await self.message(latest))
        self._signals.wake()
        return await self.message(latest)

    async def cancel(self, user: str, operation_id: str) -> pb.MergeOperation:
        """Cancel an unfinished operation (again: the same answer); a completed one is refused."""
        operation_id = validation.operation_id(operation_id)
        await self._owned(user, operation_id)
        async with self._db.transaction() as connection:
            cancelled = await store.cancel(connection, operation_id, user, self._clock.now_ms())
            latest = await store.load(connection, operation_id)
        if latest is None:
            # Its admission was refused (a busy source) while this call ran.
            raise OperationNotFound("no such merge operation", metadata={"operation_id": operation_id})
        if latest.status == "completed":
            raise AlreadyCompleted("the merge is completed; it can no longer be cancelled", await self.message(latest))
        if cancelled:
            self._signals.superseded(operation_id)
            logger.info("merge cancelled", extra={"operation_id": operation_id, "run_epoch": latest.run_epoch})
        if latest.claim_id is not None:
            latest = await self._release_claims(latest)
        return await self.message(latest)
