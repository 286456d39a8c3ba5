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
# How long a driver connection kept between uses may sit idle before it goes back to the pool.
KEPT_IDLE_SECONDS = 60.0
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
        # Driver connections kept between uses (see `driver_connection`): at most half the pool, so
        # SQLAlchemy's own users always find connections (with the overflow, the pool opens twice
        # `pool_size`).
        self._kept: list[tuple[Any, float]] = []
        self._keep_at_most = 0 if self.sqlite else pool_size // 2
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
        """The driver's own connection (asyncpg's), for single autocommitted statements sent without
        SQLAlchemy (the append path's flush). Cheaper than `connection()`: no Connection objects
        around it.

        A connection comes from the pool the first time and is then kept for the next use, up to
        half the pool: a checkout and return through SQLAlchemy's pool costs two greenlet switches
        and ~0.1 ms of CPU, a tenth of an append. One left inside a transaction is closed (the pool's
        reset would not end it). One that failed is discarded, never handed out again, because straight
        driver calls bypass the pool's disconnect detection; when it lost its server, the kept ones
        are discarded too, since they most likely lost theirs (a restart), and each would fail one
        statement otherwise."""
        async with self._lent():
            pooled = await self._take_driver_connection()
            driver = pooled.driver_connection
            try:
                yield driver
            except Exception as error:
                await greenlet_spawn(pooled.invalidate)
                if _connection_failed(error):
                    await self._discard_kept(invalidate=True)
                raise
            except BaseException:
                # Cancelled: back to the pool, which resets it.
                await greenlet_spawn(pooled.close)
                raise
            if driver.is_in_transaction():
                # SQLAlchemy's reset on return rolls back only transactions it began itself.
                await greenlet_spawn(pooled.invalidate)
            elif len(self._kept) < self._keep_at_most:
                self._kept.append((pooled, time.monotonic()))
            else:
                # Returning it goes through the pool's reset: that must run inside SQLAlchemy's greenlet.
                await greenlet_spawn(pooled.close)

    async def _take_driver_connection(self) -> Any:
        """The most recently kept connection, or one from the pool. Those kept idle too long go back
        to the pool first (the oldest are first in the list), so its recycling still applies."""
        while self._kept and time.monotonic() - self._kept[0][1] >= KEPT_IDLE_SECONDS:
            pooled, _ = self._kept.pop(0)
            await greenlet_spawn(pooled.close)
        if self._kept:
            return self._kept.pop()[0]
        return await self.engine.raw_connection()

    async def _discard_kept(self, *, invalidate: bool) -> None:
        kept, self._kept = self._kept, []
        for pooled, _ in kept:
            await greenlet_spawn(pooled.invalidate if invalidate else pooled.close)

    async def dispose(self, wait_seconds: float = DISPOSE_WAIT_SECONDS) -> None:
        """Close every pooled connection, once those in use are back (waiting at most `wait_seconds`)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_back.wait(), wait_seconds)
        await self._discard_kept(invalidate=False)
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


def _connection_failed(error: Exception) -> bool:
    """Whether `error` is the connection's failure rather than its statement's: anything but an error
    the server reported, or one of its connection (08) or shutdown (57) errors."""
    sqlstate = getattr(error, "sqlstate", None)
    return not isinstance(sqlstate, str) or sqlstate[:2] in ("08", "57")


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
