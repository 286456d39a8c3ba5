"""Merge's persistence: operations, units, attempts and the event cursor.

Every write that decides a race is one conditional statement whose row count decides (its comment
says which race). A worker's writes are fenced by `Fence`: they take effect only while the operation
is still preparing at the run epoch the worker took it at. Nothing here calls a model or another
service, so no transaction is held across one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import RowMapping, and_, case, delete, func, literal_column, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.merge.v1 import error_code_pb2
from continuum_merge.tables import event_cursors, session_merge_attempts, session_merge_units, session_merges
from continuum_runtime.database import insert_ignoring_conflicts

PROTOCOL_VERSION = 2
UNFINISHED = ("preparing", "paused", "failed")
FIRST_EPOCH = 1
# The lease a start holds on the operation it inserted until it has recorded the sources' claim and cut
# (or given up). A worker that took the operation meanwhile would claim the same sources under the same
# holder, and whichever claimed second was refused as busy: the run paused, or the start failed for an
# operation that was running. The start renews it while it admits; one that crashed lets it run out,
# and a worker then admits.
# No worker is named so: instance ids never contain "(".
ADMISSION_LEASE_OWNER = "(admission)"
# The pause of a package that no longer matches its hashes (seed 000 §6.3), named by the contract.
DAMAGED = error_code_pb2.MergeErrorCode.Name(error_code_pb2.PACKAGE_DAMAGED)


@dataclass(frozen=True)
class Parameters:
    """What a merge was asked for, normalized (sources in request order)."""

    source_session_ids: tuple[str, ...]
    primary_session_id: str
    title: str
    model: str

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "sourceSessionIds": list(self.source_session_ids),
                "primarySessionId": self.primary_session_id,
                "title": self.title,
                "model": self.model,
            },
            sort_keys=True,
        )

    @staticmethod
    def from_json(stored: str) -> Parameters:
        """Read the stored form."""
        values = json.loads(stored)
        return Parameters(
            tuple(values["sourceSessionIds"]), values["primarySessionId"], values["title"], values["model"]
        )

    def same_request(self, other: Parameters) -> bool:
        """Whether a repeated start asks for the same merge (the order of the sources does not matter)."""
        return (
            sorted(self.source_session_ids) == sorted(other.source_session_ids)
            and self.primary_session_id == other.primary_session_id
            and self.title == other.title
            and self.model == other.model
        )


@dataclass(frozen=True)
class Execution:
    """What the start captured for the run and the target: never re-read from the sources later."""

    model: str
    target_title: str
    working_directory: str
    primary_model: str

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(
            {
                "resolvedModel": self.model,
                "targetTitle": self.target_title,
                "workingDirectory": self.working_directory,
                "primaryModel": self.primary_model,
            },
            sort_keys=True,
        )

    @staticmethod
    def from_json(stored: str) -> Execution:
        """Read the stored form."""
        values = json.loads(stored)
        return Execution(
            values["resolvedModel"], values["targetTitle"], values["workingDirectory"], values["primaryModel"]
        )


@dataclass(frozen=True)
class Operation:
    """One row of session_merges."""

    operation_id: str
    owner: str
    idempotency_key: str
    params_json: str
    target_session_id: str
    protocol_version: int
    status: str
    stage: str
    active_slot: int | None
    run_epoch: int
    execution_json: str
    cut_json: str | None
    claim_id: str | None
    locked_json: str | None
    claim_expire_ms: int | None
    snapshot_version: int
    snapshot_hash: str | None
    handoff_hash: str | None
    units_planned: bool
    error_code: str | None
    error: str | None
    retry_ms: int | None
    damage_resumes: int
    lease_owner: str | None
    lease_expire_ms: int | None
    create_ms: int
    update_ms: int
    cleaned_ms: int | None

    @property
    def parameters(self) -> Parameters:
        """The request as given."""
        return Parameters.from_json(self.params_json)

    @property
    def execution(self) -> Execution:
        """What the start captured."""
        return Execution.from_json(self.execution_json)

    def locked_roots(self, now_ms: int) -> list[str]:
        """The source roots the merge's claim locks at `now_ms` (none once released or lapsed)."""
        if self.locked_json is None or self.claim_expire_ms is None or self.claim_expire_ms <= now_ms:
            return []
        roots: list[str] = json.loads(self.locked_json)
        return roots


