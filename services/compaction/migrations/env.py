"""Alembic environment of the compaction service (run via `continuum migrate compaction`)."""

from continuum_compaction.tables import metadata
from continuum_runtime.migrations import run_env

run_env(metadata)
