"""Alembic environment of the merge service (run via `continuum migrate merge`)."""

from continuum_merge.tables import metadata
from continuum_runtime.migrations import run_env

run_env(metadata)
