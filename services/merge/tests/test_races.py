"""Races of real clients on PostgreSQL: the database, not luck, decides who wins.

Each test holds an EXCLUSIVE lock on session_merges (reads pass, writes queue), starts the racing
calls, waits until PostgreSQL shows their writes queued behind the lock, then releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from deadline_testing import eventually
from merge_testing import OWNER, MergeStack, conflict_operation, running_merge
from pipeline_testing import ScriptedPipeline
from race_testing import until_waiting
from sqlalchemy import text

from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge import store
from continuum_merge.worker import PUBLISH_BEFORE_COMPLETE
from continuum_runtime.clock import SystemClock
from continuum_runtime.errors import error_details

pytestmark = pytest.mark.postgres


@pytest.fixture
async def stack(tmp_path: Path, postgres_url: str) -> AsyncIterator[MergeStack]:
    """Both services on PostgreSQL, the worker off."""
    async with running_merge(tmp_path, postgres_url, overrides={"worker_enabled": False}) as started:
        yield started


@asynccontextmanager
async def writes_held(stack: MergeStack) -> AsyncIterator[None]:
    """Queue every write to session_merges until the block ends."""
    async with stack.database.transaction() as connection:
        await connection.execute(text("LOCK TABLE session_merges IN EXCLUSIVE MODE"))
        yield


def spawn(call: Awaitable[object]) -> asyncio.Future[object]:
    """Run a call (a coroutine or a gRPC call object) concurrently."""
    return asyncio.ensure_future(call)


@asynccontextmanager
async def row_held(stack: MergeStack, operation_id: str) -> AsyncIterator[None]:
    """Queue every write to one operation's row until the block ends; PostgreSQL then lets the queued
    writers through in the order they queued."""
    async with stack.database.transaction() as connection:
        await connection.execute(
            text("SELECT 1 FROM session_merges WHERE operation_id = :o FOR UPDATE"), {"o": operation_id}
        )
        yield


@asynccontextmanager
async def start_claiming(stack: MergeStack) -> AsyncIterator[tuple[asyncio.Future[object], store.Operation]]:
    """A StartMerge of sessions a and b held while it claims them (transcript's claims table stays locked
    until the block ends): the call and the operation it inserted."""
    for session_id in ("a", "b"):
        await stack.new_session(session_id)
    async with stack.database.transaction() as claims_held:
        await claims_held.execute(text("LOCK TABLE transcript.execution_claims IN EXCLUSIVE MODE"))
        start = spawn(stack.start(["a", "b"]))
        await until_waiting(stack.database, 1, "the start claiming the sources")
        async with stack.database.connection() as connection:
            operation = await store.load_active(connection, OWNER)
        assert operation is not None
        yield start, operation


async def outcomes(*calls: asyncio.Future[object]) -> list[object]:
    """Each call's answer or its AioRpcError."""
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def test_two_starts_with_different_keys_one_wins(stack: MergeStack) -> None:
    for session_id in ("a", "b", "c", "d"):
        await stack.new_session(session_id)
    async with writes_held(stack):
        first = spawn(stack.start(["a", "b"], key="k1"))
        second = spawn(stack.start(["c", "d"], key="k2"))
        await until_waiting(stack.database, 2, "both starts inserting")
    results = await outcomes(first, second)

    won = [result for result in results if isinstance(result, api.StartMergeResponse)]
    lost = [result for result in results if isinstance(result, grpc.aio.AioRpcError)]
    assert len(won) == 1
    assert len(lost) == 1
    assert error_details(lost[0]).reason == "MERGE_ACTIVE_EXISTS"
    winner = won[0].operation.progress
    assert conflict_operation(lost[0]).progress.operation_id == winner.operation_id
    # The loser never claimed: its sources are free for a turn; the winner's are held.
    losing_sources = ["c", "d"] if list(winner.locked_source_session_ids) == ["a", "b"] else ["a", "b"]
    for session_id in losing_sources:
        await stack.run_claim(session_id)


