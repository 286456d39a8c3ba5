"""`continuum migrate <service>` as a Kubernetes Job and `continuum cleanup compaction` as a CronJob run
them: configured by env vars only, rerunnable."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from deadline_testing import wait_for

from continuum.transcript.v1 import transcript_service_pb2, transcript_service_pb2_grpc
from continuum_runtime.auth import call_metadata

pytestmark = pytest.mark.e2e

CONTINUUM = Path(sys.executable).parent / "continuum"
SERVICE_TOKEN = "e2e-service-token"
PREFIXES = ("TRANSCRIPT_", "COMPACTION_", "GATEWAY_")


def _clean_env(**values: str) -> dict[str, str]:
    """An operator's shell, minus any service configuration a developer may have exported."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(PREFIXES)}
    env.update(values)
    return env


def _continuum(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([str(CONTINUUM), *argv], env=env, capture_output=True, timeout=60, check=False)


def _tables(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as database:
        return {row[0] for row in database.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.mark.parametrize(
    ("service", "tables"),
    [
        ("transcript", {"alembic_version", "sessions", "messages"}),
        ("compaction", {"alembic_version", "session_compactions", "compaction_events", "compaction_signals"}),
        ("merge", {"alembic_version", "session_merges", "session_merge_units", "session_merge_attempts"}),
    ],
)
def test_migrate_creates_the_schema_and_can_run_again(service: str, tables: set[str], tmp_path: Path) -> None:
    env = _clean_env(**{f"{service.upper()}_DATA_DIR": str(tmp_path)})

    # Twice: a Job is retried, and a second run against an up-to-date schema must succeed too.
    for _ in range(2):
        result = _continuum("migrate", service, env=env)
        assert result.returncode == 0, result.stderr.decode(errors="replace")

    assert tables <= _tables(tmp_path / f"{service}.db")


@pytest.fixture
def transcript_port(tmp_path: Path) -> Iterator[int]:
    """`python -m continuum_transcript serve` on a free port, stopped after the test."""
    data_dir = tmp_path / "transcript"
    env = _clean_env(TRANSCRIPT_DATA_DIR=str(data_dir), TRANSCRIPT_PORT="0", TRANSCRIPT_SERVICE_TOKEN=SERVICE_TOKEN)
    process = subprocess.Popen(
        [sys.executable, "-m", "continuum_transcript", "serve"], env=env, stderr=subprocess.DEVNULL
    )
    port_file = data_dir / "run" / "transcript.port"
    try:
        wait_for(lambda: port_file.exists() or process.poll() is not None, what="transcript to start", seconds=60)
        assert process.poll() is None, "transcript exited at start"
        yield int(port_file.read_text())
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_cleanup_compaction_forgets_sessions_transcript_deleted(transcript_port: int, tmp_path: Path) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{transcript_port}") as channel:
        stub = transcript_service_pb2_grpc.TranscriptServiceStub(channel)
        metadata = call_metadata(SERVICE_TOKEN, "alice")
        for session_id in ("gone", "kept"):
            stub.CreateSession(transcript_service_pb2.CreateSessionRequest(session_id=session_id), metadata=metadata)
        stub.DeleteSession(transcript_service_pb2.DeleteSessionRequest(session_id="gone"), metadata=metadata)
    data_dir = tmp_path / "compaction"
    env = _clean_env(
        COMPACTION_DATA_DIR=str(data_dir),
        COMPACTION_TRANSCRIPT_ADDRESS=f"127.0.0.1:{transcript_port}",
        COMPACTION_SERVICE_TOKEN=SERVICE_TOKEN,
    )
    migrated = _continuum("migrate", "compaction", env=env)
    assert migrated.returncode == 0, migrated.stderr.decode(errors="replace")
    # Records the event consumer would have removed, had it been running when "gone" was deleted.
    with contextlib.closing(sqlite3.connect(data_dir / "compaction.db")) as database, database:
        database.executemany(
            "INSERT INTO session_compactions (session_id, summary_text, last_compacted_msg_id, compact_count,"
            " input_tokens, output_tokens, compact_model, create_ms, update_ms)"
            " VALUES (?, 'summary', 7, 1, 0, 0, 'offline-extractive-1', 0, 0)",
            [("gone",), ("kept",)],
        )

    # Twice: a CronJob run is repeated, and the second finds nothing left to remove.
    outputs = []
    for _ in range(2):
        result = _continuum("cleanup", "compaction", env=env)
        assert result.returncode == 0, result.stderr.decode(errors="replace")
        outputs.append(result.stdout.decode())

    assert outputs == [
        "checked 1 deleted-session event(s); removed 1 compaction row(s)\n",
        "checked 1 deleted-session event(s); removed 0 compaction row(s)\n",
    ]
    with contextlib.closing(sqlite3.connect(data_dir / "compaction.db")) as database:
        assert [row[0] for row in database.execute("SELECT session_id FROM session_compactions")] == ["kept"]


def test_cleanup_with_transcript_unreachable_fails(tmp_path: Path) -> None:
    env = _clean_env(
        COMPACTION_DATA_DIR=str(tmp_path),
        COMPACTION_TRANSCRIPT_ADDRESS="127.0.0.1:1",
        COMPACTION_SERVICE_TOKEN=SERVICE_TOKEN,
        COMPACTION_TRANSCRIPT_TIMEOUT_SECONDS="5",
    )
    assert _continuum("migrate", "compaction", env=env).returncode == 0

    result = _continuum("cleanup", "compaction", env=env)

    # A failed CronJob run: nonzero, nothing reported as done, the cause named.
    assert result.returncode == 1
    assert result.stdout == b""
    assert b"UNAVAILABLE" in result.stderr
