"""Alembic runner shared by every service: own history, own version table, own schema.

A service's `migrations/env.py` calls `run_env(metadata)`; `upgrade()` runs it against a Database.
On PostgreSQL a session advisory lock keyed by the schema makes concurrent runs (two Jobs, or a
Job and a starting pod) take turns; the second finds nothing left to do. On SQLite the whole run is
one `BEGIN IMMEDIATE` transaction, which holds the file's writer lock from the version check on.
Alembic's `context` is process-global: run one upgrade at a time per process.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from alembic import command, context
from alembic.config import Config
from sqlalchemy import Connection, MetaData, text

from continuum_runtime.database import Database

VERSION_TABLE = "alembic_version"


def _config(migrations_dir: Path, schema: str, connection: Connection | None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir))
    config.attributes["connection"] = connection
    config.attributes["schema"] = schema
    return config


def _lock_key(schema: str) -> int:
    return zlib.crc32(f"continuum-migrate:{schema}".encode())


def _upgrade_locked(connection: Connection, migrations_dir: Path, schema: str, target: str) -> None:
    postgres = connection.dialect.name == "postgresql"
    if postgres:
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _lock_key(schema)})
        connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        connection.commit()
    else:
        # Begun here, so Alembic finds a transaction open and begins none of its own: its
        # per-migration transactions would free the writer lock between two migrations, and a
        # concurrent run slipping in there would migrate past the version this run planned from.
        connection.begin()
    try:
        command.upgrade(_config(migrations_dir, schema, connection), target)
        connection.commit()
    finally:
        if postgres:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _lock_key(schema)})
            connection.commit()


async def upgrade(database: Database, migrations_dir: Path, target: str = "head") -> None:
    """Bring the service's schema to `target` (idempotent; safe to run concurrently)."""
    async with database.engine.connect() as connection:
        await connection.run_sync(_upgrade_locked, migrations_dir, database.schema, target)


async def current_revision(database: Database, migrations_dir: Path) -> str | None:
    """The revision the database is at, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext

    def read(connection: Connection) -> str | None:
        return MigrationContext.configure(connection).get_current_revision()

    async with database.engine.connect() as connection:
        return await connection.run_sync(read)


def run_env(metadata: MetaData) -> None:
    """Body of a service's Alembic env.py: migrate on the connection handed in by `upgrade()`."""
    config = context.config
    connection: Any = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through `continuum migrate <service>`, not the alembic CLI")
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()
