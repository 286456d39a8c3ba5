"""What the live publisher stores: its binding (stream generation), reserved message ids, and batches
persisted in sequence order behind their fan-out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from sqlalchemy import bindparam, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum_runtime.database import Database, insert_ignoring_conflicts
from continuum_transcript.tables import messages, session_runtime


@dataclass(frozen=True)
class Binding:
    """A publisher's claim on a session's live transcript, and the state it resumes from."""

    stream_generation: int
    durable_seq: int
    runtime_state: dict[str, Any]
    pending_prompts: dict[str, dict[str, Any]]


@dataclass
class PersistBatch:
    """One accepted batch as it must reach disk."""

    seq: int
    # Message rows with explicit ids and commit_seq.
    rows: list[dict[str, Any]]
    # The runtime state and prompts after this batch.
    runtime_state: dict[str, Any]
    pending_prompts: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What the batch holds in memory until it is saved (the publisher's backlog bound counts it).
    backlog_bytes: int = 0


async def bind(database: Database, session_id: str, now_ms: int) -> Binding:
    """Take the session's live transcript (at `now_ms`): a new stream generation, resuming from what is durable.

    Every (re)bind bumps the stream generation, so followers of a previous publisher resync, and a
    previous publisher elsewhere is fenced out of further writes.
    """
    async with database.transaction() as connection:
        durable = await connection.scalar(
            select(func.coalesce(func.max(messages.c.commit_seq), 0)).where(messages.c.session_id == session_id)
        )
        fresh = {
            "session_id": session_id,
            "stream_generation": 1,
            "durable_seq": int(durable or 0),
            "runtime_state": {},
            "pending_prompts": {},
            "update_ms": now_ms,
        }
        await connection.execute(
            insert_ignoring_conflicts(connection, session_runtime).values(fresh).on_conflict_do_nothing()
        )
        row = (
            (
                await connection.execute(
                    update(session_runtime)
                    .where(session_runtime.c.session_id == session_id)
                    .values(stream_generation=session_runtime.c.stream_generation + 1, update_ms=now_ms)
                    .returning(*session_runtime.c)
                )
            )
            .mappings()
            .one()
        )
    return Binding(
        stream_generation=int(row["stream_generation"]),
        durable_seq=max(int(row["durable_seq"]), int(durable or 0)),
        runtime_state=dict(row["runtime_state"]),
        pending_prompts=dict(row["pending_prompts"]),
    )


async def bump_stream_generation(
    connection: AsyncConnection, session_id: str, expected: int, now_ms: int
) -> int | None:
    """Advance the stream generation inside a rewrite's transaction; None when `expected` is stale."""
    result = await connection.execute(
        update(session_runtime)
        .where(session_runtime.c.session_id == session_id, session_runtime.c.stream_generation == expected)
        .values(stream_generation=session_runtime.c.stream_generation + 1, update_ms=now_ms)
        .returning(session_runtime.c.stream_generation)
    )
    value = result.scalar_one_or_none()
    return None if value is None else int(value)


async def current_stream_generation(connection: AsyncConnection, session_id: str) -> int:
    """The session's Follow stream generation (0 before it was ever followed or published to)."""
    value = await connection.scalar(
        select(session_runtime.c.stream_generation).where(session_runtime.c.session_id == session_id)
    )
    return int(value or 0)


# On PostgreSQL the message id sequence counts in blocks (INCREMENT BY 8192 since migration 0006): one
# nextval reserves the block of ids from the value it returns up to the next, so a reservation costs a
# nextval per block, not per id, and the ids it holds are ranges, not ints. The statement reads the
# block size from the sequence itself, so a schema not migrated yet (INCREMENT BY 1) still gets
# distinct ids, one per nextval. Nothing else takes ids from the sequence: every message is written by
# a publisher, with its reserved id.
_RESERVE_BLOCKS = """
SELECT seqincrement, array(
    SELECT nextval(seqrelid) AS start FROM generate_series(1, (($1 - 1) / seqincrement + 1)::int) ORDER BY start
)
FROM pg_sequence WHERE seqrelid = pg_get_serial_sequence('messages', 'message_id')::regclass
"""


async def reserve_ids(database: Database, count: int) -> list[range]:
    """`count` (at least one) fresh message ids, as ascending ranges. Ids are reserved ahead of
    persistence so accepted messages can be shown with their final ids before they reach disk."""
    if not database.sqlite:
        # One autocommitted statement straight on the driver: nextval needs no transaction (a
        # sequence never rolls back).
        async with database.driver_connection() as driver:
            block, starts = await driver.fetchrow(_RESERVE_BLOCKS, count)
        blocks = [range(start, start + block) for start in starts]
        # Only what was asked for is handed out; the rest of the last block is never used.
        blocks[-1] = blocks[-1][: count - block * (len(blocks) - 1)]
        return blocks
    async with database.transaction() as connection:
        # SQLite's AUTOINCREMENT counter lives in sqlite_sequence; advancing it reserves the ids.
        await connection.execute(
            text(
                "INSERT INTO sqlite_sequence (name, seq) SELECT 'messages', COALESCE(MAX(message_id), 0)"
                " FROM messages WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'messages')"
            )
        )
        last = await connection.scalar(
            text("UPDATE sqlite_sequence SET seq = seq + :count WHERE name = 'messages' RETURNING seq"),
            {"count": count},
        )
        return [range(int(last) - count + 1, int(last) + 1)]


