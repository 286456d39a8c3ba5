"""One async SQLAlchemy engine per process, over asyncpg (PostgreSQL) or aiosqlite (embedded)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar, overload

from sqlalchemy import Table, event, make_url
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.util import await_, greenlet_spawn

# How long `dispose` waits for connections still in use.
DISPOSE_WAIT_SECONDS = 5.0
# How long a SQLite connection waits for another process's lock (busy_timeout), in seconds.
SQLITE_BUSY_SECONDS = 10.0


def is_sqlite(url: str) -> bool:
    """True for the embedded SQLite backend."""
    return url.startswith("sqlite")


def insert_ignoring_conflicts(connection: AsyncConnection, table: Table) -> Any:
    """An INSERT that skips rows conflicting on a unique key (both backends spell it the same)."""
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


class Database:
    """Owns the process's engine. Services open one transaction per RPC through `transaction()`.

    On PostgreSQL every connection's search_path is the service's own schema, so table names stay
    unqualified in code and migrations alike. On SQLite the file is the service's own; connections
    use WAL, foreign keys and `BEGIN IMMEDIATE` so writers queue instead of failing on upgrade.
    """

    def __init__(self, url: str, *, schema: str, pool_size: int = 10) -> None:
        self.url = url
        self.schema = schema
        self.sqlite = is_sqlite(url)
        self.engine: AsyncEngine = _create_engine(url, schema=schema, pool_size=pool_size)
        # Connections handed out and not yet back: `dispose` waits for them (a step finishing after
        # its caller was cancelled, a stream's last read), or they would be closed by the collector.
        self._in_use = 0
        self._all_back = asyncio.Event()
        self._all_back.set()

    @asynccontextmanager
    async def _lent(self) -> AsyncIterator[None]:
        self._in_use += 1
        self._all_back.clear()
        try:
            yield
        finally:
            self._in_use -= 1
            if not self._in_use:
                self._all_back.set()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """A connection inside a transaction that commits on success and rolls back on error."""
        async with self._lent(), self.engine.begin() as connection:
            yield connection

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection]:
        """A connection for reads; each statement runs in its own short transaction."""
        async with self._lent(), self.engine.connect() as connection:
            yield connection

    @asynccontextmanager
    async def driver_connection(self) -> AsyncIterator[Any]:
        """The driver's own connection (asyncpg's) from the pool, for a statement sent without
        SQLAlchemy. Cheaper than `connection()` (no Connection objects around it: ~40 us against
        ~110 us of CPU per use); one that failed is discarded, never handed out again, because
        straight driver calls bypass the pool's disconnect detection."""
        async with self._lent():
            pooled = await self.engine.raw_connection()
            try:
                yield pooled.driver_connection
            except Exception:
                await greenlet_spawn(pooled.invalidate)
                raise
            finally:
                # Returning it may roll back through the driver: that must run inside SQLAlchemy's greenlet.
                await greenlet_spawn(pooled.close)

    async def dispose(self, wait_seconds: float = DISPOSE_WAIT_SECONDS) -> None:
        """Close every pooled connection, once those in use are back (waiting at most `wait_seconds`)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_back.wait(), wait_seconds)
        await self.engine.dispose()


_CursorT = TypeVar("_CursorT", bound=sqlite3.Cursor)


class _SqliteConnection(sqlite3.Connection):
    """sqlite3's connection, closing its cursors and ending its transaction before it closes.

    A statement cut by a cancel leaves its cursor to the garbage collector, and closing a connection
    whose statement is not finalized only marks it closed: SQLite keeps it open, with its transaction
    (the database's writer lock) and its read snapshot (which stalls WAL checkpoints), until the
    collector finalizes that cursor. Every other writer meanwhile waits out its busy timeout and fails.
    Closing the cursors finalizes their statements and the rollback ends the transaction, whatever the
    collector does. (The driver and SQLAlchemy make every cursor through `cursor()`.)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cursors: weakref.WeakSet[sqlite3.Cursor] = weakref.WeakSet()

    @overload
    def cursor(self, factory: None = None) -> sqlite3.Cursor: ...

    @overload
    def cursor(self, factory: Callable[[sqlite3.Connection], _CursorT]) -> _CursorT: ...

    def cursor(self, factory: Callable[[sqlite3.Connection], sqlite3.Cursor] | None = None) -> sqlite3.Cursor:
        """A cursor that `close()` will close."""
        cursor = super().cursor() if factory is None else super().cursor(factory)
        self._cursors.add(cursor)
        return cursor

    def close(self) -> None:
        """Close the cursors, roll back, close (again: nothing more to do)."""
        try:
            for cursor in list(self._cursors):
                cursor.close()
            if self.in_transaction:
                self.rollback()
        except sqlite3.ProgrammingError:
            pass  # closed already
        finally:
            super().close()


def _private_sqlite_file(url: str) -> None:
    """Create the SQLite file readable by this user only, before SQLite creates it with the umask's
    mode; SQLite gives its -wal and -shm files the mode of the database file."""
    path = make_url(url).database
    if not path or path == ":memory:":
        return
    file = Path(path)
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _use_wal(cursor: Any) -> None:
    """Put the SQLite file in WAL mode (a property of the file: once one connection switched it, the
    others find it so).

    Switching takes the file's exclusive lock. A connection that asks while it reads the file and
    another connection holds the writer lock (a migration run next door, or a second process switching
    the same new file) is refused at once with "database is locked": SQLite does not wait on its busy
    timeout where waiting could deadlock. It asks again here, for as long as the busy timeout would have
    waited, without blocking the event loop.
    """
    deadline = time.monotonic() + SQLITE_BUSY_SECONDS
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() >= deadline:
                raise
        await_(asyncio.sleep(0.05))


def _create_engine(url: str, *, schema: str, pool_size: int) -> AsyncEngine:
    if is_sqlite(url):
        _private_sqlite_file(url)
        # One connection: SQLite has a single writer, and queueing in the pool is cheaper than
        # retrying on SQLITE_BUSY. Other processes (CLI jobs) wait on busy_timeout.
        engine = create_async_engine(
            url, pool_size=1, max_overflow=0, pool_timeout=60, connect_args={"factory": _SqliteConnection}
        )

        @event.listens_for(engine.sync_engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            # busy_timeout first: switching to WAL itself needs the lock another process may hold.
            cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_SECONDS * 1000)}")
            _use_wal(cursor)
            for pragma in ("foreign_keys=ON", "synchronous=NORMAL"):
                cursor.execute(f"PRAGMA {pragma}")
            cursor.close()

        @event.listens_for(engine.sync_engine, "begin")
        def _begin(connection: Any) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        # Recycling instead of a pre-ping saves a round trip per RPC; a connection broken by a
        # server restart fails one statement and is invalidated with its pool.
        pool_recycle=1800,
        connect_args={"server_settings": {"search_path": schema, "application_name": f"continuum-{schema}"}},
    )