async def test_no_worker_takes_an_operation_while_its_start_still_claims_the_sources(stack: MergeStack) -> None:
    """Both would claim the sources under the operation's one holder: the second was refused as busy, and
    the run paused (or the start failed for an operation that was running)."""
    async with start_claiming(stack) as (start, operation):
        # What any replica's worker does when it looks for work now.
        now = SystemClock().now_ms()
        async with stack.database.transaction() as connection:
            assert await store.claimable(connection, "worker-1", now, 10) == []
            assert await store.take_lease(connection, operation, "worker-1", now, 10_000) is None
    assert isinstance(await start, api.StartMergeResponse)
    async with stack.database.connection() as connection:
        (admitted,) = await store.claimable(connection, "worker-1", SystemClock().now_ms(), 10)
    assert admitted.run_epoch == store.FIRST_EPOCH and admitted.claim_id is not None and admitted.lease_owner is None


async def test_a_start_slower_than_the_lease_keeps_its_operation_from_workers(
    tmp_path: Path, postgres_url: str
) -> None:
    overrides = {"worker_enabled": False, "lease_ttl_seconds": 1.0, "lease_renew_seconds": 0.2}
    async with running_merge(tmp_path, postgres_url, overrides=overrides) as stack:
        async with start_claiming(stack) as (start, operation):
            assert operation.lease_expire_ms is not None
            first_end = operation.lease_expire_ms

            async def renewed_past_its_first_end() -> bool:
                async with stack.database.connection() as connection:
                    current = await store.load(connection, operation.operation_id)
                now = SystemClock().now_ms()
                return current is not None and now > first_end and (current.lease_expire_ms or 0) > now

            await eventually(renewed_past_its_first_end, what="the start to renew its lease", seconds=10)
            async with stack.database.connection() as connection:
                assert await store.claimable(connection, "worker-1", SystemClock().now_ms(), 10) == []
        assert isinstance(await start, api.StartMergeResponse)


async def test_a_cancel_while_the_start_claims_ends_its_admission_and_frees_the_user_at_once(
    stack: MergeStack,
) -> None:
    for session_id in ("c", "d"):
        await stack.new_session(session_id)
    async with start_claiming(stack) as (start, operation):
        await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation.operation_id), metadata=stack.user())
    assert isinstance(await start, api.StartMergeResponse)
    async with stack.database.connection() as connection:
        cancelled = await store.load(connection, operation.operation_id)
    assert cancelled is not None and cancelled.status == "cancelled" and cancelled.lease_owner is None
    # Nothing stays claimed, and the user need not wait for the cancelled merge to stop.
    for session_id in ("a", "b"):
        await stack.run_claim(session_id)
    assert (await stack.start(["c", "d"], key="key-2")).created


async def test_the_same_key_twice_makes_one_operation(stack: MergeStack) -> None:
    for session_id in ("a", "b"):
        await stack.new_session(session_id)
    async with writes_held(stack):
        first = spawn(stack.start(["a", "b"], key="k"))
        second = spawn(stack.start(["b", "a"], key="k", primary_session_id="a"))
        await until_waiting(stack.database, 2, "both starts inserting")
    results = await outcomes(first, second)

    assert all(isinstance(result, api.StartMergeResponse) for result in results), results
    responses = [result for result in results if isinstance(result, api.StartMergeResponse)]
    assert sorted(response.created for response in responses) == [False, True]
    assert len({response.operation.progress.operation_id for response in responses}) == 1


async def test_duplicate_resume_one_wins(stack: MergeStack) -> None:
    for session_id in ("a", "b"):
        await stack.new_session(session_id)
    operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
    await stack.pause(operation_id)
    request = api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=1)
    async with writes_held(stack):
        calls = [spawn(stack.stub.ResumeMerge(request, metadata=stack.user())) for _ in range(2)]
        await until_waiting(stack.database, 2, "both resumes updating")
    results = await outcomes(*calls)

    won = [result for result in results if isinstance(result, api.ResumeMergeResponse)]
    lost = [result for result in results if isinstance(result, grpc.aio.AioRpcError)]
    assert len(won) == 1
    assert len(lost) == 1
    assert error_details(lost[0]).reason == "MERGE_STALE_OPERATION"
    assert conflict_operation(lost[0]).progress.run_epoch == 2
    assert won[0].operation.progress.run_epoch == 2
    assert won[0].operation.progress.status == pb.MERGE_STATUS_PREPARING