# PostgreSQL: the fence, the durable sequence and the rows in ONE autocommitted statement, so a
# flush costs one round trip. Rows are written only if the fence held. Every row belongs to the
# publisher's session, so the session id is one value. The rows travel as four JSON arrays that orjson
# writes in C straight from the publisher's row dicts (thirteen typed arrays cost the driver an ABC
# isinstance check per element, ~20 per message): one of the rows' scalar columns, read as records,
# and one per JSON column, whose elements PostgreSQL takes as the JSON text they are. ROWS FROM pairs
# them up by position. Reading the JSON columns out of the records instead parsed every body twice
# (the document, then each value as json), a sixth of the database's CPU per append; and the record
# reader unescapes every string, so a NUL (\u0000, which tool output may hold) anywhere in the
# document failed it, where json_array_elements keeps each element's text as it is. The scalars hold
# no NUL: tool call ids refuse it and previews split words at it. Everything in a row is JSON-shaped
# already: protobuf strings are valid UTF-8, numbers are ints or Struct values (finite floats, see
# `validation.metadata`). The documents go as the bytes orjson wrote (bytea, decoded by PostgreSQL):
# as str, tens of KB per batch would be decoded here only for the driver to encode them again.
_PERSIST_FENCED = """
WITH fence AS (
    UPDATE session_runtime
    SET durable_seq = $3, runtime_state = $4::json, pending_prompts = $5::json, update_ms = $6
    WHERE session_id = $1 AND stream_generation = $2
    RETURNING 1
), written AS (
    INSERT INTO messages
        (message_id, session_id, role, content, tool_calls, tool_call_id, metadata, status, deleted, create_ms,
         commit_seq, body_bytes, preview, result_truncated)
    SELECT message_id, $1, role, content, tool_calls, tool_call_id, metadata, status, false, create_ms,
           commit_seq, body_bytes, preview, result_truncated
    FROM ROWS FROM (
        json_to_recordset(convert_from($7::bytea, 'UTF8')::json)
            AS (message_id bigint, role int, tool_call_id text, status int, create_ms bigint, commit_seq bigint,
                body_bytes bigint, preview text, result_truncated bool),
        json_array_elements(convert_from($8::bytea, 'UTF8')::json),
        json_array_elements(convert_from($9::bytea, 'UTF8')::json),
        json_array_elements(convert_from($10::bytea, 'UTF8')::json)
    ) AS batch (message_id, role, tool_call_id, status, create_ms, commit_seq, body_bytes, preview, result_truncated,
                content, tool_calls, metadata)
    WHERE EXISTS (SELECT 1 FROM fence)
)
SELECT count(*) FROM fence
"""


# SQLite: the same in one transaction; the single writer lock makes it just as atomic.
_ADVANCE_DURABLE = (
    update(session_runtime)
    .where(
        session_runtime.c.session_id == bindparam("fence_session_id"),
        session_runtime.c.stream_generation == bindparam("fence_stream_generation"),
    )
    .values(
        durable_seq=bindparam("durable_seq"),
        runtime_state=bindparam("runtime_state", type_=session_runtime.c.runtime_state.type),
        pending_prompts=bindparam("pending_prompts", type_=session_runtime.c.pending_prompts.type),
        update_ms=bindparam("update_ms"),
    )
)


async def persist(
    database: Database, session_id: str, stream_generation: int, batches: list[PersistBatch], now_ms: int
) -> bool:
    """Write a group of consecutive batches atomically at `now_ms`; False when fenced out (another publisher
    bound the session, or the history was rewritten) and nothing was written."""
    rows = [row for batch in batches for row in batch.rows]
    last = batches[-1]
    if not database.sqlite:
        async with database.driver_connection() as driver:
            held = await _fetch_fenced(driver, session_id, stream_generation, last, rows, now_ms)
        return bool(held)
    async with database.transaction() as connection:
        fenced = await connection.execute(
            _ADVANCE_DURABLE,
            {
                "fence_session_id": session_id,
                "fence_stream_generation": stream_generation,
                "durable_seq": last.seq,
                "runtime_state": last.runtime_state,
                "pending_prompts": last.pending_prompts,
                "update_ms": now_ms,
            },
        )
        if fenced.rowcount != 1:
            await connection.rollback()
            return False
        if rows:
            await connection.execute(insert(messages), rows)
    return True


async def _fetch_fenced(
    driver: Any, session_id: str, stream_generation: int, last: PersistBatch, rows: list[dict[str, Any]], now_ms: int
) -> Any:
    scalars = [
        {
            "message_id": row["message_id"],
            "role": row["role"],
            "tool_call_id": row["tool_call_id"],
            "status": row["status"],
            "create_ms": row["create_ms"],
            "commit_seq": row["commit_seq"],
            "body_bytes": row["body_bytes"],
            "preview": row["preview"],
            "result_truncated": row["result_truncated"],
        }
        for row in rows
    ]
    return await driver.fetchval(
        _PERSIST_FENCED,
        session_id,
        stream_generation,
        last.seq,
        _json(last.runtime_state),
        _json(last.pending_prompts),
        now_ms,
        orjson.dumps(scalars),
        orjson.dumps([row["content"] for row in rows]),
        orjson.dumps([row["tool_calls"] for row in rows]),
        orjson.dumps([row["metadata"] for row in rows]),
    )


def _json(value: dict[str, Any]) -> str:
    """JSON text of the runtime state or the pending prompts (json_format's renderings, which refuse
    NaN themselves)."""
    return orjson.dumps(value).decode()
