"""The process's database handle: the driver's own connections handed out by the pool, and a dispose
that waits for connections still in use."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import event, text

from continuum_runtime import database as database_module
from continuum_runtime.database import Database


@pytest.mark.postgres
async def test_a_driver_connection_that_failed_is_never_handed_out_again(postgres_url: str) -> None:
    database = Database(postgres_url, schema="public", pool_size=1)
    try:
        async with database.driver_connection() as driver:
            first = await driver.fetchval("SELECT pg_backend_pid()")
        async with database.driver_connection() as driver:
            # A healthy connection goes back to the pool and is used again.
            assert await driver.fetchval("SELECT pg_backend_pid()") == first

        with pytest.raises(asyncpg.DivisionByZeroError):
            async with database.driver_connection() as driver:
                await driver.fetchval("SELECT 1 / 0")

        assert driver.is_closed()
        async with database.driver_connection() as driver:
            assert await driver.fetchval("SELECT pg_backend_pid()") != first
    finally:
        await database.dispose()


async def _backend_pid_together(database: Database, entered: asyncio.Barrier) -> int:
    """The backend of a driver connection held until every party of `entered` holds one."""
    async with database.driver_connection() as driver:
        await entered.wait()
        return int(await driver.fetchval("SELECT pg_backend_pid()"))


def _count_checkouts(database: Database) -> list[int]:
    """A one-element list counting the connections the pool hands out from now on."""
    checkouts = [0]

    @event.listens_for(database.engine.sync_engine.pool, "checkout")
    def _checked_out(*_: object) -> None:
        checkouts[0] += 1

    return checkouts


@pytest.mark.postgres
async def test_driver_connections_are_kept_between_uses_up_to_half_the_pool(postgres_url: str) -> None:
    database = Database(postgres_url, schema="public", pool_size=4)
    checkouts = _count_checkouts(database)
    try:
        # Three at once: two are kept afterwards, the third goes back to the pool.
        entered = asyncio.Barrier(3)
        used = set(await asyncio.gather(*(_backend_pid_together(database, entered) for _ in range(3))))
        assert len(used) == 3 and checkouts[0] == 3
        assert database.engine.pool.checkedout() == 2  # type: ignore[attr-defined]

        # Later uses take a kept connection: no checkout.
        for _ in range(5):
            async with database.driver_connection() as driver:
                assert await driver.fetchval("SELECT pg_backend_pid()") in used
        assert checkouts[0] == 3

        # A statement's error discards its connection only: the other one is still kept.
        with pytest.raises(asyncpg.DivisionByZeroError):
            async with database.driver_connection() as driver:
                await driver.fetchval("SELECT 1 / 0")
        assert database.engine.pool.checkedout() == 1  # type: ignore[attr-defined]

        # One left inside a transaction is neither kept nor handed to the pool's other users: closed.
        async with database.driver_connection() as driver:
            await driver.execute("BEGIN")
        assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert driver.is_closed()
    finally:
        await database.dispose()
    # Dispose closes the kept ones too.
    assert database.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


@pytest.mark.postgres
async def test_kept_driver_connections_go_back_to_the_pool_once_idle_too_long(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = Database(postgres_url, schema="public", pool_size=4)
    checkouts = _count_checkouts(database)
    try:
        async with database.driver_connection() as driver:
            await driver.fetchval("SELECT 1")
        monkeypatch.setattr(database_module, "KEPT_IDLE_SECONDS", 0.0)
        async with database.driver_connection() as driver:
            # The kept one went back first, so this one came from the pool.
            assert checkouts[0] == 2
            assert database.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    finally:
        await database.dispose()


@pytest.mark.postgres
async def test_when_a_kept_connection_lost_its_server_the_other_kept_ones_are_discarded(postgres_url: str) -> None:
    database = Database(postgres_url, schema="public", pool_size=4)
    try:
        entered = asyncio.Barrier(2)
        kept = await asyncio.gather(*(_backend_pid_together(database, entered) for _ in range(2)))
        # The database restarts, as far as these two connections can tell.
        admin = await asyncpg.connect(postgres_url.replace("+asyncpg", "", 1))
        try:
            for pid in kept:
                assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()

        # How the loss shows depends on when the driver reads the server's goodbye: a shutdown error,
        # a closed connection or a protocol state error.
        with pytest.raises(Exception):  # noqa: B017, PT011
            async with database.driver_connection() as driver:
                await driver.fetchval("SELECT 1")
        # The other kept connection was discarded with it: the next statement gets a live one.
        async with database.driver_connection() as driver:
            assert await driver.fetchval("SELECT pg_backend_pid()") not in kept
    finally:
        await database.dispose()


async def test_dispose_waits_for_a_connection_still_in_use(tmp_path: Path) -> None:
    """A step that finishes after its caller was cancelled still holds a connection when the process
    stops: dispose waits for it (closed by the pool, not left to the garbage collector)."""
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}", schema="main")
    release = asyncio.Event()
    order: list[str] = []

    async def step() -> None:
        async with database.transaction() as connection:
            await connection.execute(text("SELECT 1"))
            await release.wait()
        order.append("step returned its connection")

    holder = asyncio.create_task(step())
    await asyncio.sleep(0.05)
    disposing = asyncio.create_task(database.dispose())
    await asyncio.sleep(0.05)
    assert not disposing.done()
    release.set()
    await asyncio.wait_for(disposing, 5)
    order.append("disposed")
    await holder
    assert order == ["step returned its connection", "disposed"]


async def test_dispose_gives_up_waiting_after_its_bound(tmp_path: Path) -> None:
    database = Database(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}", schema="main")
    release = asyncio.Event()

    async def step() -> None:
        async with database.connection() as connection:
            await connection.execute(text("SELECT 1"))
            await release.wait()
            # Outliving the dispose, this holder closes its connection itself (the test's, not the pool's).
            await connection.invalidate()

    holder = asyncio.create_task(step())
    await asyncio.sleep(0.05)
    # Not returned within the bound: dispose goes on without it.
    await asyncio.wait_for(database.dispose(wait_seconds=0.1), 5)
    assert not holder.done()
    release.set()
    await holder


async def test_a_connection_waits_to_switch_a_file_to_wal_while_another_holds_the_writer_lock(
    tmp_path: Path,
) -> None:
    """Switching a new file to WAL while another process holds its writer lock is refused at once
    (SQLite's deadlock rule skips the busy timeout): the connection asks again until the lock is free."""
    path = tmp_path / "db.sqlite"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")
    database = Database(f"sqlite+aiosqlite:///{path}", schema="main")
    try:
        connecting = asyncio.create_task(_read(database))
        await asyncio.sleep(0.3)
        assert not connecting.done()  # still waiting, not refused
        holder.execute("COMMIT")
        assert await asyncio.wait_for(connecting, 5) == "wal"
    finally:
        holder.close()
        await database.dispose()


async def _read(database: Database) -> str:
    async with database.connection() as connection:
        mode = await connection.scalar(text("PRAGMA journal_mode"))
    return str(mode)


async def test_a_sqlite_connection_closed_with_a_statement_unfinished_frees_the_database(tmp_path: Path) -> None:
    """A statement cut by a cancel leaves its cursor unfinalized, and the pool closes the connection.
    The database must be free at once, not when the garbage collector finds the cursor: here the
    cursor is kept alive on purpose while another process asks for the writer lock without waiting
    and checkpoints the whole write-ahead log (which a reader's snapshot would hold back)."""
    path = tmp_path / "db.sqlite"
    database = Database(f"sqlite+aiosqlite:///{path}", schema="main")
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        async with database.connection() as connection:
            await connection.execute(text("CREATE TABLE t (x INTEGER)"))
            await connection.execute(text("INSERT INTO t SELECT value FROM json_each('[1, 2, 3]')"))
            await connection.commit()
            rows = await connection.stream(text("SELECT x FROM t ORDER BY x"))
            assert [tuple(row) for row in await rows.fetchmany(1)] == [(1,)]
            await connection.invalidate()
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        # (busy, log frames, frames checkpointed): 0 busy and every frame copied back.
        busy, frames, checkpointed = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert (busy, frames, checkpointed) == (0, 0, 0)
        del rows  # the unfinished cursor lived until here
    finally:
        other.close()
        await database.dispose()