@dataclass(frozen=True)
class UnitCounts:
    """Progress of an operation's units; a split parent counts through its children only."""

    completed: int
    known: int


@dataclass(frozen=True)
class Fence:
    """A worker's right to write: the operation, the run epoch it took it at, and its lease name."""

    operation_id: str
    run_epoch: int
    lease_owner: str


def _operation(row: RowMapping | None) -> Operation | None:
    return Operation(**row) if row is not None else None


async def insert_operation(
    connection: AsyncConnection,
    *,
    operation_id: str,
    owner: str,
    idempotency_key: str,
    parameters: Parameters,
    target_session_id: str,
    execution: Execution,
    now_ms: int,
    admission_expire_ms: int,
) -> bool:
    """Take the user's active slot with a new operation, leased to its admission until
    `admission_expire_ms`; False when the slot or the key is taken.

    The race between two starts of one user is decided by the unique partial index on the active slot
    (and two starts with one key by the unique key): the statement inserts nothing on a conflict with
    either, and its row count says whether this start won.
    """
    statement = (
        insert_ignoring_conflicts(connection, session_merges)
        .values(
            operation_id=operation_id,
            owner=owner,
            idempotency_key=idempotency_key,
            params_json=parameters.to_json(),
            target_session_id=target_session_id,
            protocol_version=PROTOCOL_VERSION,
            status="preparing",
            stage="snapshotting",
            active_slot=1,
            run_epoch=FIRST_EPOCH,
            lease_owner=ADMISSION_LEASE_OWNER,
            lease_expire_ms=admission_expire_ms,
            execution_json=execution.to_json(),
            snapshot_version=0,
            units_planned=False,
            create_ms=now_ms,
            update_ms=now_ms,
        )
        .on_conflict_do_nothing()
    )
    return (await connection.execute(statement)).rowcount == 1


async def load(connection: AsyncConnection, operation_id: str) -> Operation | None:
    """One operation by id, of any user."""
    query = select(session_merges).where(session_merges.c.operation_id == operation_id)
    return _operation((await connection.execute(query)).mappings().first())


async def load_many(connection: AsyncConnection, operation_ids: Sequence[str]) -> list[Operation]:
    """The operations among `operation_ids` (of any user; ids that name none are left out), by id."""
    query = (
        select(session_merges)
        .where(session_merges.c.operation_id.in_(operation_ids))
        .order_by(session_merges.c.operation_id)
    )
    return [Operation(**row) for row in (await connection.execute(query)).mappings()]


async def load_by_key(connection: AsyncConnection, owner: str, idempotency_key: str) -> Operation | None:
    """The operation a user started with this idempotency key."""
    query = select(session_merges).where(
        session_merges.c.owner == owner, session_merges.c.idempotency_key == idempotency_key
    )
    return _operation((await connection.execute(query)).mappings().first())


async def load_active(connection: AsyncConnection, owner: str) -> Operation | None:
    """The user's unfinished operation (the one holding the active slot)."""
    query = select(session_merges).where(session_merges.c.owner == owner, session_merges.c.active_slot == 1)
    return _operation((await connection.execute(query)).mappings().first())


async def load_stopping(connection: AsyncConnection, owner: str, now_ms: int) -> Operation | None:
    """A cancelled operation of the user whose worker still holds its lease (is still stopping)."""
    table = session_merges
    query = (
        select(table)
        .where(table.c.owner == owner, table.c.status == "cancelled", table.c.lease_expire_ms > now_ms)
        .limit(1)
    )
    return _operation((await connection.execute(query)).mappings().first())


async def unit_counts(connection: AsyncConnection, operation_id: str) -> UnitCounts:
    """Completed and known units (split parents are replaced by their children in both)."""
    table = session_merge_units
    query = select(
        func.count().filter(table.c.state == "completed"), func.count().filter(table.c.state != "split")
    ).where(table.c.operation_id == operation_id)
    completed, known = (await connection.execute(query)).one()
    return UnitCounts(int(completed), int(known))


