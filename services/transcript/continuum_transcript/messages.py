"""Message store: atomic batch append, reads after a boundary, pages around an anchor, edits."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import ColumnElement, RowMapping, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as pb
from continuum_transcript import events, sessions
from continuum_transcript.clock import now_ms
from continuum_transcript.errors import (
    AttachmentNotFound,
    HistoryGenerationMismatch,
    MessageNotEditable,
    MessageNotFound,
    SessionNotFound,
)
from continuum_transcript.tables import attachments, messages
from continuum_transcript.validation import MessageRow


async def append(
    connection: AsyncConnection, owner: str, session_id: str, batch: list[MessageRow]
) -> tuple[list[int], int]:
    """Store the whole batch atomically; returns the ids, ascending in the order given, and the
    creation time.

    `connection` must not be in a transaction yet: the PostgreSQL hot path is one statement.
    """
    now = now_ms()
    rows = [
        {
            "session_id": session_id,
            "role": row.role,
            "content": row.content,
            "tool_calls": row.tool_calls,
            "tool_call_id": row.tool_call_id,
            "metadata": row.metadata,
            "status": row.status,
            "deleted": False,
            "create_ms": now,
        }
        for row in batch
    ]
    referenced = sorted({attachment for row in batch for attachment in row.attachment_ids()})
    if connection.dialect.name == "postgresql" and not referenced:
        ids = await _append_in_one_statement(connection, owner, session_id, rows)
        if not ids:
            await sessions.load(connection, owner, session_id)  # raises the precise refusal
            raise SessionNotFound("no such session", metadata={"session_id": session_id})
        return ids, now
    async with connection.begin():
        await sessions.load(connection, owner, session_id)
        await _check_attachments(connection, session_id, referenced)
        # Only the ids come back: the response is built from the rows already in hand.
        result = await connection.execute(
            insert(messages).returning(messages.c.message_id, sort_by_parameter_order=True), rows
        )
        return [message_id for (message_id,) in result.all()], now


async def _check_attachments(connection: AsyncConnection, session_id: str, referenced: list[str]) -> None:
    if not referenced:
        return
    found = await connection.execute(
        select(attachments.c.attachment_id).where(
            attachments.c.attachment_id.in_(referenced), attachments.c.session_id == session_id
        )
    )
    missing = sorted(set(referenced) - set(found.scalars()))
    if missing:
        raise AttachmentNotFound(
            "content refers to attachments not uploaded to this session",
            metadata={"session_id": session_id, "attachment_id": missing[0]},
        )


# The ownership check and the insert in one round trip. PostgreSQL evaluates the volatile
# nextval() after the sort (since 9.6), so ids ascend in the batch's own order.
_APPEND_IF_OWNED = """
WITH inserted AS (
    INSERT INTO messages
        (message_id, session_id, role, content, tool_calls, tool_call_id, metadata, status, deleted, create_ms)
    SELECT nextval(pg_get_serial_sequence('messages', 'message_id')), $1::text, b.role, b.content, b.tool_calls,
           b.tool_call_id, b.metadata, b.status, false, $3::bigint
    FROM unnest($4::int[], $5::json[], $6::json[], $7::text[], $8::json[], $9::int[])
         WITH ORDINALITY AS b(role, content, tool_calls, tool_call_id, metadata, status, ord)
    WHERE EXISTS (SELECT 1 FROM sessions WHERE session_id = $1::text AND owner = $2::text AND NOT deleted)
    ORDER BY b.ord
    RETURNING message_id
)
SELECT message_id FROM inserted ORDER BY message_id
"""


async def _append_in_one_statement(
    connection: AsyncConnection, owner: str, session_id: str, rows: list[dict[str, Any]]
) -> list[int]:
    """The append hot path on PostgreSQL; no ids when the session is not a live one of `owner`.

    One statement is atomic on its own, and going straight to asyncpg skips the per-row statement
    building that dominated append's CPU time.
    """
    raw = await connection.get_raw_connection()
    driver: Any = raw.driver_connection
    ids = await driver.fetch(
        _APPEND_IF_OWNED,
        session_id,
        owner,
        rows[0]["create_ms"],
        [row["role"] for row in rows],
        [json.dumps(row["content"]) for row in rows],
        [json.dumps(row["tool_calls"]) for row in rows],
        [row["tool_call_id"] for row in rows],
        [json.dumps(row["metadata"]) for row in rows],
        [row["status"] for row in rows],
    )
    return [record[0] for record in ids]


async def get(connection: AsyncConnection, owner: str, session_id: str, message_id: int) -> RowMapping:
    """One message of the session, deleted or not; NOT_FOUND if it is in another session."""
    await sessions.load(connection, owner, session_id, include_deleted=True)
    row = (
        (
            await connection.execute(
                select(messages).where(messages.c.message_id == message_id, messages.c.session_id == session_id)
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        raise MessageNotFound(
            "no such message in this session", metadata={"session_id": session_id, "message_id": message_id}
        )
    return row


async def list_after(
    connection: AsyncConnection, owner: str, session_id: str, after_message_id: int, limit: int
) -> list[RowMapping]:
    """Live messages with id > after_message_id, ascending. Served by (session_id, deleted, id)."""
    await sessions.load(connection, owner, session_id)
    query = (
        select(messages)
        .where(
            messages.c.session_id == session_id,
            messages.c.deleted.is_(False),
            messages.c.message_id > after_message_id,
        )
        .order_by(messages.c.message_id)
        .limit(limit)
    )
    return list((await connection.execute(query)).mappings())


async def page(
    connection: AsyncConnection, owner: str, session_id: str, anchor: int, newer: bool, size: int
) -> tuple[list[RowMapping], bool, bool]:
    """Up to `size` live messages on one side of `anchor` (0 = the end), ascending, with whether
    more exist beyond each edge of the page."""
    await sessions.load(connection, owner, session_id)
    live = (messages.c.session_id == session_id) & messages.c.deleted.is_(False)
    if newer:
        query = select(messages).where(live, messages.c.message_id > anchor).order_by(messages.c.message_id)
    else:
        bound = messages.c.message_id < anchor if anchor else messages.c.message_id.is_not(None)
        query = select(messages).where(live, bound).order_by(messages.c.message_id.desc())
    rows = list((await connection.execute(query.limit(size + 1))).mappings())
    more = len(rows) > size
    rows = rows[:size]
    if not newer:
        rows.reverse()
    if newer:
        has_older = anchor > 0 and await _exists(connection, live & (messages.c.message_id <= anchor))
        return rows, has_older, more
    has_newer = anchor > 0 and await _exists(connection, live & (messages.c.message_id >= anchor))
    return rows, more, has_newer


async def _exists(connection: AsyncConnection, condition: ColumnElement[bool]) -> bool:
    found = await connection.execute(select(messages.c.message_id).where(condition).limit(1))
    return found.first() is not None


async def edit_user_message(
    connection: AsyncConnection,
    owner: str,
    session_id: str,
    message_id: int,
    content: list[dict[str, object]],
    expected_generation: int | None,
) -> tuple[dict[str, Any], int, int, int]:
    """Replace a USER message's content and logically delete every later message, atomically.

    Returns the edited message, the new history generation, how many messages were deleted, and
    the HISTORY_REWRITTEN event id.
    """
    session = await sessions.load(connection, owner, session_id)
    generation = await sessions.bump_generation(connection, session_id, expected_generation)
    if generation is None:
        raise HistoryGenerationMismatch(
            "the history changed since the caller read it",
            metadata={"session_id": session_id, "expected_generation": expected_generation or 0},
        )
    target = await get(connection, owner, session_id, message_id)
    if target["deleted"] or target["role"] != pb.MESSAGE_ROLE_USER:
        raise MessageNotEditable(
            "only a live USER message can be edited", metadata={"session_id": session_id, "message_id": message_id}
        )
    await connection.execute(update(messages).where(messages.c.message_id == message_id).values(content=content))
    removed = await connection.execute(
        update(messages)
        .where(
            messages.c.session_id == session_id,
            messages.c.deleted.is_(False),
            messages.c.message_id > message_id,
        )
        .values(deleted=True)
    )
    event_id = await events.record(
        connection,
        event_type=events.HISTORY_REWRITTEN,
        session=session,
        payload={"edited_message_id": message_id, "history_generation": generation},
    )
    return {**target, "content": content}, generation, int(removed.rowcount), event_id
