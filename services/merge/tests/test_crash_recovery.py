"""Kill -9 of the merge process at every named stage point, then a restart: exactly one target,
committed units reused, hashes verified, no claim left behind. And two merge processes on one
database: the worker is killed, the other replica takes the operation over once its lease lapses.

Merge runs as its own process (`python -m continuum_merge serve`) with the real stages and the
built-in offline provider; MERGE_CRASH_AT makes it kill itself at the named point.
"""

from __future__ import annotations

import asyncio
from asyncio.subprocess import Process
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from deadline_testing import eventually
from google.protobuf import duration_pb2
from merge_testing import OWNER, MergeClient, merge_database_url
from process_testing import serve_module
from sqlalchemy import text
from transcript_testing import SERVICE_TOKEN, TranscriptClient, all_messages, running_transcript

from continuum.merge.v1 import merge_service_pb2_grpc as api_grpc
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge import worker
from continuum_merge.snapshot import AFTER_SEAL, BEFORE_SEAL
from continuum_runtime.channels import open_channel
from continuum_runtime.database import Database

FAILPOINTS = [
    BEFORE_SEAL,
    AFTER_SEAL,
    worker.SEAL_BEFORE_RECORD,
    worker.SEAL_AFTER_RECORD,
    worker.UNIT_BEFORE_COMMIT,
    worker.UNIT_AFTER_COMMIT,
    worker.PUBLISH_BEFORE_TARGET,
    worker.PUBLISH_AFTER_TARGET,
    worker.PUBLISH_BEFORE_COMPLETE,
    worker.PUBLISH_AFTER_COMPLETE,
]


@asynccontextmanager
async def merge_process(
    tmp_path: Path, database_url: str, transcript: TranscriptClient, instance: str, crash_at: str = ""
) -> AsyncIterator[tuple[MergeClient, Process]]:
    """A merge process beside the in-process transcript; killed when the block ends if still alive."""
    data_dir = tmp_path / "merge"
    env = {
        "MERGE_DATA_DIR": str(data_dir),
        "MERGE_DATABASE_URL": merge_database_url(database_url),
        "MERGE_PORT": "0",
        "MERGE_SERVICE_TOKEN": SERVICE_TOKEN,
        "MERGE_TRANSCRIPT_ADDRESS": f"127.0.0.1:{transcript.service.port}",
        "MERGE_DISK_RESERVE_BYTES": "0",
        "MERGE_INSTANCE_ID": instance,
        "MERGE_CRASH_AT": crash_at,
        "MERGE_WORKER_POLL_SECONDS": "0.1",
        "MERGE_LEASE_TTL_SECONDS": "2",
        "MERGE_LEASE_RENEW_SECONDS": "0.5",
        "MERGE_CONSUME_SESSION_EVENTS": "false",
    }
    process, port = await serve_module("continuum_merge", "merge", data_dir, env)
    channel = open_channel(f"127.0.0.1:{port}")
    database = Database(merge_database_url(database_url), schema="merge")
    try:
        yield MergeClient(transcript, api_grpc.MergeServiceStub(channel), database), process
    finally:
        await database.dispose()
        await channel.close()
        if process.returncode is None:
            process.kill()
        await process.wait()


async def merged_sessions(transcript: TranscriptClient) -> list[tpb.Session]:
    """Every live MERGED session of the owner."""
    response = await transcript.stub.ListSessions(
        tapi.ListSessionsRequest(page_size=200), metadata=transcript.as_user(OWNER)
    )
    return [session for session in response.sessions if session.kind == tpb.SESSION_KIND_MERGED]


async def completed(stack: MergeClient, operation_id: str) -> pb.MergeOperation:
    async def done() -> bool:
        return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_COMPLETED

    await eventually(done, what="the merge completed", seconds=60)
    return await stack.get(operation_id)


async def unit_attempts(database: Database) -> dict[str, list[str]]:
    async with database.connection() as connection:
        rows = await connection.execute(
            text("SELECT unit_id, outcome FROM session_merge_attempts ORDER BY unit_id, start_ms")
        )
        found: dict[str, list[str]] = {}
        for unit_id, outcome in rows:
            found.setdefault(unit_id, []).append(outcome)
    return found


@pytest.mark.parametrize("failpoint", FAILPOINTS)
async def test_a_kill_at_any_point_then_a_restart_publishes_exactly_one_target(
    tmp_path: Path, database_url: str, failpoint: str
) -> None:
    async with running_transcript(tmp_path, database_url) as transcript:
        async with merge_process(tmp_path, database_url, transcript, "replica-1", crash_at=failpoint) as (
            first,
            process,
        ):
            for session_id in ("a", "b"):
                await first.new_session(session_id, texts=3)
            operation_id = (await first.start(["a", "b"])).operation.progress.operation_id
            exit_code = await asyncio.wait_for(process.wait(), 60)
            before = await unit_attempts(first.database)
        assert exit_code == -9

        # The same replica restarts (same instance id): it takes its operation back at once.
        async with merge_process(tmp_path, database_url, transcript, "replica-1") as (restarted, _):
            done = await completed(restarted, operation_id)
            after = await unit_attempts(restarted.database)

        targets = await merged_sessions(transcript)
        assert [target.session_id for target in targets] == [done.progress.target_session_id]
        assert len(await all_messages(transcript.stub, transcript.as_user(OWNER), targets[0].session_id)) == 1
        # A unit committed before the kill was reused, not run again.
        committed = [unit for unit, outcomes in before.items() if outcomes == ["completed"]]
        if failpoint == worker.UNIT_AFTER_COMMIT:
            assert committed
        for unit in committed:
            assert after[unit] == ["completed"] or failpoint == worker.UNIT_BEFORE_COMMIT
        # No claim is left behind: a turn can start in every source.
        for session_id in ("a", "b"):
            await transcript.stub.AcquireClaims(
                tapi.AcquireClaimsRequest(
                    session_ids=[session_id],
                    kind=tpb.CLAIM_KIND_RUN,
                    holder="run",
                    ttl=duration_pb2.Duration(seconds=30),
                ),
                metadata=transcript.as_user(OWNER),
            )


@pytest.mark.postgres
async def test_another_replica_takes_over_once_the_killed_workers_lease_lapses(
    tmp_path: Path, postgres_url: str
) -> None:
    async with running_transcript(tmp_path, postgres_url) as transcript:
        async with merge_process(
            tmp_path, postgres_url, transcript, "replica-1", crash_at=worker.UNIT_AFTER_COMMIT
        ) as (first, process):
            for session_id in ("a", "b"):
                await first.new_session(session_id, texts=3)
            operation_id = (await first.start(["a", "b"])).operation.progress.operation_id
            assert await asyncio.wait_for(process.wait(), 60) == -9

        async with merge_process(tmp_path, postgres_url, transcript, "replica-2") as (second, _):
            done = await completed(second, operation_id)
            async with second.database.connection() as connection:
                owners = (await connection.execute(text("SELECT lease_owner FROM session_merges"))).scalars().all()

        assert owners == [None]
        assert [target.session_id for target in await merged_sessions(transcript)] == [done.progress.target_session_id]
