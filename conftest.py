"""Test infrastructure shared by every suite: where PostgreSQL is, and a fresh database per test.

PostgreSQL is found in this order: TEST_DATABASE_URL; a testcontainers PostgreSQL when a Docker
engine answers; the local server on 127.0.0.1:5432. Without one, PostgreSQL tests skip loudly —
or fail, when CONTINUUM_REQUIRE_POSTGRES=1 (CI sets it, so skipped PostgreSQL tests can't pass).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

LOCAL_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def _reachable(url: str) -> bool:
    async def probe() -> bool:
        try:
            connection = await asyncpg.connect(url, timeout=3)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return False
        await connection.close()
        return True

    return asyncio.run(probe())


def _docker_postgres() -> tuple[str, object] | None:
    if not Path("/var/run/docker.sock").exists():
        return None
    try:
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:15", driver=None).start()
    except Exception:
        return None
    return container.get_connection_url(), container


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str | None]:
    """A libpq URL of a server where tests may create databases, or None when there is none."""
    configured = os.environ.get("TEST_DATABASE_URL")
    if configured:
        yield configured.replace("postgresql+asyncpg://", "postgresql://")
        return
    started = _docker_postgres()
    if started is not None:
        url, container = started
        yield url
        container.stop()  # type: ignore[attr-defined]
        return
    yield LOCAL_SERVER if _reachable(LOCAL_SERVER) else None


def _require_postgres(admin_url: str | None) -> str:
    if admin_url is not None:
        return admin_url
    message = "PostgreSQL is not available (set TEST_DATABASE_URL or start the local server)"
    if os.environ.get("CONTINUUM_REQUIRE_POSTGRES") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
async def postgres_url(postgres_admin_url: str | None) -> AsyncIterator[str]:
    """An empty database of its own for one test, as a SQLAlchemy asyncpg URL; dropped after."""
    admin_url = _require_postgres(postgres_admin_url)
    name = f"continuum_test_{uuid.uuid4().hex[:12]}"
    await _admin_execute(admin_url, f'CREATE DATABASE "{name}"')
    base, _, _ = admin_url.rpartition("/")
    yield f"{base.replace('postgresql://', 'postgresql+asyncpg://', 1)}/{name}"
    await _admin_execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _admin_execute(admin_url: str, statement: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(statement)
    finally:
        await admin.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs twice: on the embedded SQLite file and on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'test.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url
