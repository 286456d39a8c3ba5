"""Cleanup through the real stages: a deleted target's package goes while a later merge that read it keeps
its own; `python -m continuum_merge cleanup` as a process (nothing removed without a database, strays and
foreign directories kept); a cancelled operation's directory goes once its writer stopped, or through the
sweeper when it had no run; an event about a live target or a package already gone removes nothing."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

from deadline_testing import eventually
from merge_testing import MergeStack, admitted, running_merge, running_merge_service
from stages_testing import FAST, Hold, merge_env, merged_sessions, two_sources
from transcript_testing import running_transcript

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge import store
from continuum_merge.cleanup import remove_package_of_deleted_target, sweep_cancelled
from continuum_merge.server import open_transcript
from continuum_merge.snapshot import verify_snapshot
from continuum_merge.worker import UNIT_BEFORE_COMMIT
from continuum_runtime.clock import SystemClock


async def merged(stack: MergeStack, sources: list[str], key: str) -> pb.MergeOperation:
    operation_id = (await stack.start(sources, key=key)).operation.progress.operation_id

    async def done() -> bool:
        return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_COMPLETED

    await eventually(done, what="the merge to complete", seconds=60)
    return await stack.get(operation_id)


async def delete(stack: MergeStack, session_id: str) -> None:
    await stack.transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id=session_id), metadata=stack.user())


async def cleanup_command(stack: MergeStack, **extra: str) -> tuple[int, str]:
    """`python -m continuum_merge cleanup` with the stack's settings; its exit code and output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "continuum_merge",
        "cleanup",
        env={**os.environ, **merge_env(stack.settings, **extra)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    return await process.wait(), output.decode()


async def test_deleting_a_merged_target_keeps_the_package_of_a_later_merge_that_read_it(
    tmp_path: Path, database_url: str
) -> None:
    async with running_merge(tmp_path, database_url, overrides=FAST) as stack:
        root = stack.settings.resolved_package_root()
        await two_sources(stack.transcript)
        first = await merged(stack, ["a", "b"], "key-1")
        second = await merged(stack, [first.progress.target_session_id, "a"], "key-2")
        # A source's deletion removes nothing.
        await delete(stack, "b")
        await delete(stack, first.progress.target_session_id)

        await eventually(lambda: not (root / first.progress.operation_id).exists(), what="the package removal")
        verify_snapshot(root / second.progress.operation_id)
        assert (await stack.get(first.progress.operation_id)).progress.status == pb.MERGE_STATUS_COMPLETED


async def test_the_cleanup_command_removes_what_was_missed_and_nothing_without_a_database(
    tmp_path: Path, database_url: str
) -> None:
    overrides = {**FAST, "consume_session_events": False}
    async with running_transcript(tmp_path, database_url) as transcript:
        async with running_merge_service(tmp_path, database_url, transcript, overrides=overrides) as stack:
            await two_sources(stack.transcript)
            kept = await merged(stack, ["a", "b"], "key-1")
            deleted = await merged(stack, ["a", "b"], "key-2")
            await delete(stack, deleted.progress.target_session_id)
        # A replica without a worker: the cancelled operation has no run that would clean up after it.
        overrides["worker_enabled"] = False
        async with running_merge_service(tmp_path, database_url, transcript, overrides=overrides) as stack:
            await reconciled(stack, kept, tmp_path, database_url)


async def reconciled(stack: MergeStack, kept: pb.MergeOperation, tmp_path: Path, database_url: str) -> None:
    root = stack.settings.resolved_package_root()
    stray = uuid.uuid4().hex
    (root / stray / "staging").mkdir(parents=True)
    (root / "lost+found").mkdir()
    cancelled_id = (await stack.start(["a", "b"], key="key-3")).operation.progress.operation_id
    await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=cancelled_id), metadata=stack.user())
    # What a cancelled operation whose writer crashed leaves behind.
    (root / cancelled_id / "staging").mkdir(parents=True)
    present = sorted(path.name for path in root.iterdir())

    code, output = await cleanup_command(stack, MERGE_DATABASE_URL=unreadable(tmp_path, database_url))
    assert code != 0, output
    assert sorted(path.name for path in root.iterdir()) == present

    code, output = await cleanup_command(stack)
    assert code == 0 and "removed 2" in output, output
    # What no operation accounts for is kept.
    remaining = sorted(path.name for path in root.iterdir())
    assert remaining == sorted([kept.progress.operation_id, stray, "lost+found"]), output
    verify_snapshot(root / kept.progress.operation_id)
    await stack.run_claim("a")


def unreadable(tmp_path: Path, database_url: str) -> str:
    """A database URL of the same backend that cannot be read."""
    if database_url.startswith("sqlite"):
        return f"sqlite+aiosqlite:///{tmp_path / 'missing-dir' / 'merge.db'}"
    return database_url.rpartition("/")[0] + "/continuum_no_such_database"


