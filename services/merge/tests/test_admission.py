"""StartMerge's admission, the reads, resume and cancel through real transcript and merge servers."""

from __future__ import annotations

import grpc
from merge_testing import OTHER, OWNER, MergeStack, conflict_operation, refused

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import transcript_service_pb2 as tapi


async def two_sources(stack: MergeStack) -> list[str]:
    return [await stack.new_session("a"), await stack.new_session("b")]


async def test_start_claims_every_source_tree_and_reserves_the_target(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    await stack.new_session("a-child", parent="a")

    response = await stack.start(sources, title="Both")

    assert response.created
    progress = response.operation.progress
    assert progress.protocol_version == 2
    assert (progress.status, progress.stage, progress.run_epoch) == (
        pb.MERGE_STATUS_PREPARING,
        pb.MERGE_STAGE_SNAPSHOTTING,
        1,
    )
    assert list(progress.locked_source_session_ids) == ["a", "b"]
    assert (progress.can_resume, progress.can_cancel, progress.target_available) == (False, True, False)
    assert not progress.snapshot_sealed
    assert response.operation.parameters.title == "Both"
    # The claim is real: a turn cannot start in a source, nor in a child of one.
    for session_id in ("a", "a-child", "b"):
        await refused(stack.run_claim(session_id), grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ALREADY_RUNNING")
    # The target id is reserved, not created.
    await refused(
        stack.transcript.stub.GetSession(
            tapi.GetSessionRequest(session_id=progress.target_session_id), metadata=stack.user()
        ),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    active = await stack.stub.GetActiveMerge(api.GetActiveMergeRequest(), metadata=stack.user())
    assert active.operation == await stack.get(progress.operation_id)


async def test_the_same_key_answers_the_same_operation_and_other_parameters_conflict(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    first = await stack.start(sources, key="k")

    again = await stack.start(list(reversed(sources)), key="k", primary_session_id="a")
    _, error = await refused(
        stack.start(sources, key="k", title="other"), grpc.StatusCode.ALREADY_EXISTS, "MERGE_IDEMPOTENCY_CONFLICT"
    )

    assert not again.created
    assert again.operation.progress.operation_id == first.operation.progress.operation_id
    assert conflict_operation(error).progress.operation_id == first.operation.progress.operation_id


async def test_one_unfinished_merge_per_user(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    first = await stack.start(sources, key="k1")
    others = [await stack.new_session("c"), await stack.new_session("d")]

    _, error = await refused(stack.start(others, key="k2"), grpc.StatusCode.ALREADY_EXISTS, "MERGE_ACTIVE_EXISTS")

    assert conflict_operation(error).progress.operation_id == first.operation.progress.operation_id
    # Another user is not affected by alice's slot.
    bobs = [await stack.new_session("e", owner=OTHER), await stack.new_session("f", owner=OTHER)]
    assert (await stack.start(bobs, key="k1", owner=OTHER)).created


async def test_a_busy_source_refuses_admission_and_leaves_nothing_behind(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    await stack.run_claim("b")

    details, _ = await refused(stack.start(sources), grpc.StatusCode.FAILED_PRECONDITION, "MERGE_SOURCE_BUSY")

    assert details.metadata["session_id"] == "b"
    assert details.metadata["holder_kind"] == "CLAIM_KIND_RUN"
    # No operation and no claim stay: `a` can run, and the user can start again with the same key.
    await stack.run_claim("a")
    assert not (await stack.stub.GetActiveMerge(api.GetActiveMergeRequest(), metadata=stack.user())).HasField(
        "operation"
    )


async def test_cancel_frees_the_slot_and_the_sources_and_is_idempotent(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    started = (await stack.start(sources)).operation.progress

    cancelled = await stack.stub.CancelMerge(
        api.CancelMergeRequest(operation_id=started.operation_id), metadata=stack.user()
    )
    again = await stack.stub.CancelMerge(
        api.CancelMergeRequest(operation_id=started.operation_id), metadata=stack.user()
    )

    progress = cancelled.operation.progress
    assert (progress.status, progress.run_epoch) == (pb.MERGE_STATUS_CANCELLED, 2)
    assert not progress.locked_source_session_ids
    assert (progress.can_cancel, progress.can_resume) == (False, False)
    assert again.operation.progress == progress
    await stack.run_claim("a")
    assert not (await stack.stub.GetActiveMerge(api.GetActiveMergeRequest(), metadata=stack.user())).HasField(
        "operation"
    )
    others = [await stack.new_session("c"), await stack.new_session("d")]
    assert (await stack.start(others, key="key-2")).created


async def test_resume_needs_a_paused_operation_at_the_epoch_the_caller_saw(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    operation_id = (await stack.start(sources)).operation.progress.operation_id
    _, error = await refused(
        stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=1), metadata=stack.user()
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "MERGE_STALE_OPERATION",
    )
    assert conflict_operation(error).progress.status == pb.MERGE_STATUS_PREPARING
    await stack.pause(operation_id)
    paused = await stack.get(operation_id)
    assert (paused.progress.status, paused.progress.can_resume) == (pb.MERGE_STATUS_PAUSED, True)
    assert paused.progress.error_code == error_code_pb2.DISK_RESERVE

    await refused(
        stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=7), metadata=stack.user()
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "MERGE_STALE_OPERATION",
    )
    resumed = await stack.stub.ResumeMerge(
        api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=1, model="other-model"), metadata=stack.user()
    )

    assert (resumed.operation.progress.status, resumed.operation.progress.run_epoch) == (pb.MERGE_STATUS_PREPARING, 2)
    assert resumed.operation.progress.error_code == 0
    # The request is kept as given; the new model applies to the work not yet done.
    assert resumed.operation.parameters.model == ""


async def test_another_users_operation_and_sources_are_refused(stack: MergeStack) -> None:
    sources = await two_sources(stack)
    operation_id = (await stack.start(sources)).operation.progress.operation_id

    for call in (
        stack.stub.GetMerge(api.GetMergeRequest(operation_id=operation_id), metadata=stack.user(OTHER)),
        stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user(OTHER)),
        stack.stub.ResumeMerge(
            api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=1), metadata=stack.user(OTHER)
        ),
    ):
        await refused(call, grpc.StatusCode.PERMISSION_DENIED, "MERGE_PERMISSION_DENIED")
    await stack.new_session("mine", owner=OTHER)
    details, _ = await refused(
        stack.start(["mine", "a"], owner=OTHER), grpc.StatusCode.PERMISSION_DENIED, "SESSION_PERMISSION_DENIED"
    )
    assert details.domain == "transcript.continuum"
    await refused(stack.get("0" * 32), grpc.StatusCode.NOT_FOUND, "MERGE_OPERATION_NOT_FOUND")
    assert (await stack.get(operation_id, OWNER)).progress.operation_id == operation_id


async def test_a_child_session_is_not_a_source(stack: MergeStack) -> None:
    await two_sources(stack)
    await stack.new_session("a-child", parent="a")

    details, _ = await refused(stack.start(["a-child", "b"]), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")

    assert details.violations[0].field == "source_session_ids[0]"
