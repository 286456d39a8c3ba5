"""The process's database handle: the driver's own connections handed out by the pool."""

from __future__ import annotations

import asyncpg
import pytest

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
