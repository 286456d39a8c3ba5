"""Session events outbox: rows written in the same transaction as the change they describe."""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from sqlalchemy import RowMapping, insert, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum.transcript.v1 import resources_pb2 as pb
from continuum_transcript.tables import session_events

DELETED = int(pb.SESSION_EVENT_TYPE_DELETED)
HISTORY_REWRITTEN = int(pb.SESSION_EVENT_TYPE_HISTORY_REWRITTEN)

_OUTBOX_LOCK = zlib.crc32(b"continuum-transcript:session-events")


async def record(
    connection: AsyncConnection, *, event_type: int, session: RowMapping, payload: dict[str, Any], now_ms: int
) -> int:
    """Append an event; returns its id.

    On PostgreSQL a transaction-scoped advisory lock orders id assignment with commit order, so a
    consumer that has seen event N never later finds a smaller id committing behind it.
    """
    if connection.dialect.name == "postgresql":
        await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _OUTBOX_LOCK})
    result = await connection.execute(
        insert(session_events)
        .values(
            event_type=event_type,
            session_id=session["session_id"],
            root_session_id=session["root_session_id"],
            owner=session["owner"],
            payload=payload,
            create_ms=now_ms,
        )
        .returning(session_events.c.event_id)
    )
    return int(result.scalar_one())


async def list_after(
    connection: AsyncConnection, after_event_id: int, limit: int, owner: str | None
) -> list[RowMapping]:
    """Events with id > cursor in id order; only `owner`'s when a user is acting."""
    query = select(session_events).where(session_events.c.event_id > after_event_id)
    if owner is not None:
        query = query.where(session_events.c.owner == owner)
    query = query.order_by(session_events.c.event_id).limit(limit)
    return list((await connection.execute(query)).mappings())


class EventBell:
    """Wakes local watchers as soon as this process commits an event; other processes' events
    are found by the watchers' periodic poll."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def ring(self) -> None:
        """Wake every current waiter."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self, seconds: float) -> None:
        """Return on the next ring or after `seconds`."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), seconds)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)
