"""kill -9 of the merge process at every named failpoint, then a restart: the operation completes with
exactly one target, completed units are reused, the package's hashes verify and no claim is left behind.
The same while the HTTP model provider on loopback is failing: the restart completes once it recovers.
And two merge processes on one PostgreSQL: the one working is killed, the other finishes."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from deadline_testing import eventually
from google.protobuf import duration_pb2
from merge_testing import OWNER
from model_server_testing import MODEL, FakeModelServer, Reply, completion
from stages_testing import (
    MergeProcess,
    attempts,
    merge_process,
    merged_sessions,
    metadata,
    process_settings,
    two_sources,
)
from transcript_testing import TranscriptClient, append, running_transcript, user

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge import store
from continuum_merge.extraction import verify_handoff
from continuum_merge.settings import MergeSettings
from continuum_merge.snapshot import AFTER_SEAL, BEFORE_SEAL, verify_snapshot
from continuum_merge.worker import (
    PUBLISH_AFTER_COMPLETE,
    PUBLISH_AFTER_TARGET,
    PUBLISH_BEFORE_COMPLETE,
    PUBLISH_BEFORE_TARGET,
    SEAL_AFTER_RECORD,
    SEAL_BEFORE_RECORD,
    UNIT_AFTER_COMMIT,
    UNIT_BEFORE_COMMIT,
)
from continuum_runtime.database import Database

FAILPOINTS = (
    BEFORE_SEAL,
    AFTER_SEAL,
    SEAL_BEFORE_RECORD,
    SEAL_AFTER_RECORD,
    UNIT_BEFORE_COMMIT,
    UNIT_AFTER_COMMIT,
    PUBLISH_BEFORE_TARGET,
    PUBLISH_AFTER_TARGET,
    PUBLISH_BEFORE_COMPLETE,
    PUBLISH_AFTER_COMPLETE,
)


@pytest.fixture
async def transcript(tmp_path: Path, database_url: str) -> AsyncIterator[TranscriptClient]:
    async with running_transcript(tmp_path, database_url) as client:
        await two_sources(client)
        yield client


@pytest.fixture
async def settings(tmp_path: Path, database_url: str, transcript: TranscriptClient) -> MergeSettings:
    return process_settings(tmp_path, database_url, transcript)


@pytest.fixture
async def database(settings: MergeSettings) -> AsyncIterator[Database]:
    opened = Database(settings.resolved_database_url("merge"), schema="merge")
    yield opened
    await opened.dispose()


async def recovered(
    transcript: TranscriptClient, settings: MergeSettings, database: Database, merge: MergeProcess, operation_id: str
) -> tuple[int, Counter[str]]:
    """Check a completed operation after recovery; its unit count and attempts by outcome."""
    operation = await merge.completed(operation_id)
    targets = await merged_sessions(transcript)
    assert [target.session_id for target in targets] == [operation.progress.target_session_id]
    assert targets[0].metadata.fields["sessionMergeOperationId"].string_value == operation_id
    entry = await transcript.stub.ListMessagesAfter(
        tapi.ListMessagesAfterRequest(session_id=targets[0].session_id), metadata=metadata()
    )
    assert len(entry.messages) == 1, "the handoff entry message was written more than once"
    async with database.connection() as connection:
        stored = await store.load(connection, operation_id)
    assert stored is not None and stored.claim_id is None and stored.active_slot is None
    package = settings.resolved_package_root() / operation_id
    assert verify_snapshot(package).snapshot_hash == stored.snapshot_hash
    assert verify_handoff(package).handoff_hash == stored.handoff_hash
    assert not (package / "staging").exists()
    # No claim is left: the sources take a turn's claim and new messages.
    for source in ("a", "b"):
        await transcript.stub.AcquireClaims(
            tapi.AcquireClaimsRequest(
                session_ids=[source], kind=tpb.CLAIM_KIND_RUN, holder="run-after", ttl=duration_pb2.Duration(seconds=30)
            ),
            metadata=metadata(OWNER),
        )
        await append(transcript, source, user(f"{source}: after recovery"))
    return await attempts(database, operation_id)


@pytest.mark.parametrize("failpoint", FAILPOINTS)
async def test_kill_9_at_a_failpoint_then_restart_completes_once(
    transcript: TranscriptClient, settings: MergeSettings, database: Database, failpoint: str
) -> None:
    async with merge_process(settings, MERGE_CRASH_AT=failpoint, MERGE_INSTANCE_ID="m1") as doomed:
        operation_id = await doomed.start(["a", "b"])
        assert await doomed.crashed(operation_id) == -signal.SIGKILL

    async with merge_process(settings, MERGE_INSTANCE_ID="m1") as restarted:
        units, outcomes = await recovered(transcript, settings, database, restarted, operation_id)
    # Every unit's model call ran once; a result computed but not committed is computed once more.
    again = 1 if failpoint == UNIT_BEFORE_COMMIT else 0
    assert units > 1 and outcomes == Counter({"completed": units + again})
    # A seal written before the crash is verified and recorded as it is; only an unsealed copy is redone.
    async with database.connection() as connection:
        stored = await store.load(connection, operation_id)
    assert stored is not None and stored.snapshot_version == (2 if failpoint == BEFORE_SEAL else 1)


async def test_a_sealed_package_damaged_while_the_process_was_down_pauses_and_is_never_rebuilt(
    transcript: TranscriptClient, settings: MergeSettings, database: Database
) -> None:
    async with merge_process(settings, MERGE_CRASH_AT=UNIT_AFTER_COMMIT, MERGE_INSTANCE_ID="m1") as doomed:
        operation_id = await doomed.start(["a", "b"])
        assert await doomed.crashed(operation_id) == -signal.SIGKILL
    raw = next((settings.resolved_package_root() / operation_id / "snapshot" / "raw").iterdir())
    raw.write_bytes(raw.read_bytes() + b" ")

    async with merge_process(settings, MERGE_INSTANCE_ID="m1") as restarted:

        async def paused() -> bool:
            return (await restarted.get(operation_id)).progress.status == pb.MERGE_STATUS_PAUSED

        await eventually(paused, what="the merge to pause", seconds=60)
        progress = (await restarted.get(operation_id)).progress
    assert progress.error_code == error_code_pb2.PACKAGE_DAMAGED and progress.snapshot_sealed
    async with database.connection() as connection:
        stored = await store.load(connection, operation_id)
    assert stored is not None and stored.snapshot_version == 1 and stored.claim_id is None
    assert not await merged_sessions(transcript)


async def test_two_processes_on_postgres_the_other_finishes_after_the_worker_is_killed(
    tmp_path: Path, postgres_url: str
) -> None:
    async with running_transcript(tmp_path, postgres_url) as transcript:
        await two_sources(transcript)
        settings = process_settings(tmp_path, postgres_url, transcript)
        database = Database(settings.resolved_database_url("merge"), schema="merge")
        try:
            # The first holds its run after its first unit commit, so it is killed mid-extraction.
            async with merge_process(
                settings, "replica-1", MERGE_INSTANCE_ID="m1", MERGE_HOLD_AT=UNIT_AFTER_COMMIT
            ) as first:
                operation_id = await first.start(["a", "b"])

                async def first_unit_committed() -> bool:
                    return (await attempts(database, operation_id))[1]["completed"] == 1

                await eventually(first_unit_committed, what="the first unit to commit", seconds=60)
                async with merge_process(settings, "replica-2", MERGE_INSTANCE_ID="m2") as other:
                    async with database.connection() as connection:
                        stored = await store.load(connection, operation_id)
                    assert stored is not None and stored.lease_owner == "m1"
                    first.process.send_signal(signal.SIGKILL)
                    assert await first.process.wait() == -signal.SIGKILL
                    units, outcomes = await recovered(transcript, settings, database, other, operation_id)
                    async with database.connection() as connection:
                        stored = await store.load(connection, operation_id)
                    assert stored is not None and stored.run_epoch > 1 and stored.lease_owner in (None, "m2")
            assert units > 1 and outcomes == Counter({"completed": units})
        finally:
            await database.dispose()


def unit_answer() -> Reply:
    """A valid extraction answer for any unit (every unit's request has alias i1)."""
    item = {"section": "changes", "status": "completed", "content": "The build passes now.", "evidence": ["i1"]}
    return completion(
        json.dumps({"schemaVersion": 2, "items": [item]}), usage={"prompt_tokens": 5, "completion_tokens": 5}
    )


async def test_kill_9_while_the_http_provider_fails_then_a_restart_completes_once_it_recovers(
    transcript: TranscriptClient, settings: MergeSettings, database: Database
) -> None:
    model = FakeModelServer()
    await model.start()
    provider = {
        "MERGE_PROVIDER__KIND": "openai",
        "MERGE_PROVIDER__BASE_URL": model.url,
        "MERGE_PROVIDER__MODEL": MODEL,
        # Patient enough that the process is still trying (not paused) when it is killed.
        "MERGE_EXTRACTION__ATTEMPTS": "10",
        "MERGE_EXTRACTION__BACKOFF_SECONDS": "[0.3]",
    }
    try:
        # The first unit is answered, then the provider fails with 503 on every call.
        model.script(unit_answer(), *[Reply(status=503, body=b"overloaded")] * 50)
        async with merge_process(settings, MERGE_INSTANCE_ID="m1", **provider) as doomed:
            operation_id = await doomed.start(["a", "b"])

            async def failing_mid_run() -> bool:
                return len(model.requests) >= 4 and (await attempts(database, operation_id))[1]["completed"] == 1

            await eventually(failing_mid_run, what="the provider to fail after the first unit", seconds=60)
            assert (await doomed.get(operation_id)).progress.status == pb.MERGE_STATUS_PREPARING
            doomed.process.send_signal(signal.SIGKILL)
            assert await doomed.process.wait() == -signal.SIGKILL
        asked_before = len(model.requests)

        # The provider recovers; the restarted process continues from the first unfinished unit.
        model.replies.clear()
        model.script(*[unit_answer()] * 50)
        async with merge_process(settings, MERGE_INSTANCE_ID="m1", **provider) as restarted:
            units, outcomes = await recovered(transcript, settings, database, restarted, operation_id)
    finally:
        await model.stop()
    # One answered call per unit: the first unit's was before the kill and is not asked again.
    assert units > 2 and len(model.requests) - asked_before == units - 1
    # Every unit completed once; the attempt the kill cut off stays as it was recorded (running).
    assert outcomes == Counter({"completed": units, "running": 1})
