"""Transcript's migrations: own schema and version table, idempotent, safe to run concurrently
(as separate processes, like two Kubernetes Jobs), and matching the tables the code uses."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, event, inspect, text

from continuum_runtime import migrations
from continuum_runtime.database import Database
from continuum_transcript import persistence
from continuum_transcript.server import MIGRATIONS_DIR
from continuum_transcript.tables import metadata

# The block size migration 0006 gives the message id sequence.
BLOCK = 8192


async def _migrate_in_subprocess(database_url: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "continuum_transcript",
        "migrate",
        env={**os.environ, "TRANSCRIPT_DATABASE_URL": database_url},
        stderr=asyncio.subprocess.PIPE,
    )
    _, errors = await process.communicate()
    return process.returncode or 0, errors.decode()[-2000:]


async def test_concurrent_runs_all_succeed_and_match_the_code(database_url: str) -> None:
    results = await asyncio.gather(*[_migrate_in_subprocess(database_url) for _ in range(3)])
    assert [code for code, _ in results] == [0, 0, 0], [log for code, log in results if code]
    database = Database(database_url, schema="transcript")
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR)
        assert await migrations.current_revision(database, MIGRATIONS_DIR) == "0006"

        def differences(connection: Connection) -> list[object]:
            return list(compare_metadata(MigrationContext.configure(connection), metadata))

        async with database.connection() as connection:
            assert await connection.run_sync(differences) == []
            tables = await connection.run_sync(lambda c: set(inspect(c).get_table_names()))
            assert {"sessions", "messages", "execution_claims", "session_events", "alembic_version"} <= tables
            if database.engine.dialect.name == "postgresql":
                schema = await connection.execute(
                    text("SELECT table_schema FROM information_schema.tables WHERE table_name = 'alembic_version'")
                )
                assert list(schema.scalars()) == ["transcript"]
    finally:
        await database.dispose()


async def test_message_sizes_previews_and_flags_are_backfilled(database_url: str) -> None:
    database = Database(database_url, schema="transcript")
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR, target="0004")
        huge = "word " * 100_000  # 500 kB: read on its own by the backfill
        rows = [
            (1, '[{"text": "hello there"}]', "[]", "{}"),
            (2, json.dumps([{"text": huge}]), "[]", "{}"),
            (3, '[{"text": "{\\"truncated\\": true}"}]', "[]", '{"resultTruncated": true}'),
            (4, "[]", json.dumps([{"tool_call_id": "c", "name": "w", "arguments": "a" * 9000}]), "{}"),
        ]
        async with database.transaction() as connection:
            for message_id, content, calls, metadata_json in rows:
                await connection.execute(
                    text(
                        "INSERT INTO messages (message_id, session_id, role, content, tool_calls, tool_call_id,"
                        " metadata, status, deleted, create_ms, commit_seq)"
                        " VALUES (:id, 's', 3, :content, :calls, '', :metadata, 1, false, 0, 0)"
                    ),
                    {"id": message_id, "content": content, "calls": calls, "metadata": metadata_json},
                )
        await migrations.upgrade(database, MIGRATIONS_DIR)
        async with database.connection() as connection:
            found = (
                await connection.execute(
                    text("SELECT message_id, body_bytes, preview, result_truncated FROM messages ORDER BY message_id")
                )
            ).all()
    finally:
        await database.dispose()
    assert [(row[0], row[1]) for row in found] == [(1, 11), (2, len(huge)), (3, 19 + 25), (4, 9000)]
    assert [row[2] for row in found][0::2] == ["", ""]
    assert found[1][2].startswith("word word") and len(found[1][2]) <= 200
    assert found[3][2] == "", "tool call arguments are no text to preview"
    assert [bool(row[3]) for row in found] == [False, False, True, False]


def _downgrade_to(connection: Connection, target: str) -> None:
    command.downgrade(migrations._config(MIGRATIONS_DIR, "transcript", connection), target)
    connection.commit()


async def test_ids_reserved_before_after_and_past_the_block_migration_never_repeat(database_url: str) -> None:
    """Reservations at 0005 (the sequence counting by one), at head (by blocks), and after a downgrade
    (by one again, as the code before would reserve): every id follows the stored ones, none repeats."""
    database = Database(database_url, schema="transcript")
    try:
        await migrations.upgrade(database, MIGRATIONS_DIR, target="0005")
        async with database.transaction() as connection:
            await connection.execute(
                text(
                    "INSERT INTO messages (message_id, session_id, role, content, tool_calls, tool_call_id,"
                    " metadata, status, deleted, create_ms, commit_seq)"
                    " VALUES (5000, 's', 1, '[]', '[]', '', '{}', 1, false, 0, 0)"
                )
            )
            if not database.sqlite:
                # Ids up to 5000 were handed out one at a time before the migration.
                await connection.execute(text("SELECT setval(pg_get_serial_sequence('messages', 'message_id'), 5000)"))
        before = await persistence.reserve_ids(database, 3)
        await migrations.upgrade(database, MIGRATIONS_DIR)
        reserved = [before, *await asyncio.gather(*[persistence.reserve_ids(database, n) for n in (3, BLOCK + 2)])]
        # Last before the downgrade: a whole block, as a publisher reserves it.
        reserved.append(await persistence.reserve_ids(database, BLOCK))
        if not database.sqlite:
            async with database.engine.connect() as connection:
                await connection.run_sync(_downgrade_to, "0005")
            reserved.append(await persistence.reserve_ids(database, 2))
    finally:
        await database.dispose()
    ids = [list(itertools.chain.from_iterable(blocks)) for blocks in reserved]
    assert [len(each) for each in ids] == [3, 3, BLOCK + 2, BLOCK, 2][: len(ids)]
    assert all(each == sorted(each) and each[0] > 5000 for each in ids)
    every = list(itertools.chain.from_iterable(ids))
    assert len(set(every)) == len(every), "two reservations share an id"
    if not database.sqlite:  # downgraded above
        assert ids[-1][0] > max(every[:-2]), "after the downgrade, ids started over inside a reserved block"


def test_on_sqlite_no_run_lets_another_in_before_it_is_done(tmp_path: Path) -> None:
    """The worst interleaving of concurrent runs, forced: wherever a run would begin a further
    transaction after its first (and so let another process take SQLite's writer lock between two of
    its migrations), a whole other `migrate` process runs first. That other run must not start from
    a version this run already planned past; both succeed and the schema is the code's."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'transcript.db'}"
    database = Database(url, schema="transcript")
    interleaved: list[tuple[int, str]] = []
    begins = 0

    # Right before each BEGIN IMMEDIATE of this run, when SQLite's writer lock is free for anyone.
    @event.listens_for(database.engine.sync_engine, "before_cursor_execute")
    def _another_run_slips_in(_connection: Any, _cursor: Any, statement: str, *_: Any) -> None:
        nonlocal begins
        if statement != "BEGIN IMMEDIATE":
            return
        begins += 1
        if begins > 1:
            other = subprocess.run(
                [sys.executable, "-m", "continuum_transcript", "migrate"],
                env={**os.environ, "TRANSCRIPT_DATABASE_URL": url},
                capture_output=True,
                timeout=60,
                check=False,
            )
            interleaved.append((other.returncode, other.stderr.decode()[-2000:]))

    async def upgrade_and_check() -> None:
        try:
            await migrations.upgrade(database, MIGRATIONS_DIR)
            event.remove(database.engine.sync_engine, "before_cursor_execute", _another_run_slips_in)
            assert await migrations.current_revision(database, MIGRATIONS_DIR) == "0006"
            async with database.connection() as connection:
                assert await connection.run_sync(_differences) == []
        finally:
            await database.dispose()

    asyncio.run(upgrade_and_check())
    assert [code for code, _ in interleaved] == [0] * len(interleaved), interleaved


def _differences(connection: Connection) -> list[object]:
    return list(compare_metadata(MigrationContext.configure(connection), metadata))