async def discard_admission(connection: AsyncConnection, operation_id: str, run_epoch: int) -> bool:
    """Remove an operation whose admission was refused (a busy source) before anything else touched it.

    Conditioned on the first epoch and stage: a row that a worker, a resume or a cancel moved is kept.
    """
    table = session_merges
    statement = delete(table).where(
        table.c.operation_id == operation_id,
        table.c.run_epoch == run_epoch,
        table.c.status == "preparing",
        table.c.claim_id.is_(None),
        table.c.lease_owner == ADMISSION_LEASE_OWNER,
    )
    return (await connection.execute(statement)).rowcount == 1


async def renew_admission(connection: AsyncConnection, operation_id: str, expire_ms: int) -> bool:
    """Extend the admission's lease; False once it ended (or a worker took the operation over)."""
    table = session_merges
    statement = (
        update(table)
        .where(
            table.c.operation_id == operation_id,
            table.c.run_epoch == FIRST_EPOCH,
            table.c.lease_owner == ADMISSION_LEASE_OWNER,
        )
        .values(lease_expire_ms=expire_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def end_admission(connection: AsyncConnection, operation_id: str, now_ms: int) -> bool:
    """Give up the admission's lease (a cancel won the operation meanwhile); False when a worker holds it."""
    table = session_merges
    statement = (
        update(table)
        .where(table.c.operation_id == operation_id, table.c.lease_owner == ADMISSION_LEASE_OWNER)
        .values(lease_owner=None, lease_expire_ms=None, update_ms=now_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


def _fenced(fence: Fence) -> Any:
    # Every worker write: the operation is still preparing at the epoch the worker took it at.
    table = session_merges
    return and_(
        table.c.operation_id == fence.operation_id,
        table.c.run_epoch == fence.run_epoch,
        table.c.status == "preparing",
    )


async def record_claim(
    connection: AsyncConnection,
    operation_id: str,
    run_epoch: int,
    claim_id: str,
    roots: Sequence[str],
    expire_ms: int,
    cut: str,
    now_ms: int,
    *,
    admitted: bool = False,
) -> bool:
    """Record the MERGE claim the operation holds and the cut read under it, if the operation is still
    preparing at `run_epoch` (a cancel in between wins: the caller must then release the claim). The
    admission's record also ends its lease, in the same statement: the operation is a worker's from then."""
    table = session_merges
    admission = {"lease_owner": None, "lease_expire_ms": None} if admitted else {}
    statement = (
        update(table)
        .where(table.c.operation_id == operation_id, table.c.run_epoch == run_epoch, table.c.status == "preparing")
        .values(
            claim_id=claim_id,
            locked_json=json.dumps(sorted(roots)),
            claim_expire_ms=expire_ms,
            cut_json=cut,
            update_ms=now_ms,
            **admission,
        )
    )
    return (await connection.execute(statement)).rowcount == 1


async def renew_claim(connection: AsyncConnection, fence: Fence, expire_ms: int, now_ms: int) -> bool:
    """Move the recorded claim's expiry after a renewal; False when the run was superseded."""
    statement = (
        update(session_merges)
        .where(_fenced(fence), session_merges.c.claim_id.is_not(None))
        .values(claim_expire_ms=expire_ms, update_ms=now_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def forget_claim(connection: AsyncConnection, operation_id: str, now_ms: int) -> None:
    """The claim was released (or lapsed): no source is locked any more. Not fenced: releasing is
    always right, whichever run did it."""
    statement = (
        update(session_merges)
        .where(session_merges.c.operation_id == operation_id)
        .values(claim_id=None, locked_json=None, claim_expire_ms=None, update_ms=now_ms)
    )
    await connection.execute(statement)


async def resume(
    connection: AsyncConnection,
    operation_id: str,
    owner: str,
    expected_epoch: int,
    execution: Execution | None,
    now_ms: int,
) -> bool:
    """Resume a paused operation the caller saw at `expected_epoch` (with `execution` replacing the
    captured one when the caller chose another model).

    Of two duplicate resumes exactly one matches the epoch; it bumps the epoch, so the other (and any
    late replay) updates nothing. The next worker run starts from the first unfinished unit.
    """
    table = session_merges
    values: dict[str, Any] = {
        "status": "preparing",
        "run_epoch": table.c.run_epoch + 1,
        # Counted only while the package keeps being found damaged (the run after this one decides).
        "damage_resumes": case(
            (table.c.error_code == DAMAGED, table.c.damage_resumes + 1),
            else_=0,
        ),
        "error_code": None,
        "error": None,
        "retry_ms": None,
        "update_ms": now_ms,
    }
    if execution is not None:
        values["execution_json"] = execution.to_json()
    statement = (
        update(table)
        .where(
            table.c.operation_id == operation_id,
            table.c.owner == owner,
            table.c.status == "paused",
            table.c.run_epoch == expected_epoch,
        )
        .values(**values)
    )
    return (await connection.execute(statement)).rowcount == 1


async def cancel(connection: AsyncConnection, operation_id: str, owner: str, now_ms: int) -> bool:
    """Cancel an unfinished operation: bump the epoch (fencing its worker out), free the active slot.

    Against a publish, exactly one wins: the publish's completed update requires the epoch this
    statement bumps, and this statement requires a status the completed update leaves.
    """
    table = session_merges
    statement = (
        update(table)
        .where(table.c.operation_id == operation_id, table.c.owner == owner, table.c.status.in_(UNFINISHED))
        .values(
            status="cancelled",
            active_slot=None,
            run_epoch=table.c.run_epoch + 1,
            retry_ms=None,
            update_ms=now_ms,
        )
    )
    return (await connection.execute(statement)).rowcount == 1


def _lease_free(lease_owner: str, now_ms: int) -> Any:
    # No live lease, or one this very replica held before it restarted (its name is stable).
    table = session_merges
    return or_(table.c.lease_expire_ms.is_(None), table.c.lease_expire_ms <= now_ms, table.c.lease_owner == lease_owner)


async def claimable(connection: AsyncConnection, lease_owner: str, now_ms: int, limit: int) -> list[Operation]:
    """Preparing operations no live worker holds (or this replica's previous start held) and not
    waiting for a retry time, oldest first."""
    table = session_merges
    query = (
        select(table)
        .where(
            table.c.status == "preparing",
            _lease_free(lease_owner, now_ms),
            or_(table.c.retry_ms.is_(None), table.c.retry_ms <= now_ms),
        )
        .order_by(table.c.update_ms, table.c.operation_id)
        .limit(limit)
    )
    return [Operation(**row) for row in (await connection.execute(query)).mappings()]


async def take_lease(
    connection: AsyncConnection, operation: Operation, lease_owner: str, now_ms: int, ttl_ms: int
) -> Fence | None:
    """Take the worker lease on an operation seen at `operation.run_epoch` and start a new run.

    Two replicas racing for one operation both condition on the epoch they saw and on the lease being
    free or lapsed; the first bumps the epoch, so the second updates nothing. The bump also fences
    out a previous worker that lost its lease but still runs.
    """
    table = session_merges
    statement = (
        update(table)
        .where(
            table.c.operation_id == operation.operation_id,
            table.c.run_epoch == operation.run_epoch,
            table.c.status == "preparing",
            _lease_free(lease_owner, now_ms),
        )
        .values(
            run_epoch=table.c.run_epoch + 1,
            lease_owner=lease_owner,
            lease_expire_ms=now_ms + ttl_ms,
            update_ms=now_ms,
        )
    )
    if (await connection.execute(statement)).rowcount != 1:
        return None
    return Fence(operation.operation_id, operation.run_epoch + 1, lease_owner)


async def renew_lease(connection: AsyncConnection, fence: Fence, now_ms: int, ttl_ms: int) -> bool:
    """Extend the lease; False when the run was superseded (cancel, resume elsewhere, pause, takeover)."""
    statement = (
        update(session_merges)
        .where(_fenced(fence), session_merges.c.lease_owner == fence.lease_owner)
        .values(lease_expire_ms=now_ms + ttl_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def release_lease(connection: AsyncConnection, fence: Fence, now_ms: int) -> bool:
    """Give the lease up (a graceful stop, or a run that ended): whatever the status now, as long as
    this worker still holds it, so a cancelled operation's cleanup sees its writer gone."""
    table = session_merges
    statement = (
        update(table)
        .where(table.c.operation_id == fence.operation_id, table.c.lease_owner == fence.lease_owner)
        .values(lease_owner=None, lease_expire_ms=None, update_ms=now_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def load_fenced(connection: AsyncConnection, fence: Fence) -> Operation | None:
    """The operation, if the run behind `fence` is still current."""
    query = select(session_merges).where(_fenced(fence))
    return _operation((await connection.execute(query)).mappings().first())


async def advance(connection: AsyncConnection, fence: Fence, now_ms: int, **values: Any) -> bool:
    """A fenced write of the worker's progress (stage, cut, seal, ...); False when superseded."""
    statement = update(session_merges).where(_fenced(fence)).values(update_ms=now_ms, **values)
    return (await connection.execute(statement)).rowcount == 1


async def pause(connection: AsyncConnection, fence: Fence, code: str, error: str, now_ms: int, *, failed: bool) -> bool:
    """Stop the run for the user: paused (resumable) or failed (cancel only), with the reason; the
    lease is released at once."""
    return await advance(
        connection,
        fence,
        now_ms,
        status="failed" if failed else "paused",
        error_code=code,
        error=error,
        retry_ms=None,
        lease_owner=None,
        lease_expire_ms=None,
    )


async def retry_later(connection: AsyncConnection, fence: Fence, retry_ms: int, code: str, now_ms: int) -> bool:
    """Stay preparing and retry at `retry_ms` (any replica may), releasing the lease."""
    return await advance(
        connection,
        fence,
        now_ms,
        retry_ms=retry_ms,
        error_code=code or None,
        error=None,
        lease_owner=None,
        lease_expire_ms=None,
    )


async def complete(connection: AsyncConnection, fence: Fence, handoff_hash: str, now_ms: int) -> bool:
    """The publish's last step: completed, with the handoff hash and the active slot freed.

    Conditioned on the publishing stage at the run's epoch: against a cancel exactly one of the two
    statements matches.
    """
    statement = (
        update(session_merges)
        .where(_fenced(fence), session_merges.c.stage == "publishing")
        .values(
            status="completed",
            stage="completed",
            handoff_hash=handoff_hash,
            active_slot=None,
            error_code=None,
            error=None,
            retry_ms=None,
            lease_owner=None,
            lease_expire_ms=None,
            update_ms=now_ms,
        )
    )
    return (await connection.execute(statement)).rowcount == 1


@dataclass(frozen=True)
class NewUnit:
    """A planned unit to insert."""

    unit_id: str
    stage: str
    ordinal: int
    input_hash: str
    input_json: str
    processor_version: str
    model: str


@dataclass(frozen=True)
class Unit:
    """One row of session_merge_units."""

    operation_id: str
    unit_id: str
    stage: str
    ordinal: int
    input_hash: str
    input_json: str
    processor_version: str
    model: str
    state: str
    attempt_count: int
    run_epoch: int
    result_path: str | None
    result_hash: str | None
    error_code: str | None
    update_ms: int


async def insert_units(connection: AsyncConnection, fence: Fence, units: Sequence[NewUnit], now_ms: int) -> bool:
    """Insert one batch of planned units within the caller's transaction (ids are deterministic: planning
    again after a crash inserts nothing new); False (nothing to commit) when the run was superseded.

    The plan is final only once `finish_plan` commits, after its last batch."""
    if not await advance(connection, fence, now_ms):
        return False
    for unit in units:
        statement = (
            insert_ignoring_conflicts(connection, session_merge_units)
            .values(
                operation_id=fence.operation_id,
                state="pending",
                attempt_count=0,
                run_epoch=fence.run_epoch,
                update_ms=now_ms,
                **unit.__dict__,
            )
            .on_conflict_do_nothing(index_elements=["operation_id", "unit_id"])
        )
        await connection.execute(statement)
    return True


async def finish_plan(connection: AsyncConnection, fence: Fence, now_ms: int) -> bool:
    """Mark the plan final (every batch inserted); fenced like every worker write."""
    return await advance(connection, fence, now_ms, units_planned=True)


async def list_units(
    connection: AsyncConnection,
    operation_id: str,
    stage: str,
    *,
    after: tuple[int, str] | None,
    limit: int,
    state: str | None = None,
) -> list[Unit]:
    """A page of an operation's units of one stage (in `state`, when given) in plan order, (ordinal,
    unit id), after the unit `after` names (None: from the first). A split's children sort right after
    their parent, so the page after a parent that was just split starts with its children."""
    table = session_merge_units
    conditions = [table.c.operation_id == operation_id, table.c.stage == stage]
    if state is not None:
        conditions.append(table.c.state == state)
    if after is not None:
        ordinal, unit_id = after
        conditions.append(or_(table.c.ordinal > ordinal, and_(table.c.ordinal == ordinal, table.c.unit_id > unit_id)))
    query = select(table).where(*conditions).order_by(table.c.ordinal, table.c.unit_id).limit(limit)
    return [Unit(**row) for row in (await connection.execute(query)).mappings()]


async def reset_running_units(connection: AsyncConnection, fence: Fence, now_ms: int) -> int:
    """A new run: units a superseded run left running go back to pending (their attempts stay as
    they were recorded). Only while the new run's fence holds."""
    if await load_fenced(connection, fence) is None:
        return 0
    table = session_merge_units
    statement = (
        update(table)
        .where(table.c.operation_id == fence.operation_id, table.c.state == "running")
        .values(state="pending", update_ms=now_ms)
    )
    return int((await connection.execute(statement)).rowcount)


async def start_unit(
    connection: AsyncConnection, fence: Fence, unit_id: str, request_id: str, model: str, now_ms: int
) -> bool:
    """Short transaction before a model call: pending → running with a new unique attempt.

    Conditioned on the unit being pending and on the run's fence (checked in the same transaction
    by a fenced touch of the operation row, which also serializes against a cancel's update).
    """
    if not await advance(connection, fence, now_ms):
        return False
    table = session_merge_units
    statement = (
        update(table)
        .where(table.c.operation_id == fence.operation_id, table.c.unit_id == unit_id, table.c.state == "pending")
        .values(
            state="running",
            attempt_count=table.c.attempt_count + 1,
            run_epoch=fence.run_epoch,
            model=model,
            update_ms=now_ms,
        )
    )
    if (await connection.execute(statement)).rowcount != 1:
        return False
    await connection.execute(
        session_merge_attempts.insert().values(
            request_id=request_id,
            operation_id=fence.operation_id,
            unit_id=unit_id,
            run_epoch=fence.run_epoch,
            model=model,
            start_ms=now_ms,
            outcome="running",
        )
    )
    return True


async def complete_unit(
    connection: AsyncConnection, fence: Fence, unit_id: str, result_path: str, result_hash: str, now_ms: int
) -> bool:
    """Short transaction after the result file was renamed into place: running (in this run) →
    completed with its path and hash; False when the run was superseded meanwhile."""
    if not await advance(connection, fence, now_ms):
        return False
    table = session_merge_units
    statement = (
        update(table)
        .where(
            table.c.operation_id == fence.operation_id,
            table.c.unit_id == unit_id,
            table.c.state == "running",
            table.c.run_epoch == fence.run_epoch,
        )
        .values(state="completed", result_path=result_path, result_hash=result_hash, error_code=None, update_ms=now_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def finish_attempt(
    connection: AsyncConnection,
    request_id: str,
    outcome: str,
    input_tokens: int | None,
    output_tokens: int | None,
    now_ms: int,
) -> bool:
    """Record an attempt's terminal outcome and usage once (a late repeat changes nothing); never
    touches the unit or the operation."""
    table = session_merge_attempts
    statement = (
        update(table)
        .where(table.c.request_id == request_id, table.c.outcome == "running")
        .values(outcome=outcome, input_tokens=input_tokens, output_tokens=output_tokens, finish_ms=now_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def load_cursor(connection: AsyncConnection, consumer: str) -> int:
    """The last session event this consumer handled (0 before the first)."""
    row = (
        await connection.execute(select(event_cursors.c.last_event_id).where(event_cursors.c.consumer == consumer))
    ).first()
    return int(row[0]) if row is not None else 0


async def save_cursor(connection: AsyncConnection, consumer: str, event_id: int, now_ms: int) -> None:
    """Advance the cursor (never backwards)."""
    statement = (
        insert_ignoring_conflicts(connection, event_cursors)
        .values(consumer=consumer, last_event_id=event_id, update_ms=now_ms)
        .on_conflict_do_update(
            index_elements=["consumer"],
            set_={"last_event_id": event_id, "update_ms": now_ms},
            where=event_cursors.c.last_event_id < event_id,
        )
    )
    await connection.execute(statement)


async def redo_unit(connection: AsyncConnection, fence: Fence, unit_id: str, now_ms: int) -> bool:
    """A completed unit whose result file no longer matches its hash goes back to pending (only that
    unit is redone); fenced like every worker write."""
    if not await advance(connection, fence, now_ms):
        return False
    table = session_merge_units
    statement = (
        update(table)
        .where(table.c.operation_id == fence.operation_id, table.c.unit_id == unit_id, table.c.state == "completed")
        .values(state="pending", result_path=None, result_hash=None, update_ms=now_ms)
    )
    return (await connection.execute(statement)).rowcount == 1


async def cancelled_uncleaned(connection: AsyncConnection, after: str, now_ms: int, limit: int) -> list[Operation]:
    """Cancelled operations not cleaned yet whose writers stopped (no lease, or one that ran out by
    `now_ms`: a writer killed mid-run), by id after `after`."""
    table = session_merges
    query = (
        select(table)
        .where(
            # Spelled as in the partial index's predicate (a bound parameter would not match it).
            table.c.status == literal_column("'cancelled'"),
            table.c.cleaned_ms.is_(None),
            or_(table.c.lease_owner.is_(None), table.c.lease_expire_ms <= now_ms),
            table.c.operation_id > after,
        )
        .order_by(table.c.operation_id)
        .limit(limit)
    )
    return [Operation(**row) for row in (await connection.execute(query)).mappings()]


async def mark_cleaned(connection: AsyncConnection, operation_id: str, now_ms: int) -> None:
    """A cancelled operation's leftovers are removed: no sweep looks at it again. Only a cancelled
    operation's row changes, once (a later cleanup, by the CronJob's walk, finds it marked already)."""
    table = session_merges
    statement = (
        update(table)
        .where(table.c.operation_id == operation_id, table.c.status == "cancelled", table.c.cleaned_ms.is_(None))
        .values(cleaned_ms=now_ms, update_ms=now_ms)
    )
    await connection.execute(statement)


async def load_by_target(connection: AsyncConnection, target_session_id: str) -> Operation | None:
    """The operation that reserved this target id, if any."""
    query = select(session_merges).where(session_merges.c.target_session_id == target_session_id)
    return _operation((await connection.execute(query)).mappings().first())


async def split_unit(
    connection: AsyncConnection, fence: Fence, unit_id: str, children: Sequence[NewUnit], now_ms: int
) -> bool:
    """In one transaction: the running parent becomes split, naming its children in its input_json, and
    the children are inserted pending (so a parent and its children never both run). Fenced."""
    if not await advance(connection, fence, now_ms):
        return False
    table = session_merge_units
    parent = (
        await connection.execute(
            select(table.c.input_json).where(
                table.c.operation_id == fence.operation_id,
                table.c.unit_id == unit_id,
                table.c.state == "running",
                table.c.run_epoch == fence.run_epoch,
            )
        )
    ).first()
    if parent is None:
        return False
    described = {**json.loads(parent[0]), "childUnitIds": [child.unit_id for child in children]}
    statement = (
        update(table)
        .where(
            table.c.operation_id == fence.operation_id,
            table.c.unit_id == unit_id,
            table.c.state == "running",
            table.c.run_epoch == fence.run_epoch,
        )
        .values(state="split", input_json=json.dumps(described, separators=(",", ":")), update_ms=now_ms)
    )
    if (await connection.execute(statement)).rowcount != 1:
        return False
    for child in children:
        await connection.execute(
            insert_ignoring_conflicts(connection, table)
            .values(
                operation_id=fence.operation_id,
                state="pending",
                attempt_count=0,
                run_epoch=fence.run_epoch,
                update_ms=now_ms,
                **child.__dict__,
            )
            .on_conflict_do_nothing(index_elements=["operation_id", "unit_id"])
        )
    return True