async def test_a_cancelled_operation_loses_its_directory_once_its_writer_stopped(
    tmp_path: Path, database_url: str
) -> None:
    hold = Hold(UNIT_BEFORE_COMMIT)
    async with running_merge(tmp_path, database_url, failpoint=hold, overrides=FAST) as stack:
        await two_sources(stack.transcript)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        await asyncio.wait_for(hold.reached.wait(), 60)
        package = stack.settings.resolved_package_root() / operation_id
        assert (package / "snapshot").is_dir()
        await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user())
        # The writer was cancelled at its hold, so it never commits the unit it was holding.
        await eventually(lambda: not package.exists(), what="the cancelled operation's directory to go")
        operation = await stack.get(operation_id)
        assert operation.progress.status == pb.MERGE_STATUS_CANCELLED and not operation.progress.target_available
        assert not await merged_sessions(stack.transcript)


async def test_an_event_naming_a_live_target_or_a_package_already_gone_removes_nothing(
    tmp_path: Path, database_url: str
) -> None:
    async with running_merge(tmp_path, database_url, overrides=FAST) as stack:
        root = stack.settings.resolved_package_root()
        await two_sources(stack.transcript)
        operation = await merged(stack, ["a", "b"], "key-1")
        client = open_transcript(stack.settings)
        try:
            target = operation.progress.target_session_id
            assert not await remove_package_of_deleted_target(stack.database, client, root, target)
            verify_snapshot(root / operation.progress.operation_id)
            assert not await remove_package_of_deleted_target(stack.database, client, root, "a")
            await delete(stack, target)
            await eventually(lambda: not (root / operation.progress.operation_id).exists(), what="the removal")
            # The same event replayed: the package is gone already, nothing else is touched.
            assert not await remove_package_of_deleted_target(stack.database, client, root, target)
        finally:
            await client.close()


async def test_a_paused_operation_cancelled_loses_its_directory_without_a_run(
    tmp_path: Path, database_url: str
) -> None:
    overrides = {**FAST, "disk_reserve_bytes": 2**62, "cancel_sweep_seconds": 0.2}
    async with running_merge(tmp_path, database_url, overrides=overrides) as stack:
        await two_sources(stack.transcript)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id

        async def paused() -> bool:
            return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_PAUSED

        await eventually(paused, what="the merge to pause short of disk")
        package = stack.settings.resolved_package_root() / operation_id
        assert (package / "staging").is_dir()
        await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user())
        await eventually(lambda: not package.exists(), what="the cancelled operation's staging copy to go")
        await stack.run_claim("a")


async def test_the_sweeper_cleans_each_cancelled_operation_once_including_one_whose_writer_died(
    tmp_path: Path, database_url: str
) -> None:
    """A cancelled operation without a lease, one whose writer's lease ran out (killed mid-run), one a
    live writer still holds and one that left nothing behind: the sweep cleans the first two (the one
    cancelled while publishing too) and marks them and the empty one, so the next sweep reads and cleans
    nothing; the live writer's is left to it."""
    async with running_merge(tmp_path, database_url, overrides={**FAST, "cancel_sweep_seconds": 3600}) as stack:
        clock = SystemClock()
        root = stack.settings.resolved_package_root()
        leases = {
            "op-free": (None, None),
            "op-dead": ("dead-replica", clock.now_ms() - 1),
            "op-live": ("live", 2**62),
            "op-empty": (None, None),
        }
        for operation_id, (owner, expire_ms) in leases.items():
            # Cancelled as it is inserted: the service's worker must never take one as merely admitted.
            cancelled = {
                "status": "cancelled",
                "stage": "publishing" if operation_id == "op-free" else "extracting",
                "active_slot": None,
                "lease_owner": owner,
                "lease_expire_ms": expire_ms,
            }
            await admitted(
                stack.database, key=operation_id, operation_id=operation_id, now_ms=clock.now_ms(), changes=cancelled
            )
            if operation_id != "op-empty":
                (root / operation_id / "work").mkdir(parents=True)
        client = open_transcript(stack.settings)
        try:
            assert await sweep_cancelled(stack.database, client, root, clock) == 2
            assert not (root / "op-free").exists()
            assert not (root / "op-dead").exists()
            assert (root / "op-live").exists()
            assert await sweep_cancelled(stack.database, client, root, clock) == 0
            async with stack.database.connection() as connection:
                assert await store.cancelled_uncleaned(connection, "", clock.now_ms(), 10) == []
                cleaned = {
                    operation_id: (await store.load(connection, operation_id)).cleaned_ms  # type: ignore[union-attr]
                    for operation_id in leases
                }
            assert cleaned["op-free"] and cleaned["op-dead"] and cleaned["op-empty"] and cleaned["op-live"] is None
        finally:
            await client.close()
