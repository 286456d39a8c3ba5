"""Alembic environment of the transcript service (run via `continuum migrate transcript`)."""

from continuum_runtime.migrations import run_env
from continuum_transcript.tables import metadata

run_env(metadata)
