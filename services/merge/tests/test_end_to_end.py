"""A merge through the real stages: transcript sources sealed into a package, units extracted and
aggregated by the built-in offline provider, the target published; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from deadline_testing import eventually
from merge_testing import MergeStack, running_merge
from sqlalchemy import text
from transcript_testing import all_messages, append, assistant, tool, user

from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge.worker import UNIT_BEFORE_COMMIT

FAST = {"worker_poll_seconds": 0.1, "lease_renew_seconds": 0.5, "lease_ttl_seconds": 5.0}


@pytest.fixture
async def stack(tmp_path: Path, database_url: str) -> AsyncIterator[MergeStack]:
    async with running_merge(tmp_path, database_url, overrides=FAST) as started:
        yield started


async def test_two_sessions_merge_into_a_published_target_with_a_verified_package(stack: MergeStack) -> None:
    for session_id in ("a", "b"):
        await stack.new_session(session_id, texts=1)
        await append(
            stack.transcript,
            session_id,
            assistant(f"{session_id}: reading the file", f"call-{session_id}"),
            tool(f"call-{session_id}", f"{session_id}: the file says 42"),
            user(f"{session_id}: decided to keep 42"),
        )
    await stack.new_session("a-child", parent="a", texts=2)
    operation_id = (await stack.start(["a", "b"], title="Both")).operation.progress.operation_id

    async def finished() -> bool:
        status = (await stack.get(operation_id)).progress.status
        assert status in (pb.MERGE_STATUS_PREPARING, pb.MERGE_STATUS_COMPLETED), await stack.get(operation_id)
        return status == pb.MERGE_STATUS_COMPLETED

    await eventually(finished, what="the merge completed", seconds=60)
    done = await stack.get(operation_id)

    assert done.progress.progress.completed_units == done.progress.progress.known_units >= 1
    assert done.progress.progress.total_final
    package = stack.settings.resolved_package_root() / operation_id
    seal = json.loads((package / "snapshot" / "seal.json").read_text())
    ready = json.loads((package / "handoff" / "ready.json").read_text())
    assert isinstance(seal, dict)
    assert isinstance(ready, dict)
    async with stack.database.connection() as connection:
        recorded = (
            await connection.execute(
                text(
                    "SELECT snapshot_hash, handoff_hash, snapshot_version FROM session_merges WHERE operation_id = :o"
                ),
                {"o": operation_id},
            )
        ).one()
        states = set((await connection.execute(text("SELECT state FROM session_merge_units"))).scalars())
    assert recorded.snapshot_version == 1
    assert recorded.snapshot_hash is not None
    assert recorded.handoff_hash is not None
    assert states == {"completed"}
    target = (
        await stack.transcript.stub.GetSession(
            tapi.GetSessionRequest(session_id=done.progress.target_session_id), metadata=stack.user()
        )
    ).session
    assert (target.kind, target.title) == (tpb.SESSION_KIND_MERGED, "Both")
    assert len(await all_messages(stack.transcript.stub, stack.user(), target.session_id)) == 1
    # The sources are free again: a turn can start in each.
    await stack.run_claim("a")
    await stack.run_claim("b")


def texts_containing(package: Path, needle: str) -> int:
    """How many text parts of the sealed snapshot contain `needle`."""
    return sum(needle in path.read_text() for path in (package / "snapshot" / "text").glob("*.txt"))


async def completed(stack: MergeStack, operation_id: str) -> pb.MergeOperation:
    async def done() -> bool:
        return (await stack.get(operation_id)).progress.status == pb.MERGE_STATUS_COMPLETED

    await eventually(done, what="the merge completed", seconds=60)
    return await stack.get(operation_id)


async def test_after_the_seal_the_sources_move_on_and_the_merge_reads_only_its_package(
    tmp_path: Path, database_url: str
) -> None:
    sealed = asyncio.Event()
    proceed = asyncio.Event()

    async def hold_after_the_seal(name: str) -> None:
        if name == UNIT_BEFORE_COMMIT and not proceed.is_set():
            sealed.set()
            await proceed.wait()

    async with running_merge(tmp_path, database_url, failpoint=hold_after_the_seal, overrides=FAST) as stack:
        for session_id in ("a", "b"):
            await stack.new_session(session_id, texts=2)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        await sealed.wait()
        progress = (await stack.get(operation_id)).progress
        assert progress.snapshot_sealed
        assert not progress.locked_source_session_ids
        # The sources are free: a new message in one, the other deleted, while the merge works.
        await append(stack.transcript, "a", user("a: written after the seal"))
        await stack.transcript.stub.DeleteSession(tapi.DeleteSessionRequest(session_id="b"), metadata=stack.user())
        proceed.set()
        await completed(stack, operation_id)
        package = stack.settings.resolved_package_root() / operation_id

    assert texts_containing(package, "b message 1") == 1
    assert texts_containing(package, "written after the seal") == 0


async def test_merging_a_merged_session_again_keeps_new_messages_and_folds_duplicates(stack: MergeStack) -> None:
    for session_id in ("a", "b"):
        await stack.new_session(session_id, texts=2)
    first = await completed(stack, (await stack.start(["a", "b"], key="k1")).operation.progress.operation_id)
    merged_id = first.progress.target_session_id
    await append(stack.transcript, "a", user("a: new since the first merge"))

    second = await completed(stack, (await stack.start([merged_id, "a"], key="k2")).operation.progress.operation_id)

    package = stack.settings.resolved_package_root() / second.progress.operation_id
    # The first merge's originals come from its package, A's own history adds only what is new.
    assert texts_containing(package, "b message 1") == 1
    assert texts_containing(package, "a message 0") == 1
    assert texts_containing(package, "new since the first merge") == 1
