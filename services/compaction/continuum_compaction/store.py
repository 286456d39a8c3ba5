"""Compaction's persistence: the summary record (CAS only), the event history, signals, the event cursor.

Every write that decides a race is one conditional statement whose row count decides. Nothing here
calls a model or another service, so no transaction is held across one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum_compaction.tables import (
    compaction_events,
    compaction_signals,
    event_cursors,
    run_choices,
    session_compactions,
)
from continuum_runtime.database import insert_ignoring_conflicts


@dataclass(frozen=True)
class CompactionRecord:
    """The persisted summary of a session."""

    session_id: str
    summary_text: str
    last_compacted_msg_id: int
    compact_count: int
    input_tokens: int
    output_tokens: int
    compact_model: str
    create_ms: int
    update_ms: int


@dataclass(frozen=True)
class NewSummary:
    """A summary to persist over the boundary it was computed from."""

    session_id: str
    expected_boundary: int | None  # None: no record existed when the history was loaded
    boundary: int
    summary_text: str
    model: str
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class EventRow:
    """One compaction attempt, as recorded."""

    session_id: str
    run_id: str
    trigger_mode: str
    outcome: str
    boundary_before: int
    boundary_after: int
    tokens_before: int
    tokens_after: int
    model: str
    duration_ms: int
    batches_succeeded: int
    batches_failed: int
    facts_found: int
    facts_kept: int
    summary_text: str | None


async def load_record(connection: AsyncConnection, session_id: str) -> CompactionRecord | None:
    """The session's record, if any."""
    row = (
        (await connection.execute(select(session_compactions).where(session_compactions.c.session_id == session_id)))
        .mappings()
        .first()
    )
    return CompactionRecord(**row) if row is not None else None


async def delete_record(connection: AsyncConnection, session_id: str, boundary: int) -> bool:
    """Drop the record whose boundary proved invalid, unless another request already replaced it."""
    statement = delete(session_compactions).where(
        session_compactions.c.session_id == session_id, session_compactions.c.last_compacted_msg_id == boundary
    )
    return (await connection.execute(statement)).rowcount == 1


async def persist_summary(connection: AsyncConnection, summary: NewSummary, now_ms: int) -> CompactionRecord | None:
    """Compare-and-set: the record as stored when this summary took effect, None on a conflict (seed 001 §7.9).

    Over an existing record: update only where the boundary is still the one the summary was built
    from and the new boundary is larger. With no record: insert, racing on the unique session id.
    """
    if summary.expected_boundary is None:
        statement = (
            insert_ignoring_conflicts(connection, session_compactions)
            .values(
                session_id=summary.session_id,
                summary_text=summary.summary_text,
                last_compacted_msg_id=summary.boundary,
                compact_count=1,
                input_tokens=summary.input_tokens,
                output_tokens=summary.output_tokens,
                compact_model=summary.model,
                create_ms=now_ms,
                update_ms=now_ms,
            )
            .on_conflict_do_nothing(index_elements=["session_id"])
        )
        return await _stored(connection, statement)
    if summary.boundary <= summary.expected_boundary:
        return None
    table = session_compactions
    statement = (
        update(table)
        .where(table.c.session_id == summary.session_id, table.c.last_compacted_msg_id == summary.expected_boundary)
        .values(
            summary_text=summary.summary_text,
            last_compacted_msg_id=summary.boundary,
            compact_count=table.c.compact_count + 1,
            input_tokens=table.c.input_tokens + summary.input_tokens,
            output_tokens=table.c.output_tokens + summary.output_tokens,
            compact_model=summary.model,
            update_ms=now_ms,
        )
    )
    return await _stored(connection, statement)


async def _stored(connection: AsyncConnection, statement: Any) -> CompactionRecord | None:
    # RETURNING yields the row only when the write took effect, so no second read is needed.
    row = (await connection.execute(statement.returning(*session_compactions.c))).mappings().first()
    return CompactionRecord(**row) if row is not None else None


async def record_event(connection: AsyncConnection, event: EventRow, now_ms: int) -> int:
    """Append a compaction event; returns its id."""
    result = await connection.execute(
        compaction_events.insert().values(**event.__dict__, create_ms=now_ms).returning(compaction_events.c.event_id)
    )
    return int(result.scalar_one())


async def list_events(
    connection: AsyncConnection, session_id: str, before_event_id: int | None, limit: int
) -> list[dict[str, object]]:
    """The session's events, newest first, strictly before `before_event_id` when given."""
    statement = select(compaction_events).where(compaction_events.c.session_id == session_id)
    if before_event_id is not None:
        statement = statement.where(compaction_events.c.event_id < before_event_id)
    statement = statement.order_by(compaction_events.c.event_id.desc()).limit(limit)
    return [dict(row) for row in (await connection.execute(statement)).mappings()]


async def put_signal(connection: AsyncConnection, session_id: str, run_id: str, now_ms: int) -> None:
    """Queue a manual compaction for run `run_id`; repeating it changes nothing, a newer run replaces it."""
    statement = (
        insert_ignoring_conflicts(connection, compaction_signals)
        .values(session_id=session_id, run_id=run_id, create_ms=now_ms)
        .on_conflict_do_update(index_elements=["session_id"], set_={"run_id": run_id, "create_ms": now_ms})
    )
    await connection.execute(statement)


async def settle_signals(connection: AsyncConnection, session_id: str, run_id: str, *, take: bool) -> bool:
    """Drop a signal of any other (finished) run, which must never fire, and with `take` consume the one
    bound to `run_id` too, in one statement; True when this call consumed it (exactly one caller does)."""
    table = compaction_signals
    statement = delete(table).where(table.c.session_id == session_id)
    if not take:
        statement = statement.where(table.c.run_id != run_id)
    dropped = (await connection.execute(statement.returning(table.c.run_id))).scalars().all()
    return take and run_id in dropped


async def memory_choice(
    connection: AsyncConnection, session_id: str, run_id: str, run_starts: bool, current: bool, now_ms: int
) -> bool:
    """Whether run `run_id` injects memory: `current` (the session's switch now) when the run starts or
    is not known yet, otherwise what was decided when it started."""
    if not run_starts:
        row = (
            await connection.execute(
                select(run_choices.c.run_id, run_choices.c.inject_memory).where(run_choices.c.session_id == session_id)
            )
        ).first()
        if row is not None and row.run_id == run_id:
            return bool(row.inject_memory)
    statement = (
        insert_ignoring_conflicts(connection, run_choices)
        .values(session_id=session_id, run_id=run_id, inject_memory=current, create_ms=now_ms)
        .on_conflict_do_update(
            index_elements=["session_id"], set_={"run_id": run_id, "inject_memory": current, "create_ms": now_ms}
        )
    )
    await connection.execute(statement)
    return current


async def forget_session(connection: AsyncConnection, session_id: str) -> int:
    """Remove everything compaction holds for a deleted session; returns rows removed."""
    removed = 0
    for table in (session_compactions, compaction_signals, compaction_events, run_choices):
        removed += int((await connection.execute(delete(table).where(table.c.session_id == session_id))).rowcount)
    return removed


async def known_sessions(connection: AsyncConnection, after: str, limit: int) -> list[str]:
    """Session ids compaction holds anything for, ascending after `after` (for the reconciler)."""
    ids: set[str] = set()
    for table in (session_compactions, compaction_signals, compaction_events):
        statement = (
            select(table.c.session_id)
            .where(table.c.session_id > after)
            .distinct()
            .order_by(table.c.session_id)
            .limit(limit)
        )
        ids.update(row[0] for row in await connection.execute(statement))
    return sorted(ids)[:limit]


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
