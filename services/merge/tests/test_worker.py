"""The worker inside the merge service: leased runs, the unit commit protocol, pause, cancel, publish,
and a graceful stop handing the operation to another replica. The stages are scripted
(`pipeline_testing`); transcript, merge and both databases are real."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from deadline_testing import eventually
from merge_testing import MergeStack, refused, running_merge, running_merge_service
from pipeline_testing import ScriptedPipeline
from sqlalchemy import text
from transcript_testing import all_messages

from continuum.merge.v1 import error_code_pb2
from continuum.merge.v1 import merge_service_pb2 as api
from continuum.merge.v1 import resources_pb2 as pb
from continuum.transcript.v1 import resources_pb2 as tpb
from continuum.transcript.v1 import transcript_service_pb2 as tapi
from continuum_merge.pipeline import StageStop

FAST = {
    "lease_ttl_seconds": 2.0,
    "lease_renew_seconds": 0.3,
    "worker_poll_seconds": 0.1,
    "claim_ttl_seconds": 5.0,
    "claim_renew_seconds": 1.0,
    "retry_seconds": 0.2,
}


# Opens of unit result files (work/*.json) in this process while a test counts them (audit hook "open").
opened_results: Counter[str] = Counter()
counting: list[bool] = []


def _count_result_opens(event: str, args: tuple[Any, ...]) -> None:
    if counting and event == "open" and not isinstance(args[0], int):
        path = Path(os.fsdecode(args[0]))
        if path.parent.name == "work" and path.suffix == ".json":
            opened_results[path.name] += 1


sys.addaudithook(_count_result_opens)


@pytest.fixture
def pipeline() -> ScriptedPipeline:
    return ScriptedPipeline()


@pytest.fixture
async def stack(tmp_path: Path, database_url: str, pipeline: ScriptedPipeline) -> AsyncIterator[MergeStack]:
    async with running_merge(tmp_path, database_url, pipeline=pipeline, overrides=FAST) as started:
        yield started


async def started(stack: MergeStack) -> str:
    for session_id in ("a", "b"):
        await stack.new_session(session_id, texts=2)
    return (await stack.start(["a", "b"], title="Merged")).operation.progress.operation_id


async def reaches(stack: MergeStack, operation_id: str, status: pb.MergeStatus.ValueType) -> pb.MergeOperation:
    async def check() -> bool:
        return (await stack.get(operation_id)).progress.status == status

    await eventually(check, what=f"operation {pb.MergeStatus.Name(status)}")
    return await stack.get(operation_id)


async def rows(stack: MergeStack, query: str, **values: object) -> list[tuple[object, ...]]:
    async with stack.database.connection() as connection:
        return [tuple(row) for row in await connection.execute(text(query), values)]


async def test_a_merge_runs_to_a_published_target(stack: MergeStack, pipeline: ScriptedPipeline) -> None:
    operation_id = await started(stack)

    done = await reaches(stack, operation_id, pb.MERGE_STATUS_COMPLETED)

    progress = done.progress
    assert (progress.stage, progress.target_available, progress.snapshot_sealed) == (
        pb.MERGE_STAGE_COMPLETED,
        True,
        True,
    )
    assert (progress.progress.completed_units, progress.progress.known_units, progress.progress.total_final) == (
        3,
        3,
        True,
    )
    assert not progress.locked_source_session_ids
    assert (progress.can_cancel, progress.can_resume) == (False, False)
    # The target: a MERGED root bound to the operation, with one program-written entry message.
    target = (
        await stack.transcript.stub.GetSession(
            tapi.GetSessionRequest(session_id=progress.target_session_id), metadata=stack.user()
        )
    ).session
    assert (target.kind, target.parent_session_id, target.title) == (tpb.SESSION_KIND_MERGED, "", "Merged")
    assert (target.model, target.working_directory) == ("primary-model", "/work/a")
    assert target.metadata["sessionMergeOperationId"] == operation_id
    entries = await all_messages(stack.transcript.stub, stack.user(), progress.target_session_id)
    assert len(entries) == 1
    assert entries[0].metadata["historicalReference"] is True
    # The cut recorded at admission is what the snapshot copied: both trees, up to their last messages.
    owner, version, cuts = pipeline.snapshots[0]
    assert (owner, version, [cut.root_session_id for cut in cuts]) == ("alice", 1, ["a", "b"])
    assert all(cut.last_message_ids[cut.root_session_id] > 0 for cut in cuts)
    # The claims are gone, each unit ran once, and every attempt is accounted (output usage unknown).
    await stack.run_claim("a")
    assert [pipeline.calls[f"unit-{index}"] for index in range(3)] == [1, 1, 1]
    attempts = await rows(
        stack,
        "SELECT outcome, input_tokens, output_tokens FROM session_merge_attempts WHERE operation_id = :o",
        o=operation_id,
    )
    assert attempts == [("completed", 10, None)] * 3
    assert not (await stack.stub.GetActiveMerge(api.GetActiveMergeRequest(), metadata=stack.user())).HasField(
        "operation"
    )
    await refused(
        stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user()),
        grpc.StatusCode.FAILED_PRECONDITION,
        "MERGE_ALREADY_COMPLETED",
    )


async def test_a_stage_that_stops_pauses_frees_the_sources_and_resumes(
    stack: MergeStack, pipeline: ScriptedPipeline
) -> None:
    pipeline.stops["snapshot"] = StageStop("DISK_RESERVE", "below the disk reserve", "paused")
    operation_id = await started(stack)

    paused = await reaches(stack, operation_id, pb.MERGE_STATUS_PAUSED)

    assert paused.progress.error_code == error_code_pb2.DISK_RESERVE
    assert paused.progress.error == "below the disk reserve"
    assert not paused.progress.locked_source_session_ids
    claim = await stack.run_claim("a")
    await stack.transcript.stub.ReleaseClaims(tapi.ReleaseClaimsRequest(claim_id=claim), metadata=stack.user())
    resumed = await stack.stub.ResumeMerge(
        api.ResumeMergeRequest(operation_id=operation_id, expected_epoch=paused.progress.run_epoch),
        metadata=stack.user(),
    )
    assert resumed.operation.progress.status == pb.MERGE_STATUS_PREPARING

    await reaches(stack, operation_id, pb.MERGE_STATUS_COMPLETED)
    # The resumed run claimed and cut again, and sealed a new version.
    assert [version for _, version, _ in pipeline.snapshots] == [2]


async def test_cancel_stops_the_run_and_removes_its_package(stack: MergeStack, pipeline: ScriptedPipeline) -> None:
    pipeline.holds["unit-1"] = asyncio.Event()
    operation_id = await started(stack)
    await eventually(lambda: "unit-1" in pipeline.waiting, what="unit-1 running")
    package = stack.settings.resolved_package_root() / operation_id
    assert (package / "work" / "unit-0.json").exists()

    cancelled = await stack.stub.CancelMerge(api.CancelMergeRequest(operation_id=operation_id), metadata=stack.user())

    assert cancelled.operation.progress.status == pb.MERGE_STATUS_CANCELLED

    async def cleaned() -> bool:
        leases = await rows(stack, "SELECT lease_owner FROM session_merges WHERE operation_id = :o", o=operation_id)
        return leases == [(None,)] and not package.exists()

    await eventually(cleaned, what="the run stopped and the package removed")
    attempts = await rows(
        stack,
        "SELECT unit_id, outcome FROM session_merge_attempts WHERE operation_id = :o ORDER BY unit_id",
        o=operation_id,
    )
    assert attempts == [("unit-0", "completed"), ("unit-1", "cancelled")]
    await refused(
        stack.transcript.stub.GetSession(
            tapi.GetSessionRequest(session_id=cancelled.operation.progress.target_session_id), metadata=stack.user()
        ),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )


async def test_a_graceful_stop_hands_the_operation_to_another_replica(
    tmp_path: Path, database_url: str, pipeline: ScriptedPipeline
) -> None:
    pipeline.holds["unit-1"] = asyncio.Event()
    async with running_merge(tmp_path, database_url, pipeline=pipeline, overrides=FAST) as first:
        operation_id = await started(first)
        await eventually(lambda: "unit-1" in pipeline.waiting, what="unit-1 running on the first replica")
        epoch = (await first.get(operation_id)).progress.run_epoch
        async with running_merge_service(
            tmp_path, database_url, first.transcript, pipeline=pipeline, overrides=FAST
        ) as second:
            # The first replica holds the lease: the second leaves the operation alone until it stops.
            await first.service.stop(grace=0)

            done = await reaches(second, operation_id, pb.MERGE_STATUS_COMPLETED)

    assert done.progress.run_epoch == epoch + 1
    # unit-0 was committed by the first replica and reused; unit-1 ran again after its cancelled attempt.
    assert (pipeline.calls["unit-0"], pipeline.calls["unit-1"], pipeline.calls["unit-2"]) == (1, 2, 1)
    assert pipeline.calls["snapshot"] == 1


async def test_resuming_with_another_model_keeps_completed_units(stack: MergeStack, pipeline: ScriptedPipeline) -> None:
    pipeline.stops["unit-1"] = StageStop("PROVIDER_UNAVAILABLE", "the model kept failing", "paused")
    operation_id = await started(stack)
    paused = await reaches(stack, operation_id, pb.MERGE_STATUS_PAUSED)
    assert paused.progress.error_code == error_code_pb2.PROVIDER_UNAVAILABLE
    assert (paused.progress.progress.completed_units, paused.progress.progress.known_units) == (1, 3)

    await stack.stub.ResumeMerge(
        api.ResumeMergeRequest(
            operation_id=operation_id, expected_epoch=paused.progress.run_epoch, model="other-model"
        ),
        metadata=stack.user(),
    )
    await reaches(stack, operation_id, pb.MERGE_STATUS_COMPLETED)

    units = await rows(
        stack, "SELECT unit_id, model FROM session_merge_units WHERE operation_id = :o ORDER BY unit_id", o=operation_id
    )
    assert [model for _, model in units][1:] == ["other-model", "other-model"]
    assert units[0][1] != "other-model"
    assert (pipeline.calls["unit-0"], pipeline.calls["unit-1"]) == (1, 2)
    attempts = await rows(
        stack,
        "SELECT outcome FROM session_merge_attempts WHERE operation_id = :o AND unit_id = 'unit-1' ORDER BY start_ms",
        o=operation_id,
    )
    assert attempts == [("error",), ("completed",)]


async def test_a_unit_that_does_not_fit_is_split_and_its_halves_run_in_its_place(
    stack: MergeStack, pipeline: ScriptedPipeline
) -> None:
    pipeline.splits.add("unit-1")
    operation_id = await started(stack)

    done = await reaches(stack, operation_id, pb.MERGE_STATUS_COMPLETED)

    assert (done.progress.progress.completed_units, done.progress.progress.known_units) == (4, 4)
    units = await rows(
        stack,
        "SELECT unit_id, state, input_json FROM session_merge_units WHERE operation_id = :o ORDER BY ordinal, unit_id",
        o=operation_id,
    )
    assert [(unit_id, state) for unit_id, state, _ in units] == [
        ("unit-0", "completed"),
        ("unit-1", "split"),
        ("unit-1.0", "completed"),
        ("unit-1.1", "completed"),
        ("unit-2", "completed"),
    ]
    assert '"childUnitIds":["unit-1.0","unit-1.1"]' in str(units[1][2])
    ready = json.loads((stack.settings.resolved_package_root() / operation_id / "handoff" / "ready.json").read_text())
    assert list(ready) == ["unit-0.json", "unit-1.0.json", "unit-1.1.json", "unit-2.json"]


async def test_units_are_read_a_page_at_a_time_and_splits_never_rehash_finished_units(
    tmp_path: Path, database_url: str
) -> None:
    # 30 units in pages of 4; every third one splits, some at a page's last row. Each committed result is
    # opened once, by the aggregation: the worker does not verify units this run completed itself, and a
    # split does not start the pass over.
    pipeline = ScriptedPipeline(units=30, splits={f"unit-{index}" for index in range(0, 30, 3)})
    overrides = {**FAST, "unit_page_size": 4}
    async with running_merge(tmp_path, database_url, pipeline=pipeline, overrides=overrides) as stack:
        opened_results.clear()
        counting.append(True)
        try:
            operation_id = await started(stack)
            done = await reaches(stack, operation_id, pb.MERGE_STATUS_COMPLETED)
        finally:
            counting.clear()
        units = await rows(
            stack,
            "SELECT unit_id, state FROM session_merge_units WHERE operation_id = :o ORDER BY ordinal, unit_id",
            o=operation_id,
        )
    assert done.progress.progress.completed_units == 40
    completed = [str(unit_id) for unit_id, state in units if state == "completed"]
    assert len(completed) == 40 and [unit_id for unit_id, state in units if state == "split"] == [
        f"unit-{index}" for index in range(0, 30, 3)
    ]
    assert opened_results == Counter({f"{unit_id}.json": 1 for unit_id in completed})
    # Every unit that completed ran once (a split parent's one call asked for halves instead).
    assert all(pipeline.calls[unit_id] == 1 for unit_id in completed)
