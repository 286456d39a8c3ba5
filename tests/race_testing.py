"""Forcing the order of racing statements on PostgreSQL (importable as `race_testing`).

The race tests hold a lock in one transaction, start the racers, wait here until PostgreSQL shows
them queued behind it (`pg_stat_activity`), then release: the order the database grants the lock in
is the order the test chose, with no sleeps and no luck.
"""

from __future__ import annotations

from deadline_testing import eventually
from sqlalchemy import text

from continuum_runtime.database import Database


async def lock_waiters(database: Database) -> int:
    """How many statements of this database are waiting on a lock right now."""
    async with database.connection() as connection:
        found = await connection.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        )
    return int(found or 0)


async def until_waiting(database: Database, count: int, what: str, seconds: float = 10.0) -> None:
    """Return once at least `count` statements wait on a lock; fail naming `what` otherwise."""

    async def queued() -> bool:
        return await lock_waiters(database) >= count

    await eventually(queued, what=f"{count} statement(s) waiting on a lock: {what}", seconds=seconds)
