"""`continuum migrate transcript` as a Kubernetes Job runs it: configured by env vars only, rerunnable."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

CONTINUUM = Path(sys.executable).parent / "continuum"


def test_migrate_transcript_creates_the_schema_and_can_run_again(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("TRANSCRIPT_", "GATEWAY_"))}
    env["TRANSCRIPT_DATA_DIR"] = str(tmp_path)

    # Twice: a Job is retried, and a second run against an up-to-date schema must succeed too.
    for _ in range(2):
        result = subprocess.run(
            [str(CONTINUUM), "migrate", "transcript"], env=env, capture_output=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stderr.decode(errors="replace")

    with contextlib.closing(sqlite3.connect(tmp_path / "transcript.db")) as database:
        tables = {row[0] for row in database.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"alembic_version", "sessions", "messages"} <= tables
