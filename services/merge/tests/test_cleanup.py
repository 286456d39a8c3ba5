"""Merge removes only its own packages: a deleted target's (through transcript's session events) and a
cancelled operation's (by the reconciling cleanup), never another's, never transcript's data."""

from __future__ import annotations

from pathlib import Path

from deadline_testing import eventually
from merge_testing import OTHER, MergeStack, running_merge
from pipeline_testing import ScriptedPipeline

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge.cleanup import reconcile
from continuum_merge.server import open_transcript
from continuum_runtime.clock import SystemClock

FAST = {"worker_poll_seconds": 0.1, "lease_renew_seconds": 0.3, "lease_ttl_seconds": 2.0, "events_retry_seconds": 0.1}


async def merged(stack: MergeStack, owner: str, names: tuple[str, str]) -> pb.MergeOperation:
    for name in names:
        await stack.new_session(name, owner=owner)
    operation_id = (await stack.start(list(names), owner=owner)).operation.progress.operation_id

    async def done() -> bool:
        return (await stack.get(operation_id, owner)).progress.status == pb.MERGE_STATUS_COMPLETED

    await eventually(done, what="the merge completed")
    return await stack.get(operation_id, owner)


async def test_deleting_a_target_removes_only_its_package(tmp_path: Path, database_url: str) -> None:
    async with running_merge(tmp_path, database_url, pipeline=ScriptedPipeline(), overrides=FAST) as stack:
        alices = await merged(stack, "alice", ("a", "b"))
        bobs = await merged(stack, OTHER, ("c", "d"))
        root = stack.settings.resolved_package_root()
        assert (root / alices.progress.operation_id).is_dir()

        await stack.transcript.stub.DeleteSession(
            tapi.DeleteSessionRequest(session_id=alices.progress.target_session_id), metadata=stack.user()
        )
        # Deleting a source is no business of merge's.
        await stack.transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id="c"), metadata=stack.user(OTHER))

        await eventually(lambda: not (root / alices.progress.operation_id).exists(), what="alice's package removed")
        assert (root / bobs.progress.operation_id / "handoff" / "ready.json").exists()
        # The operation stays readable for diagnosis; its target is no longer available.
        after = await stack.get(alices.progress.operation_id)
        assert (after.progress.status, after.progress.target_available) == (pb.MERGE_STATUS_COMPLETED, False)
        assert (await stack.get(bobs.progress.operation_id, OTHER)).progress.target_available


async def test_reconcile_removes_a_cancelled_operations_package_and_keeps_the_rest(
    tmp_path: Path, database_url: str
) -> None:
    async with running_merge(tmp_path, database_url, overrides={"worker_enabled": False}) as stack:
        for name in ("a", "b"):
            await stack.new_session(name)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user())
        root = stack.settings.resolved_package_root()
        (root / operation_id / "staging").mkdir(parents=True)
        (root / operation_id / "staging" / "records.jsonl").write_text("{}\n")
        stray = root / "not-an-operation"
        stray.mkdir()
        transcript = open_transcript(stack.settings)
        try:
            found = await reconcile(stack.database, transcript, root, SystemClock())
            again = await reconcile(stack.database, transcript, root, SystemClock())
        finally:
            await transcript.close()

    assert (found.packages, found.removed) == (2, 1)
    assert (again.packages, again.removed) == (1, 0)
    assert not (root / operation_id).exists()
    assert stray.is_dir()
