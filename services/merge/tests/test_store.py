"""Merge's schema and its conditional writes, on SQLite and PostgreSQL: the migration matches the
tables, the constraints hold, and each CAS lets exactly one writer through."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from merge_testing import EXECUTION, NOW, PARAMETERS, admitted
from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from continuum_merge import store
from continuum_merge.server import MIGRATIONS_DIR
from continuum_merge.store import Fence, NewUnit
from continuum_merge.tables import metadata
from continuum_runtime import migrations
from continuum_runtime.database import Database

TTL = 10_000


@pytest.fixture
async def database(database_url: str) -> AsyncIterator[Database]:
    migrated = Database(database_url, schema="merge")
    await migrations.upgrade(migrated, MIGRATIONS_DIR)
    yield migrated
    await migrated.dispose()


async def load(database: Database, operation_id: str = "op1") -> store.Operation:
    async with database.connection() as connection:
        operation = await store.load(connection, operation_id)
    assert operation is not None
    return operation


async def current(connection: AsyncConnection) -> store.Operation:
    operation = await store.load(connection, "op1")
    assert operation is not None
    return operation


async def test_migrating_concurrently_ends_at_the_tables_the_code_uses(database_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "MERGE_DATABASE_URL": database_url, "MERGE_DATA_DIR": str(tmp_path / "merge")}

    async def migrate() -> int:
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "continuum_merge", "migrate", env=env)
        return await process.wait()

    assert list(await asyncio.gather(migrate(), migrate())) == [0, 0]
    database = Database(database_url, schema="merge")
    try:
        assert await migrations.current_revision(database, MIGRATIONS_DIR) == "0003"

        def differences(connection: Connection) -> list[object]:
            return list(compare_metadata(MigrationContext.configure(connection), metadata))

        async with database.connection() as connection:
            assert await connection.run_sync(differences) == []
    finally:
        await database.dispose()


async def test_an_operation_is_no_workers_while_its_start_admits_it(database: Database) -> None:
    async with database.transaction() as connection:
        assert await store.insert_operation(
            connection,
            operation_id="op1",
            owner="alice",
            idempotency_key="k",
            parameters=PARAMETERS,
            target_session_id="target-op1",
            execution=EXECUTION,
            now_ms=NOW,
            admission_expire_ms=NOW + 5_000,
        )
    async with database.connection() as connection:
        operation = await store.load(connection, "op1")
        assert operation is not None and operation.lease_owner == store.ADMISSION_LEASE_OWNER
        assert await store.claimable(connection, "w1", NOW + 4_999, 10) == []
        # A start that crashed: once its lease ran out, a worker takes the operation and admits it.
        assert [found.operation_id for found in await store.claimable(connection, "w1", NOW + 5_000, 10)] == ["op1"]
    async with database.transaction() as connection:
        assert await store.take_lease(connection, operation, "w1", NOW + 1, 10_000) is None
        assert await store.record_claim(
            connection, "op1", store.FIRST_EPOCH, "c1", ["a"], NOW + 60_000, "[]", NOW + 2, admitted=True
        )
    async with database.connection() as connection:
        (recorded,) = await store.claimable(connection, "w1", NOW + 3, 10)
    assert recorded.lease_owner is None and recorded.claim_id == "c1"


async def test_the_active_slot_is_one_per_user_and_only_while_unfinished(database: Database) -> None:
    await admitted(database)
    async with database.transaction() as connection:
        taken = await store.insert_operation(
            connection,
            operation_id="op2",
            owner="alice",
            idempotency_key="k2",
            parameters=PARAMETERS,
            target_session_id="target-op2",
            execution=EXECUTION,
            now_ms=NOW,
            admission_expire_ms=NOW + 10_000,
        )
    assert not taken
    await admitted(database, owner="bob", operation_id="op3")
    # A preparing operation without its slot, or a cancelled one keeping it, is refused by the schema.
    for statement in (
        "UPDATE session_merges SET active_slot = NULL WHERE operation_id = 'op1'",
        "UPDATE session_merges SET status = 'cancelled' WHERE operation_id = 'op1'",
        "UPDATE session_merges SET status = 'completed', active_slot = NULL WHERE operation_id = 'op1'",
    ):
        with pytest.raises(IntegrityError):
            async with database.transaction() as connection:
                await connection.execute(text(statement))
    async with database.transaction() as connection:
        assert await store.cancel(connection, "op1", "alice", NOW)
        assert not await store.cancel(connection, "op1", "alice", NOW)
    await admitted(database, key="k2", operation_id="op2")


async def test_a_lapsed_lease_is_taken_over_and_fences_the_old_run_out(database: Database) -> None:
    await admitted(database)
    operation = await load(database)
    async with database.transaction() as connection:
        first = await store.take_lease(connection, operation, "replica-1", NOW, TTL)
    assert first == Fence("op1", 2, "replica-1")
    async with database.transaction() as connection:
        # Seen at epoch 1: stale. Seen again at epoch 2: the lease is live.
        assert await store.take_lease(connection, operation, "replica-2", NOW + 1, TTL) is None
        assert await store.take_lease(connection, await current(connection), "replica-2", NOW + 1, TTL) is None
        assert await store.claimable(connection, "replica-2", NOW + 1, 10) == []
        assert await store.renew_lease(connection, first, NOW + 5_000, TTL)
    later = NOW + 5_000 + TTL
    async with database.transaction() as connection:
        (candidate,) = await store.claimable(connection, "replica-2", later, 10)
        second = await store.take_lease(connection, candidate, "replica-2", later, TTL)
    assert second == Fence("op1", 3, "replica-2")
    async with database.transaction() as connection:
        assert not await store.renew_lease(connection, first, later, TTL)
        assert not await store.advance(connection, first, later, stage="extracting")
        assert await store.advance(connection, second, later, stage="extracting")
        # A replica that restarts under its stable name takes its own operation back at once.
        (mine,) = await store.claimable(connection, "replica-2", later + 1, 10)
        assert mine.lease_owner == "replica-2"
        assert await store.release_lease(connection, second, later)
    assert (await load(database)).lease_owner is None


async def test_the_unit_commit_protocol(database: Database) -> None:
    await admitted(database)
    async with database.transaction() as connection:
        fence = await store.take_lease(connection, await current(connection), "w", NOW, TTL)
    assert fence is not None
    unit = NewUnit("u1", "extracting", 0, "0" * 64, "{}", "p1", "model")
    async with database.transaction() as connection:
        assert await store.insert_units(connection, fence, [unit], NOW)
        assert await store.insert_units(connection, fence, [unit], NOW)  # planning again adds nothing
        assert await store.start_unit(connection, fence, "u1", "req-1", "model", NOW)
        assert not await store.start_unit(connection, fence, "u1", "req-2", "model", NOW)
        assert await store.finish_attempt(connection, "req-1", "completed", 10, None, NOW)
        assert not await store.finish_attempt(connection, "req-1", "error", 1, 1, NOW)
    # A resume supersedes the run: its commit matches nothing, and the next run resets the unit.
    async with database.transaction() as connection:
        assert await store.pause(connection, fence, "DISK_RESERVE", "low", NOW, failed=False)
        assert await store.resume(connection, "op1", "alice", fence.run_epoch, None, NOW)
        assert not await store.complete_unit(connection, fence, "u1", "work/u1.json", "1" * 64, NOW)
        newer = await store.take_lease(connection, await current(connection), "w", NOW, TTL)
        assert newer is not None
        assert await store.reset_running_units(connection, newer, NOW) == 1
        assert await store.start_unit(connection, newer, "u1", "req-3", "model", NOW)
        assert await store.complete_unit(connection, newer, "u1", "work/u1.json", "1" * 64, NOW)
        counts = await store.unit_counts(connection, "op1")
        attempts = (await connection.execute(text("SELECT count(*) FROM session_merge_attempts"))).scalar_one()
    assert (counts.completed, counts.known, attempts) == (1, 1, 2)
    with pytest.raises(IntegrityError):
        async with database.transaction() as connection:
            await connection.execute(text("UPDATE session_merge_units SET result_path = NULL"))


async def test_load_many_answers_the_operations_among_the_ids_in_id_order(database: Database) -> None:
    for number in (3, 1, 2):
        await admitted(database, owner=f"user{number}", operation_id=f"op{number}")
    async with database.connection() as connection:
        found = await store.load_many(connection, ["op2", "stray-directory", "op3", "op1"])
        assert [operation.operation_id for operation in found] == ["op1", "op2", "op3"]
        assert await store.load_many(connection, ["nothing-here"]) == []