async def test_cancel_against_resume_ends_cancelled_in_either_order(stack: MergeStack) -> None:
    for session_id in ("a", "b"):
        await stack.new_session(session_id)
    operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
    await stack.pause(operation_id)
    async with writes_held(stack):
        cancel = spawn(stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user()))
        resume = spawn(
            stack.stub.ResumeMerge(
                api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=1), metadata=stack.user()
            )
        )
        await until_waiting(stack.database, 2, "the cancel and the resume updating")
    cancelled, resumed = await outcomes(cancel, resume)

    # A cancel never loses to a resume: a resume that ran first is superseded by it (one more epoch).
    assert isinstance(cancelled, api.CancelMergeResponse)
    assert cancelled.operation.progress.status == pb.MERGE_STATUS_CANCELLED
    if isinstance(resumed, grpc.aio.AioRpcError):
        assert error_details(resumed).reason == "MERGE_STALE_OPERATION"
        assert cancelled.operation.progress.run_epoch == 2
    else:
        assert isinstance(resumed, api.ResumeMergeResponse)
        assert cancelled.operation.progress.run_epoch == 3
    final = await stack.get(operation_id)
    assert final.progress.status == pb.MERGE_STATUS_CANCELLED
    assert not (await stack.stub.GetActiveMerge(api.GetActiveMergeRequest(), metadata=stack.user())).HasField(
        "operation"
    )


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_cancel_against_publish_exactly_one_wins(tmp_path: Path, postgres_url: str, cancel_first: bool) -> None:
    reached = asyncio.Event()
    proceed = asyncio.Event()

    async def hold_before_complete(name: str) -> None:
        if name == PUBLISH_BEFORE_COMPLETE:
            reached.set()
            await proceed.wait()

    # Lease renewals (writes to the same row) stay out of the way of the two racers.
    settings = {"worker_poll_seconds": 0.1, "lease_ttl_seconds": 120.0, "lease_renew_seconds": 60.0}
    async with running_merge(
        tmp_path, postgres_url, pipeline=ScriptedPipeline(), failpoint=hold_before_complete, overrides=settings
    ) as stack:
        for session_id in ("a", "b"):
            await stack.new_session(session_id)
        operation_id = (await stack.start(["a", "b"])).operation.progress.operation_id
        await reached.wait()
        target_id = (await stack.get(operation_id)).progress.target_session_id
        cancel_request = api.CancelMergeRequest(operation_id=operation_id)
        async with row_held(stack, operation_id):
            if cancel_first:
                cancel = spawn(stack.stub.CancelMerge(cancel_request, metadata=stack.user()))
                await until_waiting(stack.database, 1, "the cancel updating")
                proceed.set()
                await until_waiting(stack.database, 2, "the publish's completed update")
            else:
                proceed.set()
                await until_waiting(stack.database, 1, "the publish's completed update")
                cancel = spawn(stack.stub.CancelMerge(cancel_request, metadata=stack.user()))
                await until_waiting(stack.database, 2, "the cancel updating")
        (cancelled,) = await outcomes(cancel)

        package = stack.settings.resolved_package_root() / operation_id

        async def settled() -> bool:
            async with stack.database.connection() as connection:
                status = await connection.scalar(
                    text("SELECT status FROM session_merges WHERE operation_id = :o AND lease_owner IS NULL"),
                    {"o": operation_id},
                )
            # A cancelled run's cleanup ends by removing the package.
            return status == "completed" or (status == "cancelled" and not package.exists())

        await eventually(settled, what="the run finished")
        final = await stack.get(operation_id)
        target = await stack.transcript.stub.GetSession(
            tapi.GetSessionRequest(session_id=target_id, include_deleted=True), metadata=stack.user()
        )

    # Exactly one wins: a completed merge keeps its target and refuses the cancel; a cancelled one
    # leaves no target behind (the one its publish created is deleted, never published).
    assert isinstance(cancelled, api.CancelMergeResponse) == cancel_first
    if isinstance(cancelled, api.CancelMergeResponse):
        assert final.progress.status == pb.MERGE_STATUS_CANCELLED
        assert target.session.HasField("delete_time")
    else:
        assert isinstance(cancelled, grpc.aio.AioRpcError)
        assert error_details(cancelled).reason == "MERGE_ALREADY_COMPLETED"
        assert final.progress.status == pb.MERGE_STATUS_COMPLETED
        assert not target.session.HasField("delete_time")
