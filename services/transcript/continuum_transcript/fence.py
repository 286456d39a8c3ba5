"""The compaction fence: the highest message id a session's summary covers.

Compaction moves it up before it persists a summary: a compare-and-set from the fence it read, at
the history generation it summarized, so concurrent compactions cannot both move it and it never
runs ahead of the summary that wins. Edits at or below it are refused (`messages.edit_user_message`). Both write the
session row, so on PostgreSQL its row lock orders them and on SQLite the single writer does.
"""

from __future__ import annotations

from sqlalchemy import RowMapping, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum_transcript import sessions
from continuum_transcript.errors import CompactionFenceMoved, HistoryRewritten, MessageNotFound
from continuum_transcript.tables import messages
from continuum_transcript.tables import sessions as sessions_table


async def set_fence(
    connection: AsyncConnection,
    owner: str,
    session_id: str,
    message_id: int,
    expected_generation: int,
    expected_fence: int,
    now_ms: int,
) -> RowMapping:
    """Move the fence from `expected_fence` up to `message_id`, only if the history generation is
    still `expected_generation`; returns the updated session row.

    One conditional UPDATE decides, by whether it matched the row. An edit that committed first
    bumped the generation, so this refuses with HISTORY_REWRITTEN; a compaction that moved the fence
    first makes this refuse with COMPACTION_FENCE_MOVED. Either way the caller discards its summary.
    An edit waiting behind this UPDATE's row lock finds the new fence and is refused.
    """
    result = await connection.execute(
        update(sessions_table)
        .where(
            sessions_table.c.session_id == session_id,
            sessions_table.c.owner == owner,
            sessions_table.c.history_generation == expected_generation,
            sessions_table.c.compaction_fence_message_id == expected_fence,
            sessions_table.c.deleted.is_(False),
        )
        .values(compaction_fence_message_id=message_id, update_ms=now_ms)
        .returning(*sessions_table.c)
    )
    row = result.mappings().first()
    if row is None:
        # Another owner's → PERMISSION_DENIED, absent or deleted → NOT_FOUND; otherwise the
        # generation or the fence moved.
        current = await sessions.load(connection, owner, session_id)
        details = {
            "session_id": session_id,
            "expected_history_generation": expected_generation,
            "history_generation": current["history_generation"],
            "expected_fence_message_id": expected_fence,
            "fence_message_id": current["compaction_fence_message_id"],
        }
        if current["history_generation"] != expected_generation:
            raise HistoryRewritten(
                "the history was rewritten after the caller loaded it; discard the summary", metadata=details
            )
        raise CompactionFenceMoved("another compaction moved the fence first; discard the summary", metadata=details)
    # Checked under the row lock: an edit deleting the boundary would have moved the generation.
    if message_id and not await _is_live_message(connection, session_id, message_id):
        raise MessageNotFound(
            "the fence must be a live message of the session",
            metadata={"session_id": session_id, "message_id": message_id},
        )
    return row


async def _is_live_message(connection: AsyncConnection, session_id: str, message_id: int) -> bool:
    found = await connection.execute(
        select(messages.c.message_id).where(
            messages.c.message_id == message_id,
            messages.c.session_id == session_id,
            messages.c.deleted.is_(False),
        )
    )
    return found.first() is not None
